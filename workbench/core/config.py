"""The run configuration: one typed object shared by the CLI, papermill parameters and notebooks. Its run-wide
settings are declared here; each registered step adds its own section (a `StepSettings` declared in the step's room)."""
from __future__ import annotations

import difflib
import functools
import os
import re
import warnings
from collections.abc import Callable, Sequence
from enum import Enum
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Self, Union, cast, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator
from pydantic_core import ErrorDetails

from workbench.core import dotted, registry
from workbench.core.data import load_corpus
from workbench.core.errors import ConfigError, ShapeError
from workbench.tasks.choice import AUTO, TaskChoice, choose_task
from workbench.tasks.registry import TASKS, OutputSpec

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
# Settings that existed once, and what replaces them.
REMOVED = {"bench.enabled": "measuring is the bench step's job now: leave bench out of --steps to measure nothing, "
                            "and --resume --steps report re-renders the report"}
# Settings that moved: the old key, the new one (old keys keep working, with a FutureWarning).
RENAMED_SETTINGS = {
    "repair_max_builds": "parity.repair.max_builds", "repair": "parity.repair",
    "reference_cache_dir": "parity.reference_cache_dir", "graph_form": "optimize.graph_form",
    "borrowed_rules": "optimize.borrowed_rules", "openvino": "optimize.openvino",
    "fp16_op_block_list": "optimize.fp16.op_block_list", "fp16_node_block_list": "optimize.fp16.node_block_list",
    "int8_per_channel": "optimize.int8.per_channel", "int8_nodes_to_exclude": "optimize.int8.nodes_to_exclude",
    "trt_profiles": "tensorrt.profiles", "trt_workspace_mb": "tensorrt.workspace_mb",
    "engine_cache_dir": "tensorrt.engine_cache_dir",
    **{f"triton.{key}": f"deploy.{key}" for key in ("container_image", "image_registry", "target_rps", "burst_factor",
                                                      "queue_target_ms", "storage_uri")}}
# Sections a bool turns on or off (`-p parity.repair=false`): the bool is their `enabled`, their other keys stay.
SWITCHES = ("parity.repair",)
_ABSENT = object()  # a key not given at all (a value of None is given)
# Graph outputs that were renamed: the old name, the new one.
RENAMED_OUTPUTS = {"last_hidden_state": "token_embeddings"}
Precision = Literal["fp32", "fp16", "bf16", "int8"]
OUTPUTS_VARIABLE = "WORKBENCH_OUTPUTS"


def outputs_root() -> Path:
    """Where runs go: $WORKBENCH_OUTPUTS, else outputs/ in the working directory (a notebook's is its own folder)."""
    return Path(os.environ.get(OUTPUTS_VARIABLE) or "outputs")


def found_here(value: str | None) -> str | None:
    """A relative path that exists from the working directory, made absolute (symbolic links kept): the step
    notebooks run in notebooks/, where it would name nothing. Anything else (an HF id) stays as written."""
    if value and not Path(value).is_absolute() and Path(value).expanduser().exists():
        return os.path.abspath(os.path.expanduser(value))
    return value


def from_here(value: str | None) -> str | None:
    """A folder the steps write to, made absolute from the working directory (the notebooks run in notebooks/)."""
    return os.path.abspath(os.path.expanduser(value)) if value else value


class Settings(BaseModel):
    """A group of settings: an unknown key is refused, a value is checked when it is set."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)  # JSON has no inf


class StepSettings(Settings):
    """A step's section of the run configuration, declared by the step (`StepSpec.settings`) in the room that reads
    it, and kept under the step's name (`-p <step>.<setting>`, YAML `<step>:`, run.json `config.<step>`)."""

    def check(self, config: RunConfig) -> None:
        """A check of this section against the run's other settings (ValueError naming the problem and its fix),
        when the configuration is read."""

    @classmethod
    def of(cls, config: RunConfig) -> Self:
        """This section of `config`."""
        for name in config.sections():
            section = getattr(config, name)
            if isinstance(section, cls):
                return section
        raise ConfigError(f"no registered step declares the settings {cls.__name__}",
                          "import workbench.steps (it registers the steps and their settings) before reading them")


Count = Annotated[int, Field(ge=1)]  # an item of a list of counts (texts, tokens, clients, instances)
Port = Annotated[int, Field(ge=1, le=65535)]


def at_least_one(value: int | Literal["auto"]) -> int | Literal["auto"]:
    """A count that may be auto, checked: at least 1 (a field validator; the error names the setting)."""
    if value != "auto" and value < 1:
        raise ValueError("must be at least 1 (or auto)")
    return value


class ShapeRange(Settings):
    """Smallest, most frequent and largest value of one dynamic axis."""

    min: int = Field(ge=1)
    opt: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> ShapeRange:
        if not self.min <= self.opt <= self.max:
            raise ValueError(f"need min <= opt <= max, got {self.min}, {self.opt}, {self.max}")
        return self


class BatchRange(ShapeRange):
    """Texts per batch, and the padded tokens one batch may hold (`max_tokens`; auto follows the model's shape:
    `models.footprint.token_budget`)."""

    max_tokens: int | Literal["auto"] = Field(default="auto", description=(
        "padded tokens (texts x tokens) one batch may hold: the parity lab's shape corners and the batches the "
        "served Python model runs stay within it (a request past it runs in pieces, its answers joined); auto: "
        "about 0.25 GiB of activations for the model's shape at sequence.max (less where the memory limit leaves less "
        "than 1 GiB past the model's need), at least one text at sequence.max"))

    _positive = field_validator("max_tokens")(staticmethod(at_least_one))


AUTO_OPT = 128  # sequence.opt when auto: the corpus's common lengths lie below it, and max caps it


class SequenceSetting(Settings):
    """Tokens per text: `auto` follows the model (max: its own limit as its library applies it; opt: the smaller of
    AUTO_OPT and max). Checked against the model by `resolve`, which lists every problem at once."""

    min: int = 1
    opt: int | Literal["auto"] = "auto"
    max: int | Literal["auto"] = "auto"

    def resolve(self, limit: int, limit_source: str = "the model's limit") -> ShapeRange:
        """The range this run uses for a model that takes at most `limit` tokens; ShapeError listing every problem
        (a setting below 1, out of order, or past the limit) with the values that fix them."""
        top = limit if self.max == "auto" else self.max
        opt = min(AUTO_OPT, top) if self.opt == "auto" else self.opt
        problems = [f"sequence.{name}={value} is below 1" for name, value, auto in
                    (("min", self.min, False), ("opt", opt, self.opt == "auto"), ("max", top, False))
                    if value < 1 and not auto]  # an auto opt below 1 follows a max below 1: that one is named
        if top > limit:
            problems.append(f"sequence.max={top} exceeds the model's limit of {limit} tokens ({limit_source})")
        if not self.min <= opt <= top and not (self.opt == "auto" and top < 1):  # an auto opt follows a bad max
            auto_opt, auto_max = (" (auto)" if value == "auto" else "" for value in (self.opt, self.max))
            problems.append(f"need sequence.min <= opt <= max, got {self.min}, {opt}{auto_opt}, {top}{auto_max}")
        if problems:
            best = limit if top > limit else top if top >= 1 else min(AUTO_OPT, limit)
            good_opt = opt if 1 <= opt <= best else min(AUTO_OPT, best)
            example = f"-p sequence.max={best}" + ("" if self.opt == "auto" else f" -p sequence.opt={good_opt}")
            raise ShapeError("; ".join(problems), (
                "leave sequence.max and sequence.opt at auto (the model's own limit, then the smaller of "
                f"{AUTO_OPT} and max), or set values with 1 <= sequence.min <= sequence.opt <= sequence.max <= "
                f"{limit}, e.g. {example}"))
        return ShapeRange(min=self.min, opt=opt, max=top)

    def sources(self, limit_source: str) -> dict[str, str]:
        """Where each resolved value comes from (run.json `metrics.export.sequence.sources`)."""
        return {"min": "configured (sequence.min)",
                "opt": f"auto: the smaller of {AUTO_OPT} and max" if self.opt == "auto" else
                "configured (sequence.opt)",
                "max": f"auto: {limit_source}" if self.max == "auto" else "configured (sequence.max)"}


class Tolerance(Settings):
    """Pass criteria for one output; unset fields fall back to the task-aware default."""

    atol: float | None = Field(default=None, ge=0)
    rtol: float | None = Field(default=None, ge=0)
    min_cosine: float | None = Field(default=None, ge=-1, le=1)
    min_agreement: float | None = Field(default=None, ge=0, le=1)
    min_agreement_at_1: float | None = Field(default=None, ge=0, le=1, description=(
        "embeddings: share of corpus texts whose nearest neighbour is PyTorch's; rerankers: share of queries whose "
        "top document is the reference's"))
    min_recall_at_10: float | None = Field(default=None, ge=0, le=1, description=(
        "embeddings: mean share of PyTorch's 10 nearest neighbours found among the variant's 10"))
    min_spearman: float | None = Field(default=None, ge=-1, le=1, description=(
        "embeddings: rank correlation of all pairwise similarities with PyTorch's"))
    min_kendall_tau: float | None = Field(default=None, ge=-1, le=1, description=(
        "rerankers: mean Kendall tau of each query's document order against the reference's"))
    min_top_k_overlap: float | None = Field(default=None, ge=0, le=1, description=(
        "sparse embeddings: the smallest share, over texts, of the reference's 20 heaviest terms among the variant's"))
    max_dot_error: float | None = Field(default=None, ge=0, description=(
        "sparse embeddings: the largest error of a pair of texts' dot product, relative to the largest reference one"))


TargetCpu = Literal["host", "avx2", "avx512", "avx512_vnni", "avx_vnni", "amx"]


class TargetSettings(Settings):
    """The machine the deployment is for: what `precisions: auto` builds follows it."""

    cpu: TargetCpu = Field(default="host", description=(
        "host: this machine, where reduced precisions are built only when measured faster than fp32; or the "
        "instruction set of another CPU the deployment is for (avx2, avx512, avx512_vnni, avx_vnni, amx)"))


class PreflightSettings(Settings):
    memory: Literal["refuse", "warn"] = Field(default="refuse", description=(
        "refuse: a run whose steps need more memory at their peak than its limit (the cgroup's, else the machine's) "
        "stops before anything runs; warn: says so and goes on (a step that runs out stops with OutOfMemoryError)"))


class RunConfig(Settings):
    """Everything a run needs to know; defaults run the embedded MiniLM on this machine. The run-wide settings are
    declared here, each step's section by the step (`StepSettings`): `RunConfig(...)`, `load` and `model_validate`
    give the configuration assembled from the registered steps (`assembled`)."""

    model: str = Field(DEFAULT_MODEL, description="HF model id, local folder, or the embedded default")
    task: str = Field(default=AUTO, description=(
        "auto: the task of the head a model folder's config.json names (a sequence or token classifier) where it has "
        "no sentence-transformers files, else feature-extraction; recorded with why in metrics.export"))
    pooling: Literal["auto", "mean", "cls", "max", "lasttoken", "mean_sqrt_len_tokens", "weightedmean", "none"] = Field(
        default="auto", description=(
            "feature extraction: auto reads the model's sentence-transformers files (1_Pooling/config.json), mean "
            "where it has none; a mode the files contradict needs pooling_override; none: token embeddings only"))
    pooling_override: bool = Field(default=False, description=(
        "pool as `pooling` says although the model's files declare another mode (the record notes it)"))
    token_embeddings: bool = Field(default=True, description=(
        "feature extraction: the graph also returns the per-token states (token_embeddings)"))
    truncate_dim: int | None = Field(default=None, ge=1, description=(
        "feature extraction: the sentence embedding's first truncate_dim values, cut as encode(truncate_dim=...) "
        "cuts (Matryoshka); default: the model's own truncate_dim (config_sentence_transformers.json), else none"))
    trust_remote_code: bool = False
    exporter: Literal["legacy", "dynamo"] = "legacy"
    opset: int = 17
    attn_implementation: Literal["eager", "sdpa"] = Field(default="eager", description=(
        "the attention the graph is exported with (eager: the pattern ONNX Runtime fuses); the PyTorch reference "
        "runs sdpa where the architecture has it"))
    batch: BatchRange = BatchRange(min=1, opt=8, max=32)
    sequence: SequenceSetting = Field(default_factory=SequenceSetting, description=(
        "tokens per text; auto: max is the model's own limit (what its library cuts at), opt the smaller of 128 "
        "and max"))
    precisions: list[Precision] | Literal["auto"] = Field(default="auto", description=(
        "variants to build and check; auto: fp32, fp16 where the deployment serves it (a GPU, a CPU with "
        "AVX512-FP16 or AMX-FP16, measured), bf16 on OpenVINO where this CPU has bf16 and it runs faster, int8 where "
        "it pays (measured against fp32 on this host, or a target CPU with int8 dot-product instructions)"))
    target: TargetSettings = TargetSettings()
    tolerances: dict[str, Tolerance] = Field(default_factory=dict, description="per output name")
    corpus: str | None = Field(default=None, description="UTF-8 text file, one text per line; default: shipped")
    corpus_max_texts: int = Field(default=2000, ge=1, description=(
        "texts kept from the corpus (a seeded uniform sample when it holds more; recorded in run.json `corpus`)"))
    preflight: PreflightSettings = PreflightSettings()
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int | None = Field(default=None, ge=1, description="intra-op threads for torch and ORT")
    output_dir: str | None = None
    steps: list[str] = Field(default_factory=lambda: list(registry.step_names()), description=(
        "the steps to run by name, run in pipeline order: `workbench steps` lists them; e.g. --steps export,optimize"))
    seed: int = 0
    _inputs_here = field_validator("model", "corpus")(staticmethod(found_here))

    def __new__(cls, *args: Any, **kwargs: Any) -> RunConfig:
        """An instance of the assembled configuration where this base class is called."""
        return super().__new__(assembled() if cls is RunConfig else cls)

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> Self:  # type: ignore[override]
        """pydantic's, by the assembled configuration where this base class is called."""
        if cls is RunConfig:
            return cast(Self, assembled().model_validate(obj, *args, **kwargs))
        return super().model_validate(obj, *args, **kwargs)

    def __reduce__(self) -> tuple[Callable[..., RunConfig], tuple[object]]:
        """Pickled as its settings (the assembled class is made at runtime, pickle could not name it)."""
        return RunConfig.from_dict, (self.to_params(),)

    def sections(self) -> list[str]:
        """The steps' sections this configuration holds, by name."""
        return [name for name, field in type(self).model_fields.items()
                if isinstance(field.annotation, type) and issubclass(field.annotation, StepSettings)]

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        """Settings that moved, read at their old key (`moved`)."""
        return moved(data) if isinstance(data, dict) else data

    @field_validator("task")
    @classmethod
    def _known_task(cls, task: str) -> str:
        if task not in TASKS and task != AUTO:
            raise ValueError(f"unknown task {task!r}; known tasks: {AUTO}, {', '.join(TASKS)}")
        return task

    @field_validator("steps")
    @classmethod
    def _known_steps(cls, steps: list[str]) -> list[str]:
        names = registry.step_names()
        unknown = [s for s in steps if s not in names]
        if unknown:
            close = {s: difflib.get_close_matches(s, names, n=1) for s in unknown}
            hints = "".join(f" ({s!r}: did you mean {c[0]!r}?)" for s, c in close.items() if c)
            raise ValueError(f"unknown steps {unknown}{hints}; steps are: {', '.join(names)}")
        return [s for s in names if s in steps]

    @model_validator(mode="after")
    def _known_outputs(self) -> RunConfig:
        """A tolerance for an output the task does not have would silently gate nothing."""
        outputs = [o.name for o in self.output_specs]
        if not outputs:
            raise ValueError("pooling=none with token_embeddings=false leaves the graph no output; keep one of them")
        unknown = [name for name in self.tolerances if name not in outputs]
        if unknown:
            close = {n: RENAMED_OUTPUTS.get(n) or next(iter(difflib.get_close_matches(n, outputs, n=1)), None)
                     for n in unknown}
            hints = "".join(f" ({n!r}: did you mean {c!r}?)" for n, c in close.items() if c)
            raise ValueError(f"tolerances for unknown outputs {unknown}{hints}; {self.task_choice.name} with pooling "
                             f"{self.pooling} has outputs: {', '.join(outputs)}")
        return self

    @model_validator(mode="after")
    def _sections_agree(self) -> RunConfig:
        """Each step's section checked against the run's other settings (`StepSettings.check`)."""
        for name in self.sections():
            section = getattr(self, name)
            if isinstance(section, StepSettings):
                section.check(self)
        return self

    @property
    def output_specs(self) -> tuple[OutputSpec, ...]:
        """The graph outputs this configuration exports, in order."""
        return TASKS[self.task_choice.name].outputs(self.pooling != "none", self.token_embeddings)

    @property
    def task_choice(self) -> TaskChoice:
        """The task this run exports (`task`, or the one `auto` reads from the model's files) and why."""
        return choose_task(self.task, self.model)

    def texts(self) -> tuple[str, ...]:
        """The run's corpus: `corpus` (default: the shipped one), at most `corpus_max_texts` texts."""
        return load_corpus(self.corpus, self.corpus_max_texts)

    @property
    def model_slug(self) -> str:
        """A file-name-safe short name for the model."""
        return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(self.model.rstrip("/\\")).name).strip("-") or "model"

    def to_params(self) -> dict[str, Any]:
        """JSON-safe dict for papermill parameters and run.json."""
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> RunConfig:
        try:
            return cls.model_validate(data or {})
        except ValidationError as exc:
            raise _config_error(exc, "the configuration") from None

    @classmethod
    def load(cls, path: Path | str | None = None, overrides: list[str] | None = None,
             base: dict[str, Any] | None = None, values: dotted.Tree | None = None) -> RunConfig:
        """Defaults (or `base`, a configuration the workbench wrote: a run's, whose moved keys are taken without a
        warning), then a YAML file, then `key=value` overrides, then `values` already typed (dotted keys for nested
        fields in both)."""
        data = cls().to_params()
        _merge(data, quietly_moved(base or {}))
        if path is not None:
            _merge(data, moved(_read_yaml(Path(path))))
        for key, value in [_parse_override(item) for item in overrides or []] + list((values or {}).items()):
            dotted.put(data, *switched(moved_key(key), value))
        return cls.from_dict(data)


def assembled() -> type[RunConfig]:
    """The run configuration with the sections the registered steps declare, each under its step's name."""
    return _assembled(tuple((step.name, step.settings) for step in registry.facts() if step.settings))


@functools.cache
def _assembled(sections: tuple[tuple[str, type[BaseModel]], ...]) -> type[RunConfig]:
    return create_model("RunConfig", __base__=RunConfig, __module__=__name__, __doc__=RunConfig.__doc__,
                        **{name: (model, Field(default_factory=model)) for name, model in sections})


def moved_key(key: str) -> str:
    """A dotted key at its new place when it or a key above it moved (`RENAMED_SETTINGS`; a FutureWarning names the
    new key), else as given."""
    for old, new in RENAMED_SETTINGS.items():
        if key == old or key.startswith(f"{old}."):
            warnings.warn(f"setting {old!r} is now {new!r}", FutureWarning, stacklevel=3)
            return new + key[len(old):]
    return key


def switched(key: str, value: Any) -> tuple[str, Any]:
    """`key=value`, a bool for a switched section (`SWITCHES`) given to its `enabled`."""
    return (f"{key}.enabled", value) if key in SWITCHES and isinstance(value, bool) else (key, value)


def moved(data: dict[str, Any]) -> dict[str, Any]:
    """`data` (a configuration as written, before the defaults join it) with the settings that moved at their new
    keys (a value set at both keys is the new key's) and the switched sections' bools at their `enabled`."""
    data = {key: dict(value) if isinstance(value, dict) else value for key, value in data.items()}
    for old in [key for key in RENAMED_SETTINGS if dotted.get(data, key, _ABSENT) is not _ABSENT]:
        value = dotted.get(data, old)
        dotted.pop(data, old)
        key, value = switched(moved_key(old), value)
        there = dotted.get(data, key)
        if there is None:
            dotted.put(data, key, value)
        elif isinstance(there, dict) and isinstance(value, dict):
            dotted.put(data, key, {**value, **there})
    for section in SWITCHES:
        if isinstance(dotted.get(data, section), bool):
            dotted.put(data, section, {"enabled": dotted.get(data, section)})
    return data


def quietly_moved(data: dict[str, Any]) -> dict[str, Any]:
    """`moved` without its FutureWarnings: for a configuration an older workbench wrote (a run record's), which the
    user did not type and need not change."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return moved(data)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist", "pass the path of a YAML run configuration")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}", "fix the YAML syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} holds a {type(data).__name__}, not a mapping", "write key: value pairs")
    return data


def _merge(base: dict[str, Any], update: dict[str, Any]) -> None:
    """Deep-merge `update` into `base` so a partial nested mapping keeps the other defaults."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def _parse_override(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} is not key=value", "write e.g. -p opset=17 or -p batch.max=16")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _model_at(path: Sequence[int | str]) -> type[BaseModel] | None:
    """The settings model at `path` (e.g. ("batch",) -> ShapeRange), None where `path` names no model."""
    model: type[BaseModel] = assembled()
    parts = list(path)
    while parts:
        field = model.model_fields.get(str(parts.pop(0)))
        annotation = field.annotation if field else None
        if get_origin(annotation) is dict and parts:  # e.g. tolerances.<output>: the key, then its model
            parts.pop(0)
            annotation = get_args(annotation)[1]
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _fields_at(path: Sequence[int | str]) -> list[str]:
    """The setting names one level below `path` (e.g. ("batch",) -> min, opt, max)."""
    model = _model_at(path)
    return list(model.model_fields) if model else []


def _choices(annotation: object) -> str:
    """The values a Literal annotation allows, in words (a list of them, or one of several forms); "" for others."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return ", ".join(str(arg) for arg in args)
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return ", ".join(str(member.value) for member in annotation)
    if origin in (list, tuple) and args:
        inner = _choices(args[0])
        return f"a list of {inner}" if inner else ""
    if origin in (Union, UnionType):
        found = [choice for arg in args if (choice := _choices(arg))]
        plain = [get_args(arg)[0] if get_origin(arg) is Annotated else arg for arg in args]  # constrained numbers
        numbers = [NUMBER_WORDS[arg] for arg in plain if arg in NUMBER_WORDS]
        return ", or ".join(numbers + found) if found else ""
    return ""


NUMBER_WORDS = {int: "a whole number", float: "a number"}  # beside a Literal's values: "a whole number, or auto"


def _valid(path: Sequence[int | str]) -> str:
    """What the setting at `path` takes (a list item: its list's): its allowed values, else its description."""
    names = [part for part in path if isinstance(part, str)]
    model = _model_at(names[:-1]) if names else None
    field = model.model_fields.get(names[-1]) if model else None
    if field is None:
        return ""
    choices = _choices(field.annotation)
    return f": {choices}" if choices else f" ({field.description})" if field.description else ""


_UNION_TAGS = {"int", "float", "str", "bool", "none"}  # a union's plain alternatives, as pydantic names them


def _setting_path(err: ErrorDetails) -> list[int | str]:
    """An error's path without the union alternatives pydantic names in it ("list[literal[...]]",
    "constrained-float")."""
    return [p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or "-" in p or p in _UNION_TAGS))]


def _most_specific(errors: list[ErrorDetails]) -> list[ErrorDetails]:
    """Of the errors a union's alternatives give for one setting, those that went deepest (`precisions.1` is not
    one of the listed values, rather than `precisions` is not 'auto')."""
    union = [e for e in errors if len(_setting_path(e)) < len(e["loc"])]
    deepest: dict[int | str, int] = {}
    for err in union:
        deepest[err["loc"][0]] = max(deepest.get(err["loc"][0], 0), len(_setting_path(err)))
    return [e for e in errors if e not in union or len(_setting_path(e)) == deepest[e["loc"][0]]]


def _config_error(exc: ValidationError, where: str) -> ConfigError:
    lines = []
    fixes = []
    for err in _most_specific(exc.errors()):
        loc = ".".join(str(p) for p in _setting_path(err))
        if not loc and err["type"] == "model_type":
            lines.append(f"it must be a mapping of settings, got {type(err.get('input')).__name__} "
                         f"{err.get('input')!r}")
            fixes.append("pass key: value pairs, e.g. {\"opset\": 18}")
            continue
        if err["type"] == "model_type":  # a section given one value
            keys = _fields_at(_setting_path(err))
            switch = f" (-p {loc}=true or false turns it on or off)" if loc in SWITCHES else ""
            lines.append(f"{loc} is a section of settings ({', '.join(keys)}), not one value (got "
                         f"{err.get('input')!r})")
            fixes.append(f"set its settings one by one, e.g. -p {loc}.{keys[0]}=...{switch}; `workbench config` "
                         "prints them")
            continue
        if not loc:  # a check across settings
            lines.append(err["msg"].removeprefix("Value error, "))
            fixes.append("fix the names or values it lists; `workbench config` prints every setting")
            continue
        if err["type"] == "extra_forbidden":
            field = str(err["loc"][-1])
            close = difflib.get_close_matches(field, _fields_at(err["loc"][:-1]), n=1)
            section = loc.rpartition(".")[0]
            head, _, rest = field.partition("_")  # a notebook's name for it: sequence_max is sequence.max
            nested = f"{head}.{rest}" if rest and rest in _fields_at((*err["loc"][:-1], head)) else None
            hint = f" (did you mean {'.'.join(filter(None, (section, nested or close[0])))!r}?)" \
                if nested or close else ""
            lines.append(f"unknown setting {loc!r}{hint}")
            fixes.append(REMOVED.get(loc, f"remove or rename {loc}; `workbench config` prints every setting"))
        else:
            said = f"{loc}: {err['msg'].removeprefix('Value error, ')}"
            earlier = next((i for i, line in enumerate(lines) if line.startswith(f"{loc}: ")), None)
            if earlier is None:  # a union's alternatives for one setting: one line, "... or ..."
                lines.append(f"{said} (got {err.get('input')!r})")
            else:
                lines[earlier] = lines[earlier].replace(" (got ", f" or {said.removeprefix(loc + ': ')} (got ", 1)
            fixes.append(f"set {loc} to a valid value{_valid(_setting_path(err))}")
    return ConfigError(f"invalid settings in {where}: " + "; ".join(lines), "; ".join(dict.fromkeys(fixes)))

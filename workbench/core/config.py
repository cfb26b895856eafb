"""The run configuration: one typed object shared by the CLI, papermill parameters and notebooks."""
from __future__ import annotations

import difflib
import os
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from workbench.core import dotted
from workbench.core.data import load_corpus
from workbench.core.errors import ConfigError, ShapeError
from workbench.core.flavor import Flavor
from workbench.core.tasks import AUTO, TASKS, OutputSpec, TaskChoice, choose_task, served_outputs

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
# Tasks one Python model serves, and what it takes and answers.
ONE_PYTHON_MODEL = {"rerank": "a query and its documents in, scores out",
                    "sparse-embedding": "texts in, each one's active vocabulary terms and weights out"}
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
    "engine_cache_dir": "tensorrt.engine_cache_dir"}
# Sections a bool turns on or off (`-p parity.repair=false`): the bool is their `enabled`, their other keys stay.
SWITCHES = ("parity.repair",)
# Graph outputs that were renamed: the old name, the new one.
RENAMED_OUTPUTS = {"last_hidden_state": "token_embeddings"}
Precision = Literal["fp32", "fp16", "bf16", "int8"]
OUTPUTS_VARIABLE = "WORKBENCH_OUTPUTS"
REPOSITORY_VARIABLE = "WORKBENCH_REPOSITORY"  # where repositories publish when triton.repository_dir is unset


def _step_names() -> tuple[str, ...]:
    """The registered steps in run order (imported here: the catalog's StepSpec carries results' Metrics, and
    results reads this module)."""
    from workbench.core.catalog import step_names

    return step_names()


def outputs_root() -> Path:
    """Where runs go: $WORKBENCH_OUTPUTS, else outputs/ in the working directory (a notebook's is its own folder)."""
    return Path(os.environ.get(OUTPUTS_VARIABLE) or "outputs")


def _found_here(value: str | None) -> str | None:
    """A relative path that exists from the working directory, made absolute (symbolic links kept): the step
    notebooks run in notebooks/, where it would name nothing. Anything else (an HF id) stays as written."""
    if value and not Path(value).is_absolute() and Path(value).expanduser().exists():
        return os.path.abspath(os.path.expanduser(value))
    return value


def _from_here(value: str | None) -> str | None:
    """A folder the steps write to, made absolute from the working directory (the notebooks run in notebooks/)."""
    return os.path.abspath(os.path.expanduser(value)) if value else value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)  # JSON has no inf


def at_least_one(setting: str) -> Callable[[int | Literal["auto"]], int | Literal["auto"]]:
    """A validator of a count that may be auto: at least 1, the refusal naming `setting`."""
    def check(value: int | Literal["auto"]) -> int | Literal["auto"]:
        if value != "auto" and value < 1:
            raise ValueError(f"{setting} must be at least 1 (or auto)")
        return value
    return check


class ShapeRange(_Strict):
    """Smallest, most frequent and largest value of one dynamic axis."""

    min: int = Field(ge=1)
    opt: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> ShapeRange:
        if not self.min <= self.opt <= self.max:
            raise ValueError(f"need min <= opt <= max, got {self.min}, {self.opt}, {self.max}")
        return self


# The activations one batch may hold when batch.max_tokens is auto. A token costs about ACTIVATION_FACTOR x 4 bytes
# x (heads x sequence.max + intermediate + hidden) at a layer's peak (the attention scores and the feed-forward
# activations live together): measured with ONNX Runtime on all-mpnet-base-v2 (unfused attention), 32 x 384 tokens,
# 2.1 GB over the session's weights, about 4 such vectors a token. OpenVINO holds more for the same batch (its
# compiled all-mpnet-base-v2: 0.47 GB more at 10 x 384 tokens, 0.3 GB at 5 x 384). A quarter GiB keeps a base-size
# model's parity step within 3 x its weights + 1.5 GB (all-mpnet-base-v2: 5 texts of 384 tokens a batch;
# all-MiniLM-L6-v2 13 of 256).
ACTIVATION_BYTES = 2**28
ACTIVATION_FACTOR = 4
ROOM_SHARE = 4  # where memory is short: the share of what is left past the model's need that activations may take


class BatchRange(ShapeRange):
    """Texts per batch, and the padded tokens one batch may hold (`max_tokens`; auto follows the model's shape:
    `token_budget`)."""

    max_tokens: int | Literal["auto"] = Field(default="auto", description=(
        "padded tokens (texts x tokens) one batch may hold: the parity lab's shape corners and the batches the "
        "served Python model runs stay within it (a request past it runs in pieces, its answers joined); auto: "
        "about 0.25 GiB of activations for the model's shape at sequence.max (less where the memory limit leaves less "
        "than 1 GiB past the model's need), at least one text at sequence.max"))

    _positive = field_validator("max_tokens")(staticmethod(at_least_one("batch.max_tokens")))

    def token_budget(self, per_token: int, sequence_max: int, room: int | None = None) -> tuple[int, str]:
        """The padded tokens one batch may hold, and where the number comes from: the setting, or (auto)
        ACTIVATION_BYTES, or a quarter of `room` (the bytes the memory limit leaves past the step's weights and
        libraries, `memory.activation_room`) where that is less, over `per_token` (a token's activation bytes at a
        layer's peak), never below one text at `sequence_max` nor above `max` texts of it."""
        if self.max_tokens != "auto":
            return self.max_tokens, "configured (batch.max_tokens)"
        activations = ACTIVATION_BYTES if room is None else max(0, min(ACTIVATION_BYTES, room // ROOM_SHARE))
        tokens = min(max(sequence_max, activations // per_token), self.max * sequence_max)
        limited = "" if activations == ACTIVATION_BYTES else (
            f" (1/{ROOM_SHARE} of the {room / 2**30:.2g} GiB the memory limit leaves past the model's need)")
        return tokens, (f"auto: about {activations / 2**30:.2g} GiB of activations{limited} at "
                        f"{per_token / 1024:.0f} KiB a token ({ACTIVATION_FACTOR} x 4 bytes x (heads x sequence.max + "
                        f"intermediate + hidden)), at least one text of sequence.max={sequence_max}, at most "
                        f"batch.max={self.max} of them")


def activation_bytes_per_token(heads: int, hidden: int, intermediate: int, sequence_max: int) -> int:
    """About what one padded token costs in activations at a layer's peak (`ACTIVATION_FACTOR`)."""
    return ACTIVATION_FACTOR * 4 * (heads * sequence_max + intermediate + hidden)


AUTO_OPT = 128  # sequence.opt when auto: the corpus's common lengths lie below it, and max caps it


class SequenceSetting(_Strict):
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


class Tolerance(_Strict):
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


# Docker's image reference grammar (distribution/reference), lowercase throughout: a registry host[:port] and
# repository path, then, for a full image, a :tag and/or an @digest.
_DOMAIN = r"[a-z0-9](?:[a-z0-9-]*[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)*(?::[0-9]+)?"
_PATH = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
REGISTRY = re.compile(rf"{_DOMAIN}(?:/{_PATH})*")
IMAGE = re.compile(rf"{REGISTRY.pattern}(?::[\w][\w.-]{{0,127}})?(?:@sha256:[0-9a-f]{{64}})?")


def _image_reference(value: str, pattern: re.Pattern[str], example: str) -> str:
    """`value` if Docker takes it as written; else why not, with the fix."""
    if pattern.fullmatch(value):
        return value
    problem = ("holds whitespace" if re.search(r"\s", value) else
               "has uppercase letters (Docker refuses them in a repository path, and DNS ignores case in a host)"
               if value != value.lower() else "is not a Docker image reference")
    fixed = re.sub(r"\s+", "", value).lower()
    hint = f" (did you mean {fixed!r}?)" if pattern.fullmatch(fixed) else ""
    raise ValueError(f"{value!r} {problem}: Docker takes lowercase letters, digits, '.', '-', '_' and '/' "
                     f"(a :port after the host), like {example!r}{hint}")


# triton.max_request_tokens auto: the model calls (batch.max_tokens each) one request may need. One call of a base
# model (0.25 GiB of activations: 5 x 384 tokens of BERT-base's shape) took 2.2 s in ONNX Runtime fp32, unfused, on 2
# Zen 4 cores: 4 calls bound what one request holds an instance for to about 9 s there (8 let it hold 17 s) and still
# take a reranker's 32 documents of 200 tokens in one request; one call would refuse a 10-document rerank.
REQUEST_CALLS = 4


class TritonSettings(_Strict):
    """How the deployment is generated and served."""

    name: str | None = Field(default=None, description="repository/ensemble name; default from the model")
    flavor: Flavor | Literal["auto"] = Field(default="auto", description=(
        "onnxruntime, tensorrt_plan or python-ort; auto: onnxruntime where ONNX Runtime runs on CUDA, else python-ort"))
    layout: Literal["auto", "ensemble", "fused"] = Field(default="auto", description=(
        "ensemble: tokenizer -> model models behind an ensemble (any flavor); fused: one Python model tokenizes and "
        "runs ONNX Runtime in one hop (python-ort); auto: fused for python-ort, else ensemble"))
    variant: str | None = Field(default=None, description="ONNX variant or engine to serve; default: best passing")
    outputs: list[str] | None = Field(default=None, description="outputs to serve; default: the sentence embedding "
                                                                "alone when there is one, else every task output")
    instances: int | Literal["auto"] = Field(default="auto", description=(
        "model instances; auto: two sharing the cores for python-ort on a CPU with two or more (one tokenizes and "
        "answers while the other infers), else one"))
    dynamic_batching: bool = True
    max_documents: int = Field(default=256, ge=1, description=(
        "rerankers: documents one request may score against its query; more are refused with a 400 naming this"))
    max_texts: int = Field(default=256, ge=1, description=(
        "texts (or reranker queries) one request may send; more are refused with a 400 naming this (a batched "
        "model also takes at most batch.max: Triton's own check)"))
    max_text_chars: int = Field(default=100_000, ge=1, description=(
        "characters one text (query, document) may have; a longer one is refused with a 400 naming this, before "
        "it holds a model instance"))
    max_request_tokens: int | Literal["auto"] = Field(default="auto", description=(
        "tokens one request may hold, each text counted as the model runs it (cut at sequence.max: a longer text "
        "costs no more than its kept part); more are refused with a 400 naming this. auto: 4 model calls (4 x "
        "batch.max_tokens), at least one text at sequence.max, so one request holds an instance for at most 4 "
        "calls. Python models (fused layout, rerankers)"))
    preferred_batch_sizes: list[int] = Field(default_factory=list, description="default: [batch.opt, batch.max]")
    max_queue_delay_us: int = Field(default=0, ge=0, description="0: batch what queued while busy, wait for nothing")
    gpu_accelerator: Literal["none", "tensorrt"] = "none"
    http_port: int | None = None
    grpc_port: int | None = None
    metrics_port: int | None = None
    overwrite: bool = False
    allow_unverified: bool = Field(default=False, description="publish a variant that did not pass parity (in "
                                                                "process and served); the record says verified: false")
    repository_dir: str | None = Field(default=None, description="where model_repository/<name> goes; default: "
                                                                 "$WORKBENCH_REPOSITORY, else the project's "
                                                                 "model_repository/")
    _repository_here = field_validator("repository_dir")(staticmethod(_from_here))

    _positive = field_validator("max_request_tokens")(staticmethod(at_least_one("triton.max_request_tokens")))

    def request_tokens(self, max_tokens: int, sequence_max: int) -> int:
        """The tokens one request may hold (0: no bound, for a model without a bound on one call's tokens)."""
        if self.max_request_tokens != "auto":
            return self.max_request_tokens
        return max(REQUEST_CALLS * max_tokens, sequence_max) if max_tokens else 0
    container_image: str = Field(default="nvcr.io/nvidia/tritonserver:24.10-py3", description=(
        "the Triton container the deployment image starts FROM"))
    image_registry: str = Field(default="localhost:5000", description=(
        "where the deployment image is pushed: its tag is <registry>/<name>:<content hash>"))
    target_rps: float = Field(default=100.0, gt=0, description=(
        "requests per second the deployment must sustain: sets the autoscaler's minimum replicas"))
    burst_factor: float = Field(default=2.0, ge=1, description="the autoscaler's maximum over its minimum replicas")
    queue_target_ms: float | None = Field(default=None, gt=0, description=(
        "average queue time per request the autoscaler keeps; default: what the bench measured at the best "
        "throughput within bench.p99_limit_ms"))
    storage_uri: str | None = Field(default=None, description=(
        "KServe storageUri of the repository; default: pvc://<name>-models/ (copy the repository there)"))

    @field_validator("image_registry")
    @classmethod
    def _registry(cls, value: str) -> str:
        return _image_reference(value.rstrip("/"), REGISTRY, "registry.example.com:5000/ml")

    @field_validator("container_image")
    @classmethod
    def _container_image(cls, value: str) -> str:
        return _image_reference(value, IMAGE, "nvcr.io/nvidia/tritonserver:24.10-py3")

    @field_validator("flavor", mode="before")
    @classmethod
    def _known_flavor(cls, value: object) -> object:
        names = ["auto", *(f.value for f in Flavor)]
        if value not in names:
            close = difflib.get_close_matches(str(value), names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"flavor must be one of {', '.join(names)}{hint}")
        return value


TargetCpu = Literal["host", "avx2", "avx512", "avx512_vnni", "avx_vnni", "amx"]


class TargetSettings(_Strict):
    """The machine the deployment is for: what `precisions: auto` builds follows it."""

    cpu: TargetCpu = Field(default="host", description=(
        "host: this machine, where reduced precisions are built only when measured faster than fp32; or the "
        "instruction set of another CPU the deployment is for (avx2, avx512, avx512_vnni, avx_vnni, amx)"))


REPAIR_LAB_PASSES = 8  # parity.repair.budget_s auto: this many of the failing variant's lab checks,
REPAIR_MIN_SECONDS = 180.0  # and at least this (a small model's builds and sessions cost more than its lab pass)
ALL_VARIANTS_UP_TO = 300_000_000  # parameters: parity.variants auto checks every variant of a model up to this size


class RepairSettings(_Strict):
    """Precision repair of a failing fp16/int8 variant, and its bounds."""

    enabled: bool = True
    budget_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | Literal["auto"] = Field(default="auto", description=(
        "seconds the repair of one precision may take: it ends with the best passing candidate found by then, or "
        "says it found none (the best candidate's numbers and how to give it more time); auto: "
        f"{REPAIR_LAB_PASSES} times the failing variant's own check on the parity lab, at least "
        f"{REPAIR_MIN_SECONDS:g} s"))
    max_builds: int = Field(default=80, ge=2, description="candidate files one repair may build")

    def budget(self, lab_seconds: float | None) -> tuple[float, str]:
        """The repair's seconds and where the number comes from: the setting, or (auto) REPAIR_LAB_PASSES times
        `lab_seconds` (the failing variant's own check on the lab; a model's size and the host's load both show in
        it), at least REPAIR_MIN_SECONDS."""
        if self.budget_s != "auto":
            return self.budget_s, "configured (parity.repair.budget_s)"
        passes = REPAIR_LAB_PASSES * (lab_seconds or 0.0)
        if passes <= REPAIR_MIN_SECONDS:
            return REPAIR_MIN_SECONDS, (f"auto: at least {REPAIR_MIN_SECONDS:g} s (under {REPAIR_LAB_PASSES} times "
                                        f"the variant's {lab_seconds or 0:.1f} s check on the lab)")
        return round(passes, 1), f"auto: {REPAIR_LAB_PASSES} times the variant's {lab_seconds:.1f} s check on the lab"


class Fp16Settings(_Strict):
    """What the fp16 variant keeps in fp32."""

    op_block_list: list[str] = Field(default_factory=list, description="op types kept in fp32")
    node_block_list: list[str] = Field(default_factory=list, description="node names kept in fp32")


class Int8Settings(_Strict):
    """ONNX Runtime's dynamic quantization of the int8 variant."""

    per_channel: bool = True
    nodes_to_exclude: list[str] = Field(default_factory=list, description="node names left in float")


class PreflightSettings(_Strict):
    memory: Literal["refuse", "warn"] = Field(default="refuse", description=(
        "refuse: a run whose steps need more memory at their peak than its limit (the cgroup's, else the machine's) "
        "stops before anything runs; warn: says so and goes on (a step that runs out stops with OutOfMemoryError)"))


class OptimizeSettings(_Strict):
    """The optimize step: the fused graph's form and rules, the OpenVINO variants, the fp16 and int8 variants."""

    graph_form: Literal["auto", "fused", "separate"] = Field(default="auto", description=(
        "layer norms of the fused graph: SkipLayerNormalization (fused), Add + LayerNormalization (separate), or "
        "whichever runs faster here (auto)"))
    borrowed_rules: Literal["auto", "always", "never"] = Field(default="auto", description=(
        "for an encoder family ONNX Runtime's optimizer has no fusion rules for (MPNet, ALBERT, DeBERTa-v2, ...): "
        "BERT's rules and attention with its position bias fused, kept when its outputs match the basic graph's and "
        "it runs clearly faster here (auto), whenever they match (always), or not tried (never)"))
    openvino: Literal["auto", "always", "never"] = Field(default="auto", description=(
        "a CPU deployment's fp32 graph run by OpenVINO instead of ONNX Runtime (the [openvino] extra): kept as the "
        "`openvino` variant when its outputs match the fp32 graph's and it runs clearly faster here (auto), "
        "whenever they match (always), or not tried (never); NNCF's int8 run by OpenVINO likewise, raced against the "
        "fastest graph kept before it"))
    fp16: Fp16Settings = Fp16Settings()
    int8: Int8Settings = Int8Settings()


class ParitySettings(_Strict):
    """The parity step: its precision repair, and where the lab keeps reference outputs between runs."""

    repair: RepairSettings = Field(default_factory=RepairSettings, description=(
        "precision repair; -p parity.repair=false turns it off"))
    variants: Literal["auto", "all", "served"] = Field(default="auto", description=(
        "the variants the lab checks: all; or served: fp32, then the others in the order the deployment serves "
        "them until one passes (those served after it could not be served), a failing fp16/int8 repaired only "
        "where none faster than fp32 passes; "
        f"auto: all up to {ALL_VARIANTS_UP_TO // 10**6}M parameters, served past them (one check of a larger "
        "model takes many minutes on a few cores)"))
    reference_cache_dir: str | None = Field(default=None, description=(
        "where the parity lab's reference outputs are kept between runs, by model files and texts; default: "
        "$XDG_CACHE_HOME (~/.cache)/transformer-workbench/reference"))
    _cache_here = field_validator("reference_cache_dir")(staticmethod(_from_here))

    def scope(self, parameters: int | None) -> tuple[Literal["all", "served"], str]:
        """The variants the lab checks (`variants`, auto resolved by the model's `parameters`) and why."""
        if self.variants != "auto":
            return self.variants, "configured (parity.variants)"
        if parameters is None or parameters <= ALL_VARIANTS_UP_TO:
            return "all", f"auto: the model has at most {ALL_VARIANTS_UP_TO // 10**6}M parameters"
        return "served", (f"auto: the model has {parameters / 1e6:.0f}M parameters (past "
                          f"{ALL_VARIANTS_UP_TO // 10**6}M each check takes many minutes on a few cores); "
                          "-p parity.variants=all checks every variant")


class TensorrtSettings(_Strict):
    """The tensorrt step: shape profiles, the builder's workspace, the engine cache."""

    profiles: int = Field(default=2, ge=1, le=8, description="TensorRT profiles (sequence-length buckets)")
    workspace_mb: int = Field(default=4096, ge=64)
    engine_cache_dir: str | None = Field(default=None, description="default: ~/.cache/transformer-workbench/tensorrt")
    _cache_here = field_validator("engine_cache_dir")(staticmethod(_from_here))


class BenchSettings(_Strict):
    """The bench step: in-process and served benchmarks (bounded: rounds, requests and seconds)."""

    batches: list[int] = [1, 8]
    sequences: list[int] = [16, 128]
    rounds: int = Field(default=20, ge=3)
    warmup: int = Field(default=3, ge=0)
    seconds_per_cell: float = Field(default=60.0, gt=0)
    long_texts: bool = Field(default=True, description=(
        "a batch-1 cell at 2048 tokens and one at sequence.max, where they are longer than the grid's longest"))
    tune_sessions: bool = Field(default=True, description="measure ONNX Runtime session settings per variant first")
    torch_compile: bool = Field(default=False, description=(
        "a torch.compile row beside PyTorch eager (compiles for minutes), checked on the parity lab like a variant"))
    served: bool = True
    concurrency: list[int] = [1, 4, 16]
    requests_per_level: int = Field(default=160, ge=8)
    seconds_per_level: float = Field(default=20.0, gt=0)
    load_tool: Literal["auto", "perf_analyzer", "asyncio"] = "auto"
    p99_limit_ms: float = Field(default=500.0, gt=0)
    search_queue_delays_us: list[int] = [0, 4000]
    search_instances: list[int] = [1, 2]


class GenerationSettings(_Strict):
    """The generation step: a seq2seq (translation) and a decoder-only model, HF generate vs CTranslate2."""

    translation_model: str | None = Field(default="tiny:marian", description="HF id, local folder, or tiny:marian")
    text_generation_model: str | None = Field(default="tiny:gpt2", description="HF id, local folder, or tiny:gpt2")
    _models_here = field_validator("translation_model", "text_generation_model")(staticmethod(_found_here))
    target_language: str | None = Field(default=None, description="for multilingual models, e.g. >>fra<< or fra_Latn")
    max_new_tokens: int = Field(default=32, ge=1)
    max_new_tokens_limit: int = Field(default=256, ge=1)
    max_input_tokens: int | None = Field(default=None, ge=1, description="default: the model's limit")
    ct2_compute_type: str = "float32"
    texts: int = Field(default=32, ge=1, description="corpus texts for the HF vs CTranslate2 comparison")
    max_batch_size: int = Field(default=16, ge=1)
    concurrency: list[int] = [1, 4, 16]
    requests_per_level: int = Field(default=24, ge=4)
    seconds_per_level: float = Field(default=10.0, gt=0)


@dataclass(frozen=True)
class LabSettings:
    """What the parity lab reads from a run's configuration (`RunConfig.lab`): the outputs it compares, those that
    gate a verdict (the outputs the deployment serves) and their tolerances, the batch range and seed of its corner
    batches, the device its reference runs on, where reference outputs are kept between runs, whether the model's
    own code may run, and the corpus."""

    specs: tuple[OutputSpec, ...]
    gated: tuple[str, ...]
    tolerances: dict[str, Tolerance]
    batch: BatchRange
    seed: int
    device: str
    cache_dir: str | None
    trust_remote_code: bool
    corpus: str | None
    corpus_max_texts: int


class RunConfig(_Strict):
    """Everything a run needs to know; defaults run the embedded MiniLM on this machine."""

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
    triton: TritonSettings = TritonSettings()
    bench: BenchSettings = BenchSettings()
    generation: GenerationSettings = GenerationSettings()
    optimize: OptimizeSettings = OptimizeSettings()
    parity: ParitySettings = ParitySettings()
    tensorrt: TensorrtSettings = TensorrtSettings()
    preflight: PreflightSettings = PreflightSettings()
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int | None = Field(default=None, ge=1, description="intra-op threads for torch and ORT")
    output_dir: str | None = None
    steps: list[str] = Field(default_factory=lambda: list(_step_names()), description=(
        "the steps to run by name, run in pipeline order: `workbench steps` lists them; e.g. --steps export,optimize"))
    seed: int = 0
    _inputs_here = field_validator("model", "corpus")(staticmethod(_found_here))

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
        names = _step_names()
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
        unserved = [name for name in self.triton.outputs or () if name not in outputs]
        if unserved:
            raise ValueError(f"triton.outputs names {unserved}, which {self.task_choice.name} with pooling "
                             f"{self.pooling} does not produce; choose among: {', '.join(outputs)}")
        return self

    @model_validator(mode="after")
    def _rerank_layout(self) -> RunConfig:
        """A reranker and a sparse encoder are served by one Python model (serving/backend/rerank_model.py,
        fused_model.py with sparse_terms.py): another layout or flavor is refused before the run, not after its
        parity."""
        flavor = self.triton.flavor
        other = self.triton.layout == "ensemble" or flavor not in ("auto", Flavor.PYTHON_ORT)
        task = self.task_choice.name if other else self.task
        if other and task in ONE_PYTHON_MODEL:
            asked = f"triton.layout={self.triton.layout}" if self.triton.layout == "ensemble" else \
                f"triton.flavor={Flavor(flavor).value}"
            raise ValueError(f"task {task} is served by one Python model ({ONE_PYTHON_MODEL[task]}); {asked} cannot "
                             "serve it: use triton.layout fused (or auto) and triton.flavor python-ort (or auto)")
        return self

    def check_pooling_task(self) -> None:
        """Pooling makes an embedding: another task's graph returns its head's logits and would ignore it
        (ConfigError, from preflight with the model's problems, or when a step loads the model)."""
        task = self.task_choice.name
        if task != "feature-extraction" and (self.pooling != "auto" or self.pooling_override or self.truncate_dim):
            chosen = (f"truncate_dim={self.truncate_dim}" if self.truncate_dim else "pooling_override=true"
                      if self.pooling == "auto" else f"pooling={self.pooling}")
            passed = [f"-p {name}" for name, on in (("pooling", self.pooling != "auto"),
                                                     ("pooling_override", self.pooling_override),
                                                     ("truncate_dim", self.truncate_dim)) if on]
            raise ConfigError(f"{chosen} applies to task feature-extraction only; task {task} returns "
                              f"{TASKS[task].description}",
                              f"drop {' and '.join(passed)} for this task"
                              + (", or -p task=feature-extraction for its embeddings" if self.task == AUTO else ""))

    @property
    def output_specs(self) -> tuple[OutputSpec, ...]:
        """The graph outputs this configuration exports, in order."""
        return TASKS[self.task_choice.name].outputs(self.pooling != "none", self.token_embeddings)

    @property
    def task_choice(self) -> TaskChoice:
        """The task this run exports (`task`, or the one `auto` reads from the model's files) and why."""
        return choose_task(self.task, self.model)

    @property
    def served_specs(self) -> tuple[OutputSpec, ...]:
        """The outputs the deployment returns (`triton.outputs`, else the sentence embedding alone where there is
        one): the ones a variant's parity verdict is decided on."""
        return served_outputs(self.output_specs, self.triton.outputs)

    @property
    def lab(self) -> LabSettings:
        """What the parity lab reads from this configuration."""
        return LabSettings(self.output_specs, tuple(o.name for o in self.served_specs), self.tolerances, self.batch,
                           self.seed, self.device,
                           self.parity.reference_cache_dir, self.trust_remote_code, self.corpus, self.corpus_max_texts)

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
    for old in [key for key in RENAMED_SETTINGS if key in data]:
        key, value = switched(moved_key(old), data.pop(old))
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
    model: type[BaseModel] = RunConfig
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

"""What `SentenceTransformer(folder)` runs after the transformer, read with sentence-transformers itself: the
pipeline in modules.json (pooling, Dense, Normalize, the model's own modules under trust_remote_code), the maximum
sequence length, the prompts, the similarity function and the width encode() cuts at (truncate_dim). A folder without
those files gets what the library builds for a plain transformers model: mean pooling."""
from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.models.errors import PoolingMismatchError, UnsupportedModelError
from workbench.models.quiet import quiet_tracer
from workbench.models.tables import PipelineSummary
from workbench.tasks.choice import LIBRARY_TASKS

if TYPE_CHECKING:
    import torch
    from sentence_transformers import CrossEncoder, SentenceTransformer, SparseEncoder
    from transformers import PretrainedConfig
    from transformers import PreTrainedTokenizerBase as Tokenizer

# The library's modules after the Transformer that the exported graph holds (Dropout is the identity at inference);
# a module of the model's own code (trust_remote_code) is held where it traces (`check_head`).
HEAD_MODULES = ("Pooling", "Dense", "Normalize", "LayerNorm", "Dropout", "SpladePooling")
LIBRARY_PREFIX = "sentence_transformers."
DEFAULT_POOLING = "mean"  # what sentence-transformers builds for a plain transformers encoder


@dataclass(frozen=True)
class ModuleRef:
    """One entry of modules.json after the Transformer: its class name, the class reference and its subfolder."""

    name: str
    ref: str
    path: str

    @property
    def custom(self) -> bool:
        """The class comes from the model's own code (a .py file in its folder), not from sentence-transformers."""
        return not self.ref.startswith(LIBRARY_PREFIX)


@dataclass(frozen=True)
class SentencePipeline:
    """The model's sentence-transformers pipeline after the transformer; `declared` is False for a folder without
    modules.json (then: mean pooling alone, no prompts, cosine)."""

    location: str
    declared: bool
    modules: tuple[ModuleRef, ...] = ()
    kind: str = "SentenceTransformer"  # the library class that loads it (SparseEncoder: a SPLADE)
    pooling: str = DEFAULT_POOLING
    include_prompt: bool = True
    do_lower_case: bool = False
    max_seq_length: int | None = None
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    similarity: str = "cosine"
    truncate_dim: int | None = None  # encode() returns the first truncate_dim values (Matryoshka), as the files say
    max_active_dims: int | None = None  # a sparse encoder's encode() keeps this many heaviest terms

    @property
    def normalized(self) -> bool:
        return any(m.name == "Normalize" for m in self.modules)

    @property
    def dense_layers(self) -> int:
        return sum(m.name == "Dense" for m in self.modules)

    def steps(self, mode: str) -> list[str]:
        """The pipeline as the graph runs it with pooling `mode`, e.g. ['Transformer', 'Pooling(mean)', 'Normalize']."""
        if mode == "none":
            return ["Transformer"]
        names = [m.name for m in self.modules] if self.declared else ["Pooling"]
        cut = [f"Truncate({self.truncate_dim})"] if self.truncate_dim else []
        cut += [f"KeepTop({self.max_active_dims})"] if self.max_active_dims else []
        return ["Transformer", *(f"Pooling({mode})" if name == "Pooling" else name for name in names), *cut]

    def prompt(self, name: str | None) -> str:
        """The text put before each input for prompt `name` (None: the model's default prompt, if it has one)."""
        if name is None:
            return self.prompts.get(self.default_prompt_name or "", "")
        if name not in self.prompts:
            raise KeyError(name)
        return self.prompts[name]

    def prompted(self, texts: Sequence[str], name: str | None = None) -> tuple[str, ...]:
        """`texts` as `encode(texts, prompt_name=name)` sees them (None: after the model's default prompt)."""
        prefix = self.prompt(name)
        return tuple(prefix + text for text in texts)

    def describe(self, mode: str, overridden: bool) -> PipelineSummary:
        """What run.json records: where the pipeline comes from and what the exported graph runs."""
        where = (f"{self.location}/modules.json" if self.declared else
                 "no sentence-transformers files: what SentenceTransformer builds for a plain transformers model")
        result = PipelineSummary(
            declared=self.declared, source=where, steps=self.steps(mode), pooling=mode,
            declared_pooling=self.pooling, normalize=self.normalized, dense_layers=self.dense_layers,
            max_seq_length=self.max_seq_length, prompts=self.prompts, include_prompt=self.include_prompt,
            do_lower_case=self.do_lower_case, default_prompt_name=self.default_prompt_name,
            similarity=self.similarity, truncate_dim=self.truncate_dim, max_active_dims=self.max_active_dims)
        if overridden:
            result.override = f"pooling {mode} instead of the declared {self.pooling} (pooling_override)"
        return result


def _json(location: str, filename: str, subfolder: str = "") -> dict[str, Any] | list[Any] | None:
    from sentence_transformers.util import load_file_path

    path = load_file_path(location, filename, subfolder=subfolder)
    if path is None:
        return None
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def read_pipeline(location: str, trust_remote_code: bool = False, task: str = "feature-extraction"
                  ) -> SentencePipeline:
    """The pipeline the model's files declare, read without loading any weights (the library's own config readers
    and class loader), for `task` (a SentenceTransformer's feature-extraction, a SparseEncoder's sparse-embedding);
    UnsupportedModelError for a model class `task` does not export, a module the exported graph cannot hold, or the
    model's own code while `trust_remote_code` is off."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    # The library's default prompt names (query, document: no text), under any saved ones; an empty prompt is still a
    # name encode(prompt_name=...) takes, for a folder without sentence-transformers files too.
    defaults = dict.fromkeys(getattr(SentenceTransformer, "_default_prompts", {}), "")
    listed = _json(location, "modules.json")
    if (not isinstance(listed, list) or not listed) and task == "sparse-embedding":
        raise UnsupportedModelError(
            f"{location} has no sentence-transformers files (modules.json): sparse-embedding exports a "
            "SparseEncoder's folder (its masked language model, then SpladePooling)",
            "save the model with sentence_transformers.SparseEncoder(...).save(folder) and pass that folder, or "
            "leave task at auto")
    if not isinstance(listed, list) or not listed:
        return SentencePipeline(location, declared=False, prompts=defaults)
    settings = _json(location, "config_sentence_transformers.json") or {}
    assert isinstance(settings, dict)
    kind = settings.get("model_type", "SentenceTransformer")
    if LIBRARY_TASKS.get(kind) != task:
        wanted = next(name for name, exported in LIBRARY_TASKS.items() if exported == task)
        raise UnsupportedModelError(
            f"{location} is a sentence-transformers {kind}, not a {wanted}: {task} exports {wanted} models"
            + (" (a CrossEncoder scores (query, document) pairs)" if kind == "CrossEncoder" else ""),
            f"-p task={LIBRARY_TASKS[kind]} exports a {kind} (or leave task at auto: it reads the model class)"
            if kind in LIBRARY_TASKS else
            "export the transformers model inside it with -p task=... , or pick a SentenceTransformer folder")
    first = module_class(location, listed[0]["type"], trust_remote_code)
    if not issubclass(first, Transformer):
        raise UnsupportedModelError(
            f"{location}/modules.json starts with {first.__name__} ({listed[0]['type']}), not a sentence-transformers "
            "Transformer: the workbench exports transformers models, and this pipeline has none to export",
            "pick a model whose modules.json starts with a Transformer (its transformers model: config.json and "
            "weights), or serve this one with sentence-transformers itself")
    modules = tuple(ModuleRef(module_class(location, m["type"], trust_remote_code).__name__, m["type"],
                              m.get("path", "")) for m in listed[1:])
    unsupported = [m.ref for m in modules if not m.custom and m.name not in HEAD_MODULES]
    if unsupported:
        raise UnsupportedModelError(
            f"{location}/modules.json lists {', '.join(unsupported)}, which the exported graph cannot hold (it holds "
            f"{', '.join(HEAD_MODULES)} and the model's own traceable modules after the Transformer)",
            "export the token embeddings alone with -p pooling=none and pool outside the graph")
    pooling, include_prompt = DEFAULT_POOLING, True
    for module in modules:
        if module.name == "SpladePooling" and not module.custom:
            from sentence_transformers.sparse_encoder.modules import SpladePooling

            splade = SpladePooling.load_config(location, subfolder=module.path)
            pooling = f"splade-{splade.get('pooling_strategy', 'max')}"
        if module.name == "Pooling" and not module.custom:
            pooling_settings = Pooling.load_config(location, subfolder=module.path)
            mode = pooling_settings.get("pooling_mode", DEFAULT_POOLING)
            pooling = mode if isinstance(mode, str) else "+".join(mode)
            include_prompt = bool(pooling_settings.get("include_prompt", True))
    transformer = Transformer.load_config(location, subfolder=listed[0].get("path", ""))
    tokenizer = _json(location, "tokenizer_config.json", listed[0].get("path", "")) or {}
    assert isinstance(tokenizer, dict)
    prompts = {**defaults, **{name: text or "" for name, text in (settings.get("prompts") or {}).items()}}
    return SentencePipeline(
        location, declared=True, modules=modules, kind=kind, pooling=pooling, include_prompt=include_prompt,
        do_lower_case=bool(transformer.get("do_lower_case", False)),
        max_seq_length=transformer.get("max_seq_length") or _limit(tokenizer.get("model_max_length")),
        prompts=prompts,
        default_prompt_name=settings.get("default_prompt_name") or None,
        similarity=settings.get("similarity_fn_name") or ("dot" if kind == "SparseEncoder" else "cosine"),
        truncate_dim=settings.get("truncate_dim") or None, max_active_dims=settings.get("max_active_dims") or None)


def module_class(location: str, ref: str, trust_remote_code: bool) -> type:
    """The class a modules.json entry names, loaded as the library loads it (its own modules by name, the model's
    own code from a .py file in its folder only under `trust_remote_code`); UnsupportedModelError where it cannot."""
    import torch
    from sentence_transformers.util.misc import import_module_class

    where = f"{location}/modules.json"
    if not ref.startswith(LIBRARY_PREFIX) and not trust_remote_code:
        source = f"{ref.rsplit('.', 1)[0].replace('.', '/')}.py"
        raise UnsupportedModelError(
            f"{where} lists {ref.rsplit('.', 1)[-1]} ({ref}), a module of the model's own code ({source} in its "
            "folder), and trust_remote_code is off",
            f"only if you trust its author: -p trust_remote_code=true (that Python code then runs with your "
            f"permissions; read {source} first), or pick a model without custom code")
    try:
        found = import_module_class(ref, location, trust_remote_code=trust_remote_code)
    except Exception as exc:  # the model's own code can fail in any way on import: said by its file, not as a traceback
        # a SyntaxError names no file of its own (the library parses the file from text): said by the reference
        at = f" ({ref.rsplit('.', 1)[0].replace('.', '/')}.py, line {exc.lineno})" \
            if isinstance(exc, SyntaxError) else ""
        reason = exc.msg if isinstance(exc, SyntaxError) else str(exc).splitlines()[0] if str(exc) else ""
        raise UnsupportedModelError(
            f"{where} lists {ref}, which cannot be imported here: {type(exc).__name__}{at}: {reason}",
            "mend the module's .py file in the model folder (its code, its name and class), or install the package "
            "it comes from") from None
    if not (isinstance(found, type) and issubclass(found, torch.nn.Module)):
        raise UnsupportedModelError(f"{where} lists {ref}, which is not a torch module",
                                    "pick a model whose modules are torch.nn.Module classes")
    return found


def _limit(value: object) -> int | None:
    """A tokenizer's model_max_length as a limit (transformers writes a huge number for "none")."""
    return int(value) if isinstance(value, int | float) and value < 1_000_000 else None


def encoder_class(hf_config: PretrainedConfig, declared: bool = True) -> type | None:
    """The encoder-only class sentence-transformers' Transformer loads for an encoder-decoder config (T5EncoderModel
    for T5: sentence-T5, GTR), from the library's own table, for a sentence-transformers folder (`declared`) or one
    whose config.json names that class; None where the auto class loads it (a translation model stays one)."""
    import importlib

    from sentence_transformers.base.modules.transformer import _ENCODER_ONLY_MODELS

    for config_class, module, name in _ENCODER_ONLY_MODELS:
        if isinstance(hf_config, config_class) and (declared or name in (hf_config.architectures or [])):
            return getattr(importlib.import_module(module), name)
    return None


def with_truncation(pipeline: SentencePipeline, truncate_dim: int | None) -> SentencePipeline:
    """The pipeline cutting at `truncate_dim` (the run's setting) where set, else at the model's own truncate_dim."""
    return replace(pipeline, truncate_dim=truncate_dim) if truncate_dim else pipeline


def graph_pooling(pipeline: SentencePipeline, pooling: str, override: bool, hidden_size: int) -> str:
    """The pooling mode the graph uses: the declared one for `auto`; a mode the model's files contradict is refused
    unless `override`, and an override whose width the next Dense layer cannot take is refused."""
    if pooling == "auto":
        return pipeline.pooling
    if pooling in ("none", pipeline.pooling) or not pipeline.declared:
        return pooling
    where = f"{pipeline.location}/{next(m.path for m in pipeline.modules if m.name == 'Pooling')}/config.json"
    if override:
        _check_dense_width(pipeline, pooling, hidden_size)
        return pooling
    raise PoolingMismatchError(
        f"pooling={pooling} contradicts the model's own files: {where} declares {pipeline.pooling} pooling, which "
        "is what SentenceTransformer(...).encode() returns today",
        f"drop -p pooling (auto reads the model's files), or keep {pooling} with -p pooling_override=true "
        "(the record notes the override)")


def _check_dense_width(pipeline: SentencePipeline, mode: str, hidden_size: int) -> None:
    """The first Dense layer after pooling takes the width the declared pooling gives; `mode` must give the same."""
    from sentence_transformers.base.modules import Dense

    after = pipeline.modules[next(i for i, m in enumerate(pipeline.modules) if m.name == "Pooling") + 1:]
    dense = next((m for m in after if m.name == "Dense"), None)
    if dense is None:
        return
    takes = Dense.load_config(pipeline.location, subfolder=dense.path).get("in_features")
    width = hidden_size * len(mode.split("+"))
    if takes is not None and takes != width:
        raise PoolingMismatchError(
            f"pooling={mode} gives {width} values per text, but {pipeline.location}/{dense.path}/config.json takes "
            f"{takes} (in_features: trained on the declared {pipeline.pooling} pooling), so the override cannot run "
            "through the model's Dense layer",
            f"drop -p pooling and -p pooling_override (auto: {pipeline.pooling}), or export the token embeddings alone "
            "with -p pooling=none and pool outside the graph")


def prompt_tokens(tokenizer: Tokenizer, prompt: str, limit: int) -> int:
    """How many of a text's first tokens are the prompt's, as sentence-transformers counts them for pooling without
    the prompt (include_prompt: false): the prompt tokenized alone, less a trailing special token; 0 for none."""
    if not prompt:
        return 0
    ids = tokenizer(prompt, truncation=True, max_length=limit)["input_ids"]
    return len(ids) - (1 if ids and ids[-1] in tokenizer.all_special_ids else 0)


def _modules(pipeline: SentencePipeline, mode: str, hidden_size: int, trust_remote_code: bool) -> list[Any]:
    """The module objects after the transformer as the library loads them, Pooling in `mode`."""
    from sentence_transformers.sentence_transformer.modules import Pooling

    if not pipeline.declared:
        return [Pooling(hidden_size, mode)]
    modules = []
    for module in pipeline.modules:
        if module.name == "Pooling" and not module.custom and mode != pipeline.pooling:
            modules.append(Pooling(hidden_size, mode))
            continue
        found = module_class(pipeline.location, module.ref, trust_remote_code)
        if len(inspect.signature(found.load).parameters) == 1:  # an older module: load(its folder)
            modules.append(found.load(str(Path(pipeline.location) / module.path)))
        else:
            modules.append(found.load(pipeline.location, subfolder=module.path, trust_remote_code=trust_remote_code))
    return modules


def load_head(pipeline: SentencePipeline, mode: str, hidden_size: int,
              trust_remote_code: bool = False) -> torch.nn.Module | None:
    """The modules after the transformer as one torch module (features dict in, features dict out), in eval mode,
    cutting at the pipeline's truncate_dim; None for `mode` none."""
    import torch

    if mode == "none":
        return None
    from workbench.models.heads import KeepTop, Truncate

    modules = _modules(pipeline, mode, hidden_size, trust_remote_code)
    cut = [Truncate(pipeline.truncate_dim)] if pipeline.truncate_dim else []
    cut += [KeepTop(pipeline.max_active_dims)] if pipeline.max_active_dims else []
    return torch.nn.Sequential(*modules, *cut).eval()


def check_head(pipeline: SentencePipeline, mode: str, hidden_size: int, trust_remote_code: bool = False) -> None:
    """The head runs on token embeddings alone and gives at least truncate_dim values, and, where it holds the
    model's own modules, its ONNX trace answers as it does on another batch shape (a trace keeps Python-side values
    as constants): checked on random features in a second, before any weights of the transformer load."""
    import torch

    head = load_head(replace(pipeline, truncate_dim=None), mode, hidden_size, trust_remote_code)
    if head is None:
        return
    custom = [m for m in pipeline.modules if m.custom]
    names = ", ".join(f"{m.name} ({m.ref})" for m in custom) or "the pipeline's modules"
    fix = ("export the token embeddings alone with -p pooling=none and run the rest outside the graph, or make the "
           "module traceable (tensor operations on the features dict, no Python-side data)")
    try:
        with torch.no_grad():
            width = int(head(_features(2, 5, hidden_size))["sentence_embedding"].shape[-1])
        worst = _trace_error(head, hidden_size) if custom else 0.0
    except Exception as exc:  # the model's own code can fail in any way: said by its class, not as a traceback
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise UnsupportedModelError(
            f"{names} of {pipeline.location}/modules.json cannot be exported: on token embeddings and an attention "
            f"mask it fails with {type(exc).__name__}: {reason}", fix) from None
    if worst > 1e-4:
        raise UnsupportedModelError(
            f"{names} of {pipeline.location}/modules.json cannot be exported: its ONNX trace answers another batch "
            f"shape {worst:.3g} away from the module itself (the trace kept values computed outside torch as "
            "constants)", fix)
    if pipeline.truncate_dim and pipeline.truncate_dim > width:
        raise UnsupportedModelError(
            f"truncate_dim {pipeline.truncate_dim} is wider than the {width} values {pipeline.location}'s pipeline "
            "gives", f"set -p truncate_dim to at most {width}, or leave it out (the cut the model's "
                     "config_sentence_transformers.json names, else its full width)")


def _features(batch: int, tokens: int, hidden_size: int) -> dict[str, torch.Tensor]:
    """Random token embeddings and an attention mask whose last text is padded, as a head receives them."""
    import torch

    mask = torch.ones(batch, tokens, dtype=torch.long)
    mask[-1, tokens // 2:] = 0
    return {"token_embeddings": torch.randn(batch, tokens, hidden_size), "attention_mask": mask}


def _trace_error(head: torch.nn.Module, hidden_size: int) -> float:
    """Largest difference between the head's ONNX trace (on a 2 x 5 batch) and the head itself on a 3 x 7 one."""
    import io

    import numpy as np
    import onnxruntime
    import torch

    from workbench.models.heads import FeaturesToEmbedding

    traced, graph = FeaturesToEmbedding(head).eval(), io.BytesIO()
    names = ["token_embeddings", "attention_mask"]
    with quiet_tracer(), torch.no_grad():
        torch.onnx.export(traced, tuple(_features(2, 5, hidden_size).values()), graph, dynamo=False,
                          input_names=names, output_names=["sentence_embedding"],
                          dynamic_axes={name: {0: "batch", 1: "sequence"} for name in names})
        other = _features(3, 7, hidden_size)
        want = traced(*other.values()).numpy()
    session = onnxruntime.InferenceSession(graph.getvalue(), providers=["CPUExecutionProvider"])
    got = session.run(None, {name: value.numpy() for name, value in other.items()})[0]
    return float(np.abs(got - want).max()) if got.shape == want.shape else float("inf")


def sparse_encoder(pipeline: SentencePipeline, trust_remote_code: bool = False) -> tuple[SparseEncoder, list[str]]:
    """The sparse encoder as sentence-transformers loads it, and the statement that builds it as `model`."""
    from sentence_transformers import SparseEncoder

    trusted = ", trust_remote_code=True" if trust_remote_code else ""
    return (SparseEncoder(pipeline.location, device="cpu", trust_remote_code=trust_remote_code),
            [f"model = SparseEncoder({pipeline.location!r}{trusted})"])


def library_model(pipeline: SentencePipeline, mode: str, hidden_size: int,
                  trust_remote_code: bool = False) -> tuple[SentenceTransformer, list[str]]:
    """The model as sentence-transformers itself loads it (its own transformer, default attention), and the Python
    statements that build it as `model`: `SentenceTransformer(folder)` for a declared pipeline (its Pooling replaced
    when overridden, its truncate_dim the run's), else the library's Transformer and Pooling modules."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer

    trusted = ", trust_remote_code=True" if trust_remote_code else ""
    if pipeline.declared:
        model = SentenceTransformer(pipeline.location, device="cpu", trust_remote_code=trust_remote_code)
        statements = [f"model = SentenceTransformer({pipeline.location!r}{trusted})"]
        if mode not in ("none", pipeline.pooling):
            index = 1 + next(i for i, m in enumerate(pipeline.modules) if m.name == "Pooling")
            key = list(model._modules)[index]
            model._modules[key] = _modules(pipeline, mode, hidden_size, trust_remote_code)[index - 1]
            statements.append(f"model[{index}] = Pooling({hidden_size}, pooling_mode={mode!r})")
        if model.truncate_dim != pipeline.truncate_dim:
            model.truncate_dim = pipeline.truncate_dim
            statements.append(f"model.truncate_dim = {pipeline.truncate_dim}")
        return model, statements
    trust = {"trust_remote_code": trust_remote_code}
    transformer = Transformer(pipeline.location, model_kwargs=trust, processor_kwargs=trust, config_kwargs=trust)
    modules = [transformer, *(_modules(pipeline, mode, hidden_size, trust_remote_code) if mode != "none" else [])]
    pooling = f", Pooling({hidden_size}, pooling_mode={mode!r})" if mode != "none" else ""
    cut = f", truncate_dim={pipeline.truncate_dim}" if pipeline.truncate_dim else ""
    return (SentenceTransformer(modules=modules, device="cpu", truncate_dim=pipeline.truncate_dim),
            [f"model = SentenceTransformer(modules=[Transformer({pipeline.location!r}){pooling}]{cut})"])


def cross_encoder(location: str, max_length: int, trust_remote_code: bool = False) -> CrossEncoder:
    """`CrossEncoder(location)` on the CPU, cutting pairs at `max_length` tokens; UnsupportedModelError where
    predict() runs more than the classifier and an activation module (a LogitScore or Dense after it), which the
    exported graph does not hold."""
    import torch
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(location, device="cpu", trust_remote_code=trust_remote_code, max_length=max_length)
    extra = [type(module).__name__ for module in list(model)[1:]]
    if extra or not isinstance(model.activation_fn, torch.nn.Module):
        raise UnsupportedModelError(
            f"{location}: CrossEncoder.predict() runs {', '.join(extra) or type(model.activation_fn).__name__} "
            "after the classifier, which the exported graph does not hold",
            "export a sequence-classification cross-encoder (its activation a torch.nn module), or -p "
            "task=sequence-classification for its logits alone")
    return model

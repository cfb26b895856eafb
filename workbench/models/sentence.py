"""What `SentenceTransformer(folder)` runs after the transformer, read with sentence-transformers itself: the
pipeline in modules.json (pooling, Dense, Normalize), the maximum sequence length, the prompts and the similarity
function. A folder without those files gets what the library builds for a plain transformers model: mean pooling."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from workbench.core.errors import PoolingMismatchError, UnsupportedModelError
from workbench.core.results import PipelineSummary

if TYPE_CHECKING:
    import torch
    from sentence_transformers import CrossEncoder, SentenceTransformer
    from transformers import PreTrainedTokenizerBase as Tokenizer

# Modules after the Transformer that the exported graph holds (Dropout is the identity at inference).
HEAD_MODULES = ("Pooling", "Dense", "Normalize", "LayerNorm", "Dropout")
DEFAULT_POOLING = "mean"  # what sentence-transformers builds for a plain transformers encoder


@dataclass(frozen=True)
class ModuleRef:
    """One entry of modules.json after the Transformer: its class name, the class reference and its subfolder."""

    name: str
    ref: str
    path: str


@dataclass(frozen=True)
class SentencePipeline:
    """The model's sentence-transformers pipeline after the transformer; `declared` is False for a folder without
    modules.json (then: mean pooling alone, no prompts, cosine)."""

    location: str
    declared: bool
    modules: tuple[ModuleRef, ...] = ()
    pooling: str = DEFAULT_POOLING
    include_prompt: bool = True
    do_lower_case: bool = False
    max_seq_length: int | None = None
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    similarity: str = "cosine"

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
        return ["Transformer", *(f"Pooling({mode})" if name == "Pooling" else name for name in names)]

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
            similarity=self.similarity)
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


def read_pipeline(location: str) -> SentencePipeline:
    """The pipeline the model's files declare, read without loading any weights (the library's own config readers);
    UnsupportedModelError for a module the exported graph cannot hold."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from sentence_transformers.util import import_from_string

    # The library's default prompt names (query, document: no text), under any saved ones; an empty prompt is still a
    # name encode(prompt_name=...) takes, for a folder without sentence-transformers files too.
    defaults = dict.fromkeys(getattr(SentenceTransformer, "_default_prompts", {}), "")
    listed = _json(location, "modules.json")
    if not isinstance(listed, list) or not listed:
        return SentencePipeline(location, declared=False, prompts=defaults)
    kind = (_json(location, "config_sentence_transformers.json") or {}).get("model_type", "SentenceTransformer")
    if kind != "SentenceTransformer":
        raise UnsupportedModelError(
            f"{location} is a sentence-transformers {kind}, not a SentenceTransformer: feature extraction exports "
            "embedding models" + (" (a CrossEncoder scores (query, document) pairs)" if kind == "CrossEncoder"
                                  else ""),
            "-p task=rerank exports a CrossEncoder: pair inputs, its logits and the scores predict() returns"
            if kind == "CrossEncoder" else
            "export the transformers model inside it with -p task=... , or pick a SentenceTransformer folder")
    first = import_from_string(listed[0]["type"])
    if not (isinstance(first, type) and issubclass(first, Transformer)):
        raise UnsupportedModelError(
            f"{location}/modules.json starts with {first.__name__ if isinstance(first, type) else listed[0]['type']}"
            f" ({listed[0]['type']}), not a sentence-transformers Transformer: the workbench exports transformers "
            "models, and this pipeline has none to export",
            "pick a model whose modules.json starts with a Transformer (its transformers model: config.json and "
            "weights), or serve this one with sentence-transformers itself")
    modules = tuple(ModuleRef(import_from_string(m["type"]).__name__, m["type"], m.get("path", ""))
                    for m in listed[1:])
    unsupported = [m.ref for m in modules if m.name not in HEAD_MODULES]
    if unsupported:
        raise UnsupportedModelError(
            f"{location}/modules.json lists {', '.join(unsupported)}, which the exported graph cannot hold (it holds "
            f"{', '.join(HEAD_MODULES)} after the Transformer)",
            "export the token embeddings alone with -p pooling=none and pool outside the graph")
    pooling, include_prompt = DEFAULT_POOLING, True
    for module in modules:
        if module.name == "Pooling":
            settings = Pooling.load_config(location, subfolder=module.path)
            mode = settings.get("pooling_mode", DEFAULT_POOLING)
            pooling = mode if isinstance(mode, str) else "+".join(mode)
            include_prompt = bool(settings.get("include_prompt", True))
    transformer = Transformer.load_config(location, subfolder=listed[0].get("path", ""))
    tokenizer = _json(location, "tokenizer_config.json", listed[0].get("path", "")) or {}
    assert isinstance(tokenizer, dict)
    settings = _json(location, "config_sentence_transformers.json") or {}
    assert isinstance(settings, dict)
    # As the library loads them: its default names (query, document: no text) under the saved ones; an empty prompt
    # is still a name encode(prompt_name=...) takes.
    defaults = dict.fromkeys(getattr(SentenceTransformer, "_default_prompts", {}), "")
    prompts = {**defaults, **{name: text or "" for name, text in (settings.get("prompts") or {}).items()}}
    return SentencePipeline(
        location, declared=True, modules=modules, pooling=pooling, include_prompt=include_prompt,
        do_lower_case=bool(transformer.get("do_lower_case", False)),
        max_seq_length=transformer.get("max_seq_length") or _limit(tokenizer.get("model_max_length")),
        prompts=prompts,
        default_prompt_name=settings.get("default_prompt_name") or None,
        similarity=settings.get("similarity_fn_name") or "cosine")


def _limit(value: object) -> int | None:
    """A tokenizer's model_max_length as a limit (transformers writes a huge number for "none")."""
    return int(value) if isinstance(value, int | float) and value < 1_000_000 else None


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
    """The library's module objects after the transformer, Pooling in `mode`."""
    from sentence_transformers.sentence_transformer.modules import Pooling
    from sentence_transformers.util import import_from_string

    if not pipeline.declared:
        return [Pooling(hidden_size, mode)]
    modules = []
    for module in pipeline.modules:
        if module.name == "Pooling" and mode != pipeline.pooling:
            modules.append(Pooling(hidden_size, mode))
        else:
            modules.append(import_from_string(module.ref).load(pipeline.location, subfolder=module.path,
                                                               trust_remote_code=trust_remote_code))
    return modules


def load_head(pipeline: SentencePipeline, mode: str, hidden_size: int,
              trust_remote_code: bool = False) -> torch.nn.Module | None:
    """The modules after the transformer as one torch module (features dict in, features dict out), in eval mode;
    None for `mode` none."""
    import torch

    if mode == "none":
        return None
    return torch.nn.Sequential(*_modules(pipeline, mode, hidden_size, trust_remote_code)).eval()


def library_model(pipeline: SentencePipeline, mode: str, hidden_size: int,
                  trust_remote_code: bool = False) -> tuple[SentenceTransformer, list[str]]:
    """The model as sentence-transformers itself loads it (its own transformer, default attention), and the Python
    statements that build it as `model`: `SentenceTransformer(folder)` for a declared pipeline (its Pooling replaced
    when overridden), else the library's Transformer and Pooling modules."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer

    if pipeline.declared:
        model = SentenceTransformer(pipeline.location, device="cpu", trust_remote_code=trust_remote_code)
        statements = [f"model = SentenceTransformer({pipeline.location!r})"]
        if mode not in ("none", pipeline.pooling):
            index = 1 + next(i for i, m in enumerate(pipeline.modules) if m.name == "Pooling")
            key = list(model._modules)[index]
            model._modules[key] = _modules(pipeline, mode, hidden_size, trust_remote_code)[index - 1]
            statements.append(f"model[{index}] = Pooling({hidden_size}, pooling_mode={mode!r})")
        return model, statements
    trust = {"trust_remote_code": trust_remote_code}
    transformer = Transformer(pipeline.location, model_kwargs=trust, processor_kwargs=trust, config_kwargs=trust)
    modules = [transformer, *(_modules(pipeline, mode, hidden_size, trust_remote_code) if mode != "none" else [])]
    pooling = f", Pooling({hidden_size}, pooling_mode={mode!r})" if mode != "none" else ""
    return (SentenceTransformer(modules=modules, device="cpu"),
            [f"model = SentenceTransformer(modules=[Transformer({pipeline.location!r}){pooling}])"])


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

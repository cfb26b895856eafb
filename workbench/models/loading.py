"""Find and load a model and its tokenizer: the embedded default, a local folder, or a hub id."""
from __future__ import annotations

import errno
import inspect
import json
import os
import shlex
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Literal

from workbench.core.atomic import tree_checksum
from workbench.core.config import BatchRange, RunConfig, ShapeRange
from workbench.core.data import lowercase_inputs
from workbench.core.errors import ConfigError, WorkbenchError
from workbench.models.errors import (
    ModelLoadError,
    ModelNotFoundError,
    TokenizerNotFoundError,
    UnsupportedModelError,
    ZippedModelError,
)
from workbench.models.families import family
from workbench.models.footprint import model_token_budget
from workbench.models.pins import pin, project_version
from workbench.models.sentence import (
    SentencePipeline,
    cross_encoder,
    encoder_class,
    graph_pooling,
    load_head,
    prompt_tokens,
    read_pipeline,
    with_truncation,
)
from workbench.models.text import Text
from workbench.tasks.choice import AUTO, embedded_folder
from workbench.tasks.registry import INPUT_NAMES, PIPELINE_TASKS, POOLING_MASK, TASKS, Task

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig
    from transformers import PreTrainedTokenizerBase as Tokenizer

# The sizes a config builds the architecture from (transformers maps each family's own names onto these).
SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
               "max_position_embeddings")
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model",
                   "tokenizer.model")
SENTENCEPIECE_FILES = ("spiece.model", "sentencepiece.bpe.model", "tokenizer.model")


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["local", "embedded", "hub"]
    location: str


def resolve_source(model: str) -> ModelSource:
    """Decide where `model` comes from; a path-like name that does not exist is an error, not a hub id."""
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            if (path / "modules.json").is_file():  # a sentence-transformers model without a transformer at its top
                read_pipeline(str(path))  # names the module the workbench does not export (StaticEmbedding ...)
            raise not_a_model_folder(path)
        return ModelSource("local", str(path.resolve()))
    _refuse_broken_link(path)
    if is_path(model):
        where = "" if Path(model).is_absolute() else f" (relative to the working directory {Path.cwd()})"
        raise ModelNotFoundError(f"model path {model} does not exist{where}",
                                 "check the path (an absolute one works from anywhere, a notebook's working directory "
                                 "is its own folder), or pass a hub id like org/name")
    embedded = embedded_folder(model)
    if embedded is not None:
        return ModelSource("embedded", str(embedded))
    return ModelSource("hub", model)


def is_path(model: str) -> bool:
    """`model` names a folder on this machine (it exists, or is spelled as a path), not a hub id."""
    return (Path(model).expanduser().exists() or model.startswith(("/", ".", "~")) or "\\" in model
            or model.count("/") > 1)


def _refuse_broken_link(path: Path) -> None:
    """A path that does not resolve because of a symbolic link (one that loops, or points nowhere): say which."""
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ModelNotFoundError(f"model path {path} goes through symbolic links that loop ({exc.strerror})",
                                     "fix the links (`ls -l` each part of the path), or pass the model folder's "
                                     "real path") from None
    if path.is_symlink():
        raise ModelNotFoundError(f"model path {path} is a symbolic link to {os.readlink(path)}, which does not exist",
                                 "point the link at the model folder, or pass the folder itself")


def weight_bytes(source: ModelSource) -> int | None:
    """Bytes of a local model's weights (its top-level safetensors files, else its .bin files); None for a hub id."""
    if source.kind == "hub":
        return None
    folder = Path(source.location)
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    return sum(path.stat().st_size for path in files)


def not_a_model_folder(path: Path) -> ModelNotFoundError:
    """Why `path` (no config.json) is not a model folder, and what to pass instead: the extracted zip for a zipped
    model (some pip packages ship one), the folder one level down, or a save_pretrained() folder."""
    if path.is_dir():
        problem, archives = f"{path} is not a model folder (no config.json in it)", sorted(path.glob("*.zip"))
    else:
        problem, archives = f"{path} is a file, not a model folder", [path]
    archives = [archive for archive in archives if zipfile.is_zipfile(archive)]
    for archive in archives:
        inner = zipped_config(archive)
        if inner:
            dest = Path("models") / archive.stem
            model_dir = dest / PurePosixPath(inner).parent
            return ZippedModelError(
                f"{problem}; {archive.name if archive != path else 'it'} is a zipped model, its config.json at "
                f"{inner} inside",
                f"extract it: `python -m zipfile -e {shlex.quote(str(archive.resolve()))} {shlex.quote(str(dest))}`, "
                f"then pass --model {shlex.quote(str(model_dir))}",
            )
    if archives:
        problem += f"; no config.json in {', '.join(archive.name for archive in archives)} either"
    nested = sorted(path.glob("*/config.json")) if path.is_dir() else []
    fix = (f"pass the model folder one level down: --model {shlex.quote(str(nested[0].parent))}" if nested else
           "pass a folder written by save_pretrained(), holding config.json, weights and tokenizer files")
    return ModelNotFoundError(problem, fix)


def zipped_config(archive: Path) -> str | None:
    """The path inside `archive` of its top-most config.json; None when it holds none or cannot be read."""
    try:
        with zipfile.ZipFile(archive) as handle:
            found = [name for name in handle.namelist() if PurePosixPath(name).name == "config.json"]
    except (zipfile.BadZipFile, OSError):
        return None
    return min(found, key=lambda name: (name.count("/"), name)) if found else None


@dataclass
class LoadedModel:
    """A model ready to export: torch module in eval mode, tokenizer, task and graph input names; for feature
    extraction, the sentence-transformers pipeline, the pooling the graph uses and the head after the transformer."""

    source: ModelSource
    hf_config: PretrainedConfig
    tokenizer: Tokenizer
    model: torch.nn.Module
    task: Task
    input_names: tuple[str, ...]
    sequence: ShapeRange  # the run's tokens per text: its `sequence` setting resolved against `limit`
    pipeline: SentencePipeline | None = None
    pooling: str = "none"
    head: torch.nn.Module | None = None

    @property
    def architecture(self) -> str:
        return self.hf_config.model_type

    @property
    def optimizer_model_type(self) -> str | None:
        """ONNX Runtime's fusion model type for this family; None when its optimizer has no rules for it."""
        return family(self.architecture).fusion_rules

    @property
    def num_heads(self) -> int:
        return int(self.hf_config.num_attention_heads)

    @property
    def hidden_size(self) -> int:
        return int(self.hf_config.hidden_size)

    @property
    def intermediate_size(self) -> int:
        """The feed-forward width (DistilBERT calls it hidden_dim; 4 x hidden where the config names neither)."""
        return int(getattr(self.hf_config, "intermediate_size", None) or getattr(self.hf_config, "hidden_dim", None)
                   or 4 * self.hidden_size)

    def reference_attention(self) -> str:
        """Run the module with PyTorch's fused attention (sdpa) where its architecture has it, and return the
        attention it runs: the same answers as eager to fp32 rounding (2e-6 on an 8192-token XLM-R layer) in memory
        that grows with the sequence, not with its square (0.5 GB against 8.6 GB for one 8192-token text at 16
        heads). Only the export needs eager, the pattern ONNX Runtime fuses."""
        switchable = getattr(self.model, "_can_set_attn_implementation", lambda: False)()
        if self.model.config._attn_implementation != "sdpa" and switchable and self.model._supports_sdpa:
            self.model.set_attn_implementation("sdpa")  # MPNet's, with no sdpa path, stays eager
        return str(self.model.config._attn_implementation)

    def drop_weights(self) -> None:
        """Free the module's weights once nothing will run it (moved to PyTorch's meta device, which keeps their
        shapes only): a base-size model holds 0.4 GB."""
        from workbench.models.footprint import release_memory

        self.model.to("meta")
        release_memory()

    @property
    def has_weights(self) -> bool:
        """Whether the module can run (`drop_weights` was not called)."""
        return not any(parameter.is_meta for parameter in self.model.parameters())

    def token_budget(self, batch: BatchRange) -> tuple[int, str]:
        """The padded tokens one of the run's batches may hold, and why (`footprint.model_token_budget`, with this
        model's shape at the run's sequence.max)."""
        return model_token_budget(batch, self.num_heads, self.hidden_size, self.intermediate_size, self.sequence.max,
                                  4 * sum(p.numel() for p in self.model.parameters()))

    @property
    def max_positions(self) -> int | None:
        value = getattr(self.hf_config, "max_position_embeddings", None)
        return int(value) if value else None

    @property
    def checksum(self) -> str | None:
        """sha256 of the model's folder (weights, configs, tokenizer, sentence-transformers modules); None for a
        hub id."""
        return tree_checksum(Path(self.source.location)) if self.source.kind != "hub" else None

    def identity(self) -> str | None:
        """What decides this model's outputs besides its inputs: its files, the run's pooling and the libraries'
        versions (None for a hub id)."""
        if self.checksum is None:
            return None
        import torch
        import transformers

        cut = f"; truncate_dim {self.pipeline.truncate_dim}" if self.pipeline and self.pipeline.truncate_dim else ""
        return (f"model {self.checksum}; task {self.task.name}; pooling {self.pooling}{cut}; inputs "
                f"{','.join(self.input_names)}; workbench {project_version()}; torch {torch.__version__}; "
                f"transformers {transformers.__version__}")

    @property
    def limit(self) -> Limit:
        return sequence_limit(self.hf_config, self.tokenizer, self.pipeline)

    @property
    def max_sequence(self) -> int:
        return self.limit.tokens

    def prompted(self, texts: tuple[Text, ...], prompt_name: str | None = None) -> tuple[Text, ...]:
        """`texts` as the model's users encode them: after the named prompt, else its default prompt (if any)."""
        return self.pipeline.prompted(texts, prompt_name) if self.pipeline else texts

    def prompt_tokens(self, prompt_name: str | None = None) -> int:
        """How many first tokens of a text after the named prompt (None: the default one) pooling leaves out: the
        prompt's, for a model that pools without it (a pooling-mask input), else none."""
        if POOLING_MASK not in self.input_names or self.pipeline is None:
            return 0
        return prompt_tokens(self.tokenizer, self.pipeline.prompt(prompt_name), self.max_sequence)

    @property
    def pooling_overridden(self) -> bool:
        return bool(self.pipeline and self.pipeline.declared and self.pooling not in ("none", self.pipeline.pooling))


@dataclass(frozen=True)
class Limit:
    """The most tokens the model takes as its users run it, and where that number comes from."""

    tokens: int
    source: str


def sequence_limit(hf_config: PretrainedConfig, tokenizer: Tokenizer,
                   pipeline: SentencePipeline | None = None) -> Limit:
    """Longest input the model takes as its library runs it: the sentence-transformers max_seq_length (what encode()
    cuts at), the tokenizer's model_max_length and the position table (less RoBERTa's padding offset), whichever is
    smallest (the first named of equal ones)."""
    found: list[tuple[int, str]] = []
    if pipeline is not None and pipeline.max_seq_length:
        found.append((int(pipeline.max_seq_length), f"max_seq_length {pipeline.max_seq_length} of its "
                                                     "sentence-transformers files, where encode() cuts"))
    if tokenizer.model_max_length < 1_000_000:
        found.append((int(tokenizer.model_max_length),
                      f"its tokenizer's model_max_length {tokenizer.model_max_length}"))
    positions = getattr(hf_config, "max_position_embeddings", None)
    if positions and positions > 0:
        offset = hf_config.pad_token_id + 1 if family(hf_config.model_type).position_offset else 0
        less = f" less the padding offset {offset}" if offset else ""
        found.append((int(positions) - offset, f"its {positions} position embeddings{less}"))
    if not found:
        return Limit(512, "no limit in its files: 512")
    tokens = min(value for value, _ in found)
    return Limit(tokens, next(source for value, source in found if value == tokens))


def _from_pretrained(loader: Any, source: ModelSource, what: str, **kwargs: Any) -> Any:
    from huggingface_hub.errors import StrictDataclassError
    from safetensors import SafetensorError

    try:
        return loader.from_pretrained(source.location, **kwargs)
    except OSError as exc:
        if source.kind == "hub":
            raise ModelNotFoundError(
                f"cannot load {what} {source.location!r} from the hub: {str(exc).splitlines()[0]}",
                "check the id and network access (HF_HUB_OFFLINE unset), or pass a local folder",
            ) from None
        raise ModelNotFoundError(f"cannot load {what} from {source.location}: {exc}",
                                 "re-save the model with save_pretrained()") from None
    except SafetensorError as exc:
        raise ModelLoadError(f"cannot read the weights of {_unreadable_weights(source)}: {exc}",
                             "the weights file is truncated or corrupt: re-download or re-save it "
                             "(save_pretrained())") from None
    except StrictDataclassError as exc:  # valid JSON with a field of the wrong type ("hidden_size": "384")
        raise _bad_config(source, str(exc).strip().splitlines()[-1].strip()) from None
    except ValueError as exc:
        refusal = _attention_refusal(exc, kwargs.get("attn_implementation")) or _config_refusal(source, exc)
        if refusal is None:
            raise
        raise refusal from None


def _bad_config(source: ModelSource, problem: str) -> ModelLoadError:
    """The typed error for a config.json transformers parses but cannot use."""
    return ModelLoadError(f"{source.location}/config.json is invalid: {problem}",
                          "set that field to the value the model was trained with (its original config.json), or "
                          "re-save the model with save_pretrained()")


def check_sizes(source: ModelSource, hf_config: PretrainedConfig) -> None:
    """Every size the architecture is built from (vocabulary, width, depth, heads, positions) is positive."""
    for field in SIZE_FIELDS:
        value = getattr(hf_config, field, None)
        if isinstance(value, int) and value <= 0:
            raise _bad_config(source, f"{field} is {value}, and a size must be a positive integer")


def _unreadable_weights(source: ModelSource) -> str:
    """The safetensors files of a local folder whose header cannot be read, or the hub id."""
    from safetensors import SafetensorError, safe_open

    if source.kind == "hub":
        return f"hub id {source.location!r} (its copy in the Hugging Face cache)"
    bad = []
    for path in sorted(Path(source.location).glob("*.safetensors")):
        try:
            with safe_open(str(path), "pt"):
                pass
        except SafetensorError:
            bad.append(str(path))
    return ", ".join(bad) or source.location


def _attention_refusal(exc: ValueError, attn_implementation: str | None) -> WorkbenchError | None:
    """The typed error for an attention implementation the architecture does not have (sdpa for DeBERTa-v2)."""
    if attn_implementation and "attention implementation" in str(exc):
        return UnsupportedModelError(str(exc).split(". ")[0],
                                     "set -p attn_implementation=eager (every architecture has it)")
    return None


def _config_refusal(source: ModelSource, exc: ValueError) -> WorkbenchError | None:
    """The typed error for a config transformers refuses: custom code not trusted, or an unknown model_type."""
    from transformers import PretrainedConfig, __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        raw = PretrainedConfig.get_config_dict(source.location)[0]
    except (OSError, ValueError):
        return None
    where = f"{source.location}/config.json"
    if raw.get("auto_map") and "trust_remote_code" in str(exc):
        return _custom_code_refusal(where, raw["auto_map"])
    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        return UnsupportedModelError(
            f"transformers {__version__} does not know model_type {model_type!r} ({where})",
            "correct model_type in config.json, upgrade transformers if the family is newer, or, if the model "
            "ships its own code (auto_map), -p trust_remote_code=true",
        )
    return None


def _custom_code_refusal(where: str, auto_map: dict[str, Any]) -> UnsupportedModelError:
    """The typed error for a config whose auto_map names custom code while trust_remote_code is off."""
    files = sorted({f"{ref.split('--')[-1].split('.')[0]}.py" for ref in _references(auto_map)})
    return UnsupportedModelError(
        f"{where} loads custom code ({', '.join(files)} through auto_map) and trust_remote_code is off",
        "only if you trust its author: -p trust_remote_code=true (that Python code then runs with your "
        f"permissions; read {', '.join(files)} first), or use a model transformers supports natively",
    )


def _references(auto_map: dict[str, Any]) -> list[str]:
    """Every `module.Class` reference of a config's auto_map (tokenizer entries are pairs)."""
    return [ref for value in auto_map.values() for ref in (value if isinstance(value, list) else [value]) if ref]


def load_tokenizer(source: ModelSource, trust_remote_code: bool = False) -> Tokenizer:
    from transformers import AutoTokenizer

    if source.kind != "hub" and not any((Path(source.location) / f).is_file() for f in TOKENIZER_FILES):
        raise TokenizerNotFoundError(
            f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {source.location}",
            "save the tokenizer beside the model: tokenizer.save_pretrained(<model folder>)",
        )
    try:
        return _from_pretrained(AutoTokenizer, source, "tokenizer", trust_remote_code=trust_remote_code)
    except (ValueError, TypeError, KeyError) as exc:
        raise _sentencepiece_refusal(source) or TokenizerNotFoundError(
            f"the tokenizer in {source.location} cannot be loaded: {exc}",
            "save a fast tokenizer with tokenizer.save_pretrained()") from None


def _sentencepiece_refusal(source: ModelSource) -> TokenizerNotFoundError | None:
    """Why a folder whose tokenizer is only a sentencepiece model does not load: transformers converts it with
    sentencepiece's protobuf code, and where that does not import (sentencepiece missing, or its gencode newer than
    the installed protobuf) it reads the file as a TikToken vocabulary instead and fails on its first line."""
    from google.protobuf.runtime_version import VersionError

    folder = Path(source.location)
    model = next((folder / name for name in SENTENCEPIECE_FILES if (folder / name).is_file()), None)
    if source.kind == "hub" or model is None or (folder / "tokenizer.json").is_file():
        return None
    try:
        from sentencepiece import sentencepiece_model_pb2  # noqa: F401 (what transformers' converter reads it with)
    except (ImportError, VersionError) as exc:
        return TokenizerNotFoundError(
            f"{model} is a sentencepiece model (no tokenizer.json) and transformers cannot read it here: {exc}",
            f"install {pin('sentencepiece')} (pip install -e '.[generation]'), whose protobuf code runs on the "
            "installed protobuf, or save tokenizer.json where it loads: tokenizer.save_pretrained(<model folder>)")
    return None


def load_config(source: ModelSource, trust_remote_code: bool = False) -> Any:
    from transformers import AutoConfig

    hf_config = _from_pretrained(AutoConfig, source, "config", trust_remote_code=trust_remote_code)
    auto_map = getattr(hf_config, "auto_map", None)
    if auto_map and not trust_remote_code:  # a known model_type loads the stock class: the user's code would not run
        raise _custom_code_refusal(f"{source.location}/config.json", auto_map)
    check_sizes(source, hf_config)
    return hf_config


def check_supported(hf_config: PretrainedConfig, task: Task, embedder: bool = False) -> None:
    """Accept any encoder-only architecture transformers loads with the task's auto class, a decoder-only one
    with a sentence-transformers pipeline (`embedder`: a decoder embedder) and an encoder-decoder's encoder its
    library embeds with (sentence-T5); refuse other generators."""
    kind = generative_kind(hf_config)
    if kind == "seq2seq" and task.name == "feature-extraction" and encoder_class(hf_config, embedder):
        kind = None  # its library embeds with the encoder alone (T5EncoderModel for sentence-T5)
    if kind and not (embedder and kind == "decoder-only"):
        raise UnsupportedModelError(
            f"architecture {hf_config.model_type!r} is a {kind} model, not an encoder: {task.name} exports encoders"
            + (" and decoder embedders (a sentence-transformers folder)" if task.name == "feature-extraction" else ""),
            "generate with it in the generation step (-p text_generation_model=<model> for decoder-only, "
            "-p translation_model=<model> for seq2seq), pick an encoder model, or, to embed with a decoder, pass "
            "the folder sentence-transformers saved it in (modules.json: Transformer, Pooling, ...)",
        )
    custom = getattr(hf_config, "auto_map", None) or {}
    if hf_config.model_type not in task.architectures() and task.auto_class not in custom:
        others = [t.name for t in TASKS.values() if hf_config.model_type in t.architectures()
                  and t.name != "sparse-embedding"]  # that one reads a SparseEncoder's folder, not any masked LM
        raise UnsupportedModelError(
            f"transformers has no {task.auto_class} for architecture {hf_config.model_type!r}, so it cannot be "
            f"exported for {task.name}",
            f"use -p task={' or '.join(others)}" if others else "use a model transformers supports for this task",
        )


def check_decoder_padding(hf_config: PretrainedConfig, tokenizer: Tokenizer) -> None:
    """A decoder embedder with learned absolute positions (GPT-2) whose tokenizer pads on the left: its library's
    answer for a text depends on how much padding its batch gave it, which no server can reproduce."""
    rotary = getattr(hf_config, "rope_parameters", None) is not None or hasattr(hf_config, "rope_theta")
    if generative_kind(hf_config) == "decoder-only" and tokenizer.padding_side == "left" and not rotary:
        raise UnsupportedModelError(
            f"architecture {hf_config.model_type!r} has learned absolute positions and its tokenizer pads on the left: "
            "encode() gives a text other positions, and another embedding, in each batch it pads differently",
            "save the tokenizer with padding_side='right' (tokenizer.padding_side = 'right'; "
            "tokenizer.save_pretrained(folder)): every text then keeps its own positions, in encode() and served")


def pad_on_the_right(tokenizer: Tokenizer) -> None:
    """A decoder embedder's tokenizer as the workbench uses it: padding on the right, where every text keeps the
    positions it has alone (a left-padded text's positions shift with its padding; rotary models answer the same
    either way, absolute-position ones do not), with the end-of-text token as padding where it has none.
    sentence-transformers' last-token pooling finds each text's last real token on either side."""
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token


def generative_kind(hf_config: PretrainedConfig) -> str | None:
    """'seq2seq' or 'decoder-only' for models made to generate text; None for encoders."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    if getattr(hf_config, "is_encoder_decoder", False):
        return "seq2seq"
    causal, masked = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES
    causal_only = hf_config.model_type in causal and hf_config.model_type not in masked
    return "decoder-only" if getattr(hf_config, "is_decoder", False) or causal_only else None


@contextmanager
def traceable_masks() -> Iterator[None]:
    """Build attention masks without torch.vmap while inside: transformers vmaps a custom pattern (Gemma 3's
    bidirectional attention and its two-sided window, EmbeddingGemma's), which the TorchScript tracer cannot follow
    (RuntimeError: unordered_map::at). Those patterns are index arithmetic, so its broadcast path builds the same
    mask, and the graph keeps it for every batch and length."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    def broadcast(build: Any) -> Any:
        return lambda *args, **kwargs: build(*args, **{**kwargs, "use_vmap": False})

    names = ("eager", "sdpa")
    for name in names:
        ALL_MASK_ATTENTION_FUNCTIONS[name] = broadcast(ALL_MASK_ATTENTION_FUNCTIONS[name])
    try:
        yield
    finally:
        for name in names:
            del ALL_MASK_ATTENTION_FUNCTIONS[name]  # the local override: the global mapping shows through again


def checkpoint_keys(folder: Path) -> set[str] | None:
    """The parameter names a local folder's weights hold (safetensors headers, a sharded index, or .bin files);
    None when it has none readable here."""
    from safetensors import SafetensorError, safe_open

    index = next(iter(sorted(folder.glob("*.safetensors.index.json"))), None)
    if index is not None:
        return set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}))
    keys: set[str] = set()
    try:
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(str(path), "pt") as handle:
                keys.update(handle.keys())
    except SafetensorError:
        return None
    if not keys:
        import torch

        for path in sorted(folder.glob("*.bin")):
            keys.update(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    return keys or None


def check_task_head(source: ModelSource, hf_config: PretrainedConfig, task: Task) -> None:
    """A classifier's head must be in the weights: a folder saved from a base model (an embedding model) has none,
    and transformers would give the task's head random weights."""
    if task.name == "feature-extraction" or source.kind == "hub" or getattr(hf_config, "auto_map", None):
        return
    keys = checkpoint_keys(Path(source.location))
    if keys is None:
        return  # nothing readable: loading the weights says what is wrong
    import torch
    import transformers

    with torch.device("meta"):
        model = getattr(transformers, task.auto_class).from_config(hf_config)
    prefix = f"{model.base_model_prefix}."
    tensors = model.state_dict(keep_vars=True)
    saved = {id(tensor) for key, tensor in tensors.items() if key in keys}  # a tied head shares its embeddings'
    missing = [key for key, tensor in tensors.items()
               if not key.startswith(prefix) and key not in keys and id(tensor) not in saved]
    if missing:
        raise UnsupportedModelError(
            f"task={task.name} needs {type(model).__name__}'s head ({', '.join(missing)}), and the weights in "
            f"{source.location} have none: transformers would start it from random values",
            "pass a folder saved from a model fine-tuned for that task, or leave task at feature-extraction for "
            "this model's embeddings")


def check_pooling_task(config: RunConfig) -> None:
    """Pooling makes an embedding: another task's graph returns its head's logits and would ignore it
    (ConfigError, from preflight with the model's problems, or when a step loads the model)."""
    task = config.task_choice.name
    if task != "feature-extraction" and (config.pooling != "auto" or config.pooling_override or config.truncate_dim):
        chosen = (f"truncate_dim={config.truncate_dim}" if config.truncate_dim else "pooling_override=true"
                  if config.pooling == "auto" else f"pooling={config.pooling}")
        passed = [f"-p {name}" for name, on in (("pooling", config.pooling != "auto"),
                                                 ("pooling_override", config.pooling_override),
                                                 ("truncate_dim", config.truncate_dim)) if on]
        raise ConfigError(f"{chosen} applies to task feature-extraction only; task {task} returns "
                          f"{TASKS[task].description}",
                          f"drop {' and '.join(passed)} for this task"
                          + (", or -p task=feature-extraction for its embeddings" if config.task == AUTO else ""))


def load_model(config: RunConfig) -> LoadedModel:
    """Load tokenizer and torch model for `config.task_choice`, in eval mode with the configured attention; the model's
    sentence-transformers pipeline (feature extraction) and the run's sequence range are settled before the weights
    load."""
    import torch
    import transformers

    if config.threads:
        torch.set_num_threads(config.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    task = TASKS[config.task_choice.name]
    check_pooling_task(config)
    source = resolve_source(config.model)
    hf_config = load_config(source, config.trust_remote_code)
    pipeline = with_truncation(read_pipeline(source.location, config.trust_remote_code, task.name),
                               config.truncate_dim) if task.name in PIPELINE_TASKS else None
    check_supported(hf_config, task, pipeline is not None and pipeline.declared)
    check_task_head(source, hf_config, task)
    tokenizer = load_tokenizer(source, config.trust_remote_code)
    decoder = generative_kind(hf_config) == "decoder-only"
    if decoder:
        check_decoder_padding(hf_config, tokenizer)
        pad_on_the_right(tokenizer)
    pooling = graph_pooling(pipeline, config.pooling, config.pooling_override, int(hf_config.hidden_size)) \
        if pipeline else "none"
    if pipeline is not None and pipeline.do_lower_case:
        lowercase_inputs(tokenizer)
    limit = sequence_limit(hf_config, tokenizer, pipeline)
    sequence = config.sequence.resolve(limit.tokens, limit.source)
    # The class the model's library loads: an encoder-decoder's encoder alone for an embedder (sentence-T5)
    declared = pipeline is not None and pipeline.declared
    auto = (task.name == "feature-extraction" and encoder_class(hf_config, declared)) or \
        getattr(transformers, task.auto_class)
    model = _from_pretrained(auto, source, "model", trust_remote_code=config.trust_remote_code,
                             attn_implementation=config.attn_implementation)
    model.eval()
    if decoder:  # an embedder reads the last hidden states once: no key/value cache to return or keep
        model.config.use_cache = False
    accepted = set(inspect.signature(model.forward).parameters)
    if getattr(hf_config, "type_vocab_size", None) == 0:  # no segment embeddings (DeBERTa-v3): the input is unused
        accepted.discard("token_type_ids")
    names = tuple(n for n in INPUT_NAMES if n in tokenizer.model_input_names and n in accepted)
    if names[:2] != ("input_ids", "attention_mask"):
        raise UnsupportedModelError(
            f"the tokenizer of {config.model} produces {tokenizer.model_input_names}, "
            "not input_ids and attention_mask",
            "use a tokenizer that returns input_ids and attention_mask",
        )
    if pipeline is not None and not pipeline.include_prompt and pooling != "none":
        names += (POOLING_MASK,)
    loaded = LoadedModel(source, hf_config, tokenizer, model, task, names, sequence, pipeline, pooling)
    if pipeline is not None:
        loaded.head = load_head(pipeline, pooling, loaded.hidden_size, config.trust_remote_code)
    if task.name == "rerank":  # the scores predict() returns: its activation after the logits
        loaded.head = cross_encoder(source.location, limit.tokens, config.trust_remote_code).activation_fn
    return loaded

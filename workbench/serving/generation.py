"""Translation and text generation: the models, CTranslate2 conversion, and greedy decoding in process with
transformers and CTranslate2 through the same code the Triton models run (serving/backend/generation_core.py)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.core.atomic import atomic_dir
from workbench.core.errors import ConfigError, DependencyMissingError
from workbench.core.metrics import Metrics
from workbench.models.loading import ModelSource, resolve_source
from workbench.models.tiny import TINY
from workbench.serving.backend import generation_core as core

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase as Tokenizer


@dataclass(frozen=True)
class GenTask:
    """A generation task: the transformers class, CTranslate2's engine, and how sequences are padded."""

    name: str
    setting: str  # the GenerationSettings field naming its model
    auto_class: str
    ct2_class: str
    kind: str  # "seq2seq" or "decoder"


GEN_TASKS = {
    task.name: task for task in (
        GenTask("translation", "translation_model", "AutoModelForSeq2SeqLM", "Translator", "seq2seq"),
        GenTask("text-generation", "text_generation_model", "AutoModelForCausalLM", "Generator", "decoder"),
    )
}


def materialize(name: str, dest: Path, trust_remote_code: bool = False) -> Path:
    """A local save_pretrained folder for `name` (tiny:<arch> is built here; hub ids are downloaded once)."""
    dest = Path(dest)
    if (dest / "config.json").is_file():
        return dest
    if name in TINY:
        with atomic_dir(dest) as tmp:
            TINY[name](tmp)
        return dest
    source: ModelSource = resolve_source(name)
    if source.kind == "local":
        return Path(source.location)
    import transformers

    with atomic_dir(dest) as tmp:
        for loader in (transformers.AutoTokenizer, transformers.AutoConfig):
            loader.from_pretrained(source.location, trust_remote_code=trust_remote_code).save_pretrained(tmp)
        config = transformers.AutoConfig.from_pretrained(source.location, trust_remote_code=trust_remote_code)
        auto = "AutoModelForSeq2SeqLM" if config.is_encoder_decoder else "AutoModelForCausalLM"
        getattr(transformers, auto).from_pretrained(source.location,
                                                    trust_remote_code=trust_remote_code).save_pretrained(tmp)
    return dest


def load_hf(task: GenTask, folder: Path, threads: int | None = None) -> tuple[Any, Any]:
    import torch
    import transformers

    if threads:
        torch.set_num_threads(threads)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = getattr(transformers, task.auto_class).from_pretrained(folder).eval()
    if task.kind == "decoder":
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


class Conversion(Metrics):
    """A CTranslate2 conversion: the seconds it took and the CTranslate2 version that wrote it."""

    seconds: float
    ctranslate2: str


class FirstDifference(Metrics):
    """The first sequence transformers and CTranslate2 decoded differently: its index and both token ids."""

    index: int
    hf: list[int]
    ct2: list[int]


class GreedyComparison(Metrics):
    """transformers generate against CTranslate2 in process, greedy: sequences identical token for token, the
    seconds and tokens each took, and the first that differs."""

    sequences: int
    identical: int
    hf_seconds: float | None = None
    ct2_seconds: float | None = None
    hf_tokens: int | None = None
    ct2_tokens: int | None = None
    first_difference: FirstDifference | None = None


def convert_ct2(folder: Path, dest: Path, quantization: str | None = None) -> Conversion:
    """CTranslate2's own converter, written atomically; the tokenizer files go beside the converted model."""
    try:
        import ctranslate2
    except ImportError:
        raise DependencyMissingError("CTranslate2 is not installed", "pip install -e '.[generation]'") from None
    import transformers

    start = time.perf_counter()
    with atomic_dir(dest) as tmp:
        converter = ctranslate2.converters.TransformersConverter(str(folder))
        converter.convert(str(tmp), quantization=None if quantization in (None, "float32") else quantization,
                          force=True)
        transformers.AutoTokenizer.from_pretrained(folder).save_pretrained(tmp / "tokenizer")
    return Conversion(seconds=round(time.perf_counter() - start, 3), ctranslate2=ctranslate2.__version__)


def load_ct2(task: GenTask, folder: Path, compute_type: str = "float32", threads: int | None = None) -> Any:
    import ctranslate2

    engine = getattr(ctranslate2, task.ct2_class)
    return engine(str(folder), device="cpu", compute_type=compute_type, intra_threads=threads or os.cpu_count() or 1)


def max_input_tokens(model: Any, tokenizer: Tokenizer, configured: int | None) -> int:
    """The configured limit, else the tokenizer's or the position table's."""
    if configured:
        return configured
    limits = [int(tokenizer.model_max_length)] if tokenizer.model_max_length < 1_000_000 else []
    for attribute in ("max_position_embeddings", "n_positions"):
        value = getattr(model.config, attribute, None)
        if value:
            limits.append(int(value))
    return min(limits) if limits else 512


def prepared_inputs(tokenizer: Tokenizer, texts: list[str], language: str | None, limit: int) -> list[list[int]]:
    style, codes = core.language_style(tokenizer)
    try:
        core.check_language(style, codes, language)
    except core.InputError as exc:
        raise ConfigError(str(exc), "set -p generation.target_language=<one of the model's codes>") from None
    return core.encode(tokenizer, texts, style, language, limit)


def compare_greedy(task: GenTask, model: Any, engine: Any, tokenizer: Tokenizer, sequences: list[list[int]],
                   max_new_tokens: int, language: str | None, batch: int = 8
                   ) -> tuple[GreedyComparison, list[list[int]]]:
    """Greedy HF generate vs CTranslate2 on the same token ids, in batches (padded and masked); transformers' ids."""
    style, _ = core.language_style(tokenizer)
    hf, ct2 = [], []
    start = time.perf_counter()
    for i in range(0, len(sequences), batch):
        hf += core.hf_generate(model, tokenizer, task.kind, sequences[i:i + batch], max_new_tokens, style, language)
    hf_seconds = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(0, len(sequences), batch):
        ct2 += core.ct2_generate(engine, tokenizer, task.kind, sequences[i:i + batch], max_new_tokens, style,
                                 language)
    ct2_seconds = time.perf_counter() - start
    same = [a == b for a, b in zip(hf, ct2)]
    first = next((i for i, s in enumerate(same) if not s), None)
    return GreedyComparison(
        sequences=len(sequences), identical=sum(same), hf_seconds=round(hf_seconds, 3),
        ct2_seconds=round(ct2_seconds, 3), hf_tokens=sum(map(len, hf)), ct2_tokens=sum(map(len, ct2)),
        first_difference=None if first is None else FirstDifference(index=first, hf=hf[first], ct2=ct2[first])), hf

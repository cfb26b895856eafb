"""The shipped text corpus and tokenization into numpy batches."""
from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from workbench.core.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase as Tokenizer

CORPUS_PATH = Path(__file__).parents[1] / "data" / "corpus.txt"

CORPUS_LINE_BYTES = 1 << 16  # bytes kept of one line: more text than any model reads
PROGRESS_BYTES = 64 << 20  # a corpus larger than this shows progress while it is read
SAMPLE_SEED = 0


@dataclass(frozen=True)
class CorpusSample:
    """The texts a run uses from its corpus, and how they were chosen (run.json `corpus`)."""

    texts: tuple[str, ...]
    path: str
    bytes: int
    found: int  # non-empty lines in the file

    @property
    def sampling(self) -> str:
        if len(self.texts) == self.found:
            return f"all {self.found} texts"
        return (f"{len(self.texts)} of {self.found} texts: a uniform reservoir sample (seed {SAMPLE_SEED}), in file "
                "order")

    def record(self) -> dict[str, str | int]:
        return {"path": self.path, "bytes": self.bytes, "texts_found": self.found, "texts_used": len(self.texts),
                "sampling": self.sampling}


def corpus_sample(path: Path | str | None = None, max_texts: int | None = None) -> CorpusSample:
    """Non-empty lines of a UTF-8 text file, one text per line (default: the shipped corpus), read as a stream: at
    most `max_texts` of them kept (a seeded uniform sample, in file order), so memory stays bounded by the sample
    whatever the file's size; lines longer than CORPUS_LINE_BYTES are cut there."""
    path = Path(path or CORPUS_PATH)
    try:
        stat = path.stat()
    except OSError as exc:
        raise ConfigError(f"cannot read corpus {path}: {exc}", "pass a UTF-8 text file with one text per line"
                          ) from None
    return _sample(str(path), stat.st_size, stat.st_mtime_ns, max_texts)


@lru_cache(maxsize=4)
def _sample(path: str, size: int, mtime_ns: int, max_texts: int | None) -> CorpusSample:
    from workbench.core.progress import Progress

    kept: list[tuple[int, str]] = []
    chooser, found = random.Random(SAMPLE_SEED), 0
    show = size > PROGRESS_BYTES
    try:
        with open(path, "rb") as file, Progress("reading corpus", max(size >> 20, 1), "MB") if show else \
                nullcontext() as bar:
            for number, text in enumerate(_lines(file), start=1):
                if bar is not None and (file.tell() >> 20) > bar.done:
                    bar.update((file.tell() >> 20) - bar.done)
                try:
                    text = text.decode("utf-8").strip()
                except UnicodeDecodeError as exc:
                    raise ConfigError(f"corpus {path} line {number} is not UTF-8 ({exc.reason} at byte {exc.start})",
                                      "pass a UTF-8 text file with one text per line") from None
                if not text:
                    continue
                found += 1
                if max_texts is None or len(kept) < max_texts:
                    kept.append((found, text))
                elif (slot := chooser.randrange(found)) < max_texts:
                    kept[slot] = (found, text)
    except OSError as exc:
        raise ConfigError(f"cannot read corpus {path}: {exc}", "pass a UTF-8 text file with one text per line"
                          ) from None
    if not kept:
        raise ConfigError(f"corpus {path} holds no text", "pass a UTF-8 text file with one text per line")
    return CorpusSample(tuple(text for _, text in sorted(kept)), path, size, found)


def _lines(file: BinaryIO) -> Iterator[bytes]:
    """Each line of `file`, at most CORPUS_LINE_BYTES of it (cut at a character boundary); the rest is skipped."""
    while raw := file.readline(CORPUS_LINE_BYTES):
        if len(raw) == CORPUS_LINE_BYTES and not raw.endswith(b"\n"):
            while (rest := file.readline(CORPUS_LINE_BYTES)) and not rest.endswith(b"\n"):
                pass
            raw = raw.decode("utf-8", errors="ignore").encode()  # a character the cut split goes
        yield raw


def load_corpus(path: Path | str | None = None, max_texts: int | None = None) -> tuple[str, ...]:
    """The texts of `corpus_sample`."""
    return corpus_sample(path, max_texts).texts


def lowercase_inputs(tokenizer: Tokenizer) -> None:
    """Lowercase before tokenizing, as sentence-transformers does for `do_lower_case` (a Lowercase normalizer first
    in the fast tokenizer's pipeline, which its `tokenizers` backend, served as encoder.json, keeps)."""
    from tokenizers.normalizers import Lowercase
    from tokenizers.normalizers import Sequence as Steps

    if not tokenizer.is_fast:
        tokenizer.do_lower_case = True
        return
    backend = tokenizer.backend_tokenizer
    normalizer = backend.normalizer
    steps = list(normalizer) if isinstance(normalizer, Steps) else [normalizer] if normalizer else []
    if not any(isinstance(step, Lowercase) for step in steps):
        backend.normalizer = Steps([Lowercase(), *steps])

"""The shipped text corpus and tokenization into numpy batches."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from workbench.core.errors import ConfigError

CORPUS_PATH = Path(__file__).parents[1] / "data" / "corpus.txt"


@lru_cache(maxsize=4)
def load_corpus(path: Path | str | None = None) -> tuple[str, ...]:
    """Non-empty lines of a UTF-8 text file, one text per line (default: the shipped corpus)."""
    path = Path(path or CORPUS_PATH)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read corpus {path}: {exc}",
                          "pass a UTF-8 text file with one text per line") from None
    texts = tuple(line.strip() for line in lines if line.strip())
    if not texts:
        raise ConfigError(f"corpus {path} holds no text", "pass a UTF-8 text file with one text per line")
    return texts


def encode(tokenizer: Any, texts: list[str], input_names: tuple[str, ...], max_length: int | None = None,
           pad_to: int | None = None) -> dict[str, np.ndarray]:
    """Right-padded int64 arrays for `input_names`; `pad_to` pads every row to that length."""
    limit = pad_to or max_length
    enc = tokenizer(list(texts), padding="max_length" if pad_to else True, truncation=limit is not None,
                    max_length=limit, return_tensors="np")
    return {name: np.ascontiguousarray(enc[name], dtype=np.int64) for name in input_names}

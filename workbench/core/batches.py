"""Real-text batches: at the shape corners of the run configuration, and the whole corpus in mixed batches."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from workbench.core.config import ShapeRange
from workbench.core.data import encode
from workbench.core.errors import ShapeError


@dataclass
class Batch:
    """Right-padded model inputs for `text_ids` (indices into the corpus)."""

    name: str
    text_ids: list[int]
    feed: dict[str, np.ndarray]

    @property
    def shape(self) -> tuple[int, int]:
        rows, length = self.feed["input_ids"].shape
        return int(rows), int(length)

    @property
    def mask(self) -> np.ndarray:
        return self.feed["attention_mask"]


def token_lengths(tokenizer: Any, texts: list[str]) -> np.ndarray:
    """Untruncated token counts, special tokens included."""
    return np.array([len(ids) for ids in tokenizer(list(texts), truncation=False, verbose=False)["input_ids"]])


def check_sequence_limit(sequence: ShapeRange, max_sequence: int) -> None:
    if sequence.max > max_sequence:
        raise ShapeError(
            f"sequence.max={sequence.max} exceeds the model's limit of {max_sequence} tokens",
            f"set -p sequence.max={max_sequence} (or lower) and sequence.opt <= that",
        )


def corner_batches(tokenizer: Any, input_names: tuple[str, ...], texts: list[str], batch: ShapeRange,
                   sequence: ShapeRange, max_sequence: int, seed: int = 0) -> list[Batch]:
    """Every (batch, sequence) corner filled with the texts nearest that length, plus mixed-length batches."""
    check_sequence_limit(sequence, max_sequence)
    lengths = token_lengths(tokenizer, texts)
    shortest = int(lengths.min())
    batches = [shaped_batch(tokenizer, input_names, texts, lengths, rows, length)
               for rows in sorted({batch.min, batch.opt, batch.max})
               for length in sorted({max(sequence.min, shortest), sequence.opt, sequence.max})]
    rng = np.random.default_rng(seed)
    for rows in sorted({batch.opt, batch.max}):
        ids = [int(i) for i in rng.choice(len(texts), size=rows, replace=rows > len(texts))]
        feed = encode(tokenizer, [texts[i] for i in ids], input_names, max_length=sequence.max)
        batches.append(Batch(f"mixed_b{rows}", ids, feed))
    return batches


def shaped_batch(tokenizer: Any, input_names: tuple[str, ...], texts: list[str], lengths: np.ndarray, rows: int,
                 length: int) -> Batch:
    """Exactly `rows` x `length`, filled with the texts nearest that length (at least that long first)."""
    order = np.argsort(np.abs(lengths - length) + (lengths < length) * 10_000, kind="stable")
    ids = [int(i) for i in np.resize(order, rows)]
    return Batch(f"b{rows}_s{length}", ids, encode(tokenizer, [texts[i] for i in ids], input_names, pad_to=length))


def cell_feeds(tokenizer: Any, input_names: tuple[str, ...], texts: list[str],
               cells: Sequence[tuple[int, int]]) -> dict[str, dict[str, np.ndarray]]:
    """Real text filling each (rows, length) cell exactly (`shaped_batch`), by cell name `b1 s16`."""
    lengths = token_lengths(tokenizer, texts)
    return {f"b{rows} s{length}": shaped_batch(tokenizer, input_names, texts, lengths, rows, length).feed
            for rows, length in cells}


def corpus_batches(tokenizer: Any, input_names: tuple[str, ...], texts: list[str], batch_size: int,
                   sequence: ShapeRange, max_sequence: int) -> list[Batch]:
    """Every text once, in corpus order (mixed lengths), right-padded to the longest in each batch; longer texts
    are cut at `sequence.max` (the configured range), never past the model's `max_sequence`."""
    batches = []
    for start in range(0, len(texts), batch_size):
        ids = list(range(start, min(start + batch_size, len(texts))))
        feed = encode(tokenizer, [texts[i] for i in ids], input_names, max_length=min(sequence.max, max_sequence))
        batches.append(Batch(f"corpus_{start // batch_size:03d}", ids, feed))
    return batches

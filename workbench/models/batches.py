"""Real-text batches: at the shape corners of the run configuration, and the whole corpus in batches of like length."""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from workbench.core.config import ShapeRange
from workbench.models.text import Text, encode, tokenize

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase as Tokenizer


Feed = dict[str, np.ndarray]  # one call's inputs (or outputs), by tensor name
Grouping = Callable[[list[int], int], list[list[int]]]  # token counts, most rows -> groups of their indices


class Cell(NamedTuple):
    """A (batch, sequence) shape: `key` names it in run.json (`b8_s128`), `label` in text (`b8 s128`)."""

    batch: int
    sequence: int

    @property
    def key(self) -> str:
        return f"b{self.batch}_s{self.sequence}"

    @property
    def label(self) -> str:
        return f"b{self.batch} s{self.sequence}"

    @classmethod
    def parse(cls, key: str) -> Cell | None:
        """The cell a run.json key names, or None for another key (e.g. a mixed-length batch's `mixed_b8`)."""
        match = re.fullmatch(r"b(\d+)_s(\d+)", key)
        return cls(int(match[1]), int(match[2])) if match else None


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


def token_lengths(tokenizer: Tokenizer, texts: Sequence[Text]) -> np.ndarray:
    """Untruncated token counts, special tokens included."""
    return np.array([len(ids) for ids in tokenize(tokenizer, texts, truncation=False, verbose=False)["input_ids"]])


def corner_batches(tokenizer: Tokenizer, input_names: tuple[str, ...], texts: Sequence[Text], batch: ShapeRange,
                   sequence: ShapeRange, seed: int = 0, prompt_tokens: int = 0,
                   max_tokens: int | None = None) -> list[Batch]:
    """Every (batch, sequence) corner filled with the texts nearest that length, plus mixed-length batches; a corner
    past `max_tokens` padded tokens holds as many texts as fit (one at least)."""
    lengths = token_lengths(tokenizer, texts)
    shortest = int(lengths.min())
    corners = sorted({(within(rows, length, max_tokens), length) for rows in {batch.min, batch.opt, batch.max}
                      for length in {max(sequence.min, min(shortest, sequence.max)), sequence.opt, sequence.max}})
    batches = [shaped_batch(tokenizer, input_names, texts, lengths, rows, length, prompt_tokens)
               for rows, length in corners]
    rng = np.random.default_rng(seed)
    for rows in sorted({within(rows, sequence.max, max_tokens) for rows in (batch.opt, batch.max)}):
        ids = [int(i) for i in rng.choice(len(texts), size=rows, replace=rows > len(texts))]
        feed = encode(tokenizer, [texts[i] for i in ids], input_names, max_length=sequence.max,
                      prompt_tokens=prompt_tokens)
        batches.append(Batch(f"mixed_b{rows}", ids, feed))
    return batches


def within(rows: int, length: int, max_tokens: int | None) -> int:
    """`rows` texts of `length` tokens, fewer where they would pass `max_tokens` padded tokens (one at least)."""
    return rows if max_tokens is None else max(1, min(rows, max_tokens // length))


def shaped_batch(tokenizer: Tokenizer, input_names: tuple[str, ...], texts: Sequence[Text], lengths: np.ndarray,
                 rows: int, length: int, prompt_tokens: int = 0) -> Batch:
    """Exactly `rows` x `length`, filled with the texts nearest that length (at least that long first)."""
    order = np.argsort(np.abs(lengths - length) + (lengths < length) * 10_000, kind="stable")
    ids = [int(i) for i in np.resize(order, rows)]
    return Batch(Cell(rows, length).key, ids, encode(tokenizer, [texts[i] for i in ids], input_names, pad_to=length,
                                                   prompt_tokens=prompt_tokens))


def cell_feeds(tokenizer: Tokenizer, input_names: tuple[str, ...], texts: list[str],
               cells: Sequence[tuple[int, int]]) -> dict[str, dict[str, np.ndarray]]:
    """Real text filling each (rows, length) cell exactly (`shaped_batch`), by cell name `b1 s16`."""
    lengths = token_lengths(tokenizer, texts)
    return {Cell(rows, length).label: shaped_batch(tokenizer, input_names, texts, lengths, rows, length).feed
            for rows, length in cells}


def corpus_batches(tokenizer: Tokenizer, input_names: tuple[str, ...], texts: Sequence[Text], batch_size: int, cut: int,
                   prompt_tokens: int = 0, ids: Sequence[int] | None = None) -> list[Batch]:
    """Every text once (or those of `ids`), batched by length (shortest first, as a server groups them: little
    padding, and each text's batch holds texts like it), right-padded to the longest in each batch; longer texts are
    cut at `cut` tokens."""
    chosen = list(range(len(texts)) if ids is None else ids)
    if not chosen:
        return []
    lengths = token_lengths(tokenizer, [texts[i] for i in chosen])
    chosen = [chosen[i] for i in np.argsort(np.minimum(lengths, cut), kind="stable")]
    batches = []
    for start in range(0, len(chosen), batch_size):
        part = chosen[start:start + batch_size]
        feed = encode(tokenizer, [texts[i] for i in part], input_names, max_length=cut, prompt_tokens=prompt_tokens)
        batches.append(Batch(f"corpus_{part[0]:04d}", part, feed))
    return batches


def grouped_batches(tokenizer: Tokenizer, input_names: tuple[str, ...], texts: Sequence[Text], cut: int,
                    grouping: Grouping, rows: int, prompt_tokens: int = 0,
                    requests: list[list[int]] | None = None) -> list[Batch]:
    """Every text once, in the groups of at most `rows` texts that `grouping` makes of their token counts (cut at
    `cut`): e.g. the served model's (`serving.plan.served_groups`); within each of `requests` where given (the ids
    of texts one request sends together and the server runs apart from others: a reranker's query and its
    documents), else across all the texts (a server batching requests together)."""
    lengths = np.minimum(token_lengths(tokenizer, texts), cut)
    groups = [[request[i] for i in group] for request in requests or [list(range(len(texts)))]
              for group in grouping([int(lengths[i]) for i in request], rows)]
    return [Batch(f"grouped_{group[0]:04d}", group, encode(tokenizer, [texts[i] for i in group], input_names,
                                                           max_length=cut, prompt_tokens=prompt_tokens))
            for group in groups if group]


def long_texts(tokenizer: Tokenizer, texts: Sequence[str], targets: Sequence[int]) -> tuple[str, ...]:
    """One text per target token count: consecutive corpus texts joined by spaces until the joined text holds at
    least that many tokens (the corpus read round again if needed), for checks past a length cut."""
    found = []
    lengths = token_lengths(tokenizer, list(texts))
    for number, target in enumerate(targets):
        parts, total, index = [], 0, number * 7 % len(texts)
        while total < target:
            parts.append(texts[index])
            total += int(lengths[index])
            index = (index + 1) % len(texts)
            if total >= target:  # the joined text has fewer special tokens than its parts together
                total = int(token_lengths(tokenizer, [" ".join(parts)])[0])
        found.append(" ".join(parts))
    return tuple(found)

"""Accuracy the way reranker users feel it: does the variant order each query's documents as the reference does?
The lab's pairs come from the corpus: a query with its nearest texts and some far ones."""
from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from workbench.models.text import Text

QUERIES, DOCUMENTS, NEIGHBOURS = 16, 8, 5
TIED = 1e-6  # reference scores closer than this, relative to the top score, are tied: summing in another order moves
# float32 scores by about that much, so either document is the reference's top


def _word_vectors(texts: Sequence[str]) -> np.ndarray:
    """Unit TF-IDF rows over the texts' lowercase words."""
    words = [re.findall(r"\w+", text.lower()) for text in texts]
    vocabulary = {word: i for i, word in enumerate(sorted({w for row in words for w in row}))}
    counts = np.zeros((len(texts), max(len(vocabulary), 1)))
    for row, found in zip(counts, words):
        for word in found:
            row[vocabulary[word]] += 1
    weighted = counts * np.log((1 + len(texts)) / (1 + np.count_nonzero(counts, axis=0)))
    return weighted / np.maximum(np.linalg.norm(weighted, axis=1, keepdims=True), 1e-12)


def lab_pairs(texts: Sequence[str], queries: int = QUERIES, documents: int = DOCUMENTS
              ) -> tuple[tuple[str, str], ...]:
    """(query, document) pairs: `queries` texts spread evenly over the corpus, each followed by its NEIGHBOURS
    nearest other texts by shared words (TF-IDF cosine) and, up to `documents`, texts spread over the far half."""
    count = len(texts)
    chosen = sorted({int(i) for i in np.linspace(0, count - 1, min(queries, count))})
    similar = _word_vectors(texts) @ _word_vectors(texts).T
    pairs = []
    for query in chosen:
        order = [int(i) for i in np.argsort(-similar[query], kind="stable") if i != query]
        near = order[:NEIGHBOURS]
        far_half = order[len(order) // 2:]
        far = [far_half[int(i)] for i in np.linspace(0, len(far_half) - 1, max(documents - len(near), 0))
               ] if far_half else []
        pairs += [(texts[query], texts[doc]) for doc in dict.fromkeys(near + far)]
    return tuple(pairs)


def by_query(texts: Sequence[Text]) -> list[list[int]]:
    """The ids of pairs that share a query, per query (none for single texts)."""
    groups: dict[str, list[int]] = {}
    for i, text in enumerate(texts):
        if isinstance(text, tuple):
            groups.setdefault(text[0], []).append(i)
    return list(groups.values())


def query_groups(texts: Sequence[Text]) -> list[list[int]]:
    """The ids of pairs that share a query, per query with more than one document (none for single texts)."""
    return [ids for ids in by_query(texts) if len(ids) > 1]


def same_top(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Per row (the last axis), whether `got`'s highest entry is `want`'s, or tied with it (`TIED`)."""
    picked = np.take_along_axis(want, np.argmax(got, axis=-1)[..., None], axis=-1)[..., 0]
    top = want.max(axis=-1)
    return picked >= top - TIED * np.maximum(1.0, np.abs(top))


def ranking_agreement(got: dict[int, float], want: dict[int, float], groups: Sequence[Sequence[int]]
                      ) -> dict[str, float] | None:
    """Per query (a group of pair ids), the variant's order of the documents it was given (two or more) against the
    reference's: `agreement_at_1`, the share of queries whose top document is the reference's top, or tied with it
    (`TIED`); `kendall_tau`, the mean Kendall tau (tau-b) of the two orders, and its minimum. None where no query had
    two documents."""
    from scipy.stats import kendalltau

    seen = [kept for ids in groups if len(kept := [i for i in ids if i in got]) > 1]
    if not seen:
        return None
    taus, tops = [], []
    for ids in seen:
        g, w = np.array([got[i] for i in ids]), np.array([want[i] for i in ids])
        tau = kendalltau(g, w).statistic
        taus.append(1.0 if np.isnan(tau) and np.ptp(g) == np.ptp(w) == 0 else float(np.nan_to_num(tau, nan=-1.0)))
        tops.append(bool(same_top(g, w)))
    return {"queries": len(seen), "agreement_at_1": float(np.mean(tops)), "kendall_tau": float(np.mean(taus)),
            "min_kendall_tau": float(np.min(taus))}

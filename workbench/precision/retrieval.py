"""Accuracy the way embedding users feel it: does the variant find the same neighbours as PyTorch?"""
from __future__ import annotations

import numpy as np

TOP_K = 10


def _unit(vectors: np.ndarray) -> np.ndarray:
    vectors = np.nan_to_num(vectors.astype(np.float64))
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


def _ranks(values: np.ndarray) -> np.ndarray:
    ranks = np.empty(values.size)
    ranks[np.argsort(values, kind="stable")] = np.arange(values.size)
    return ranks


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Rank correlation of two equally long series (ties broken by position)."""
    return float(np.corrcoef(_ranks(np.asarray(a, dtype=float)), _ranks(np.asarray(b, dtype=float)))[0, 1])


def retrieval_agreement(got: np.ndarray, want: np.ndarray, k: int = TOP_K) -> dict[str, float] | None:
    """Over a corpus of embeddings (one row per text, same order in both):

    - agreement_at_1: share of texts whose nearest other text (cosine) is the same under the variant as under PyTorch;
    - recall_at_<k>: mean share of PyTorch's k nearest neighbours the variant also ranks in its k nearest;
    - spearman: rank correlation of all pairwise similarities.
    None when the corpus has no more than k texts.
    """
    count = want.shape[0]
    if count <= k:
        return None
    sims_got, sims_want = _unit(got) @ _unit(got).T, _unit(want) @ _unit(want).T
    np.fill_diagonal(sims_got, -np.inf)
    np.fill_diagonal(sims_want, -np.inf)
    top_got = np.argsort(-sims_got, axis=1, kind="stable")[:, :k]
    top_want = np.argsort(-sims_want, axis=1, kind="stable")[:, :k]
    overlap = [len(set(a) & set(b)) / k for a, b in zip(top_got, top_want)]
    upper = np.triu_indices(count, 1)
    return {"texts": count, "agreement_at_1": float(np.mean(top_got[:, 0] == top_want[:, 0])),
            f"recall_at_{k}": float(np.mean(overlap)), "spearman": spearman(sims_got[upper], sims_want[upper])}

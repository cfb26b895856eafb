"""Agreement the way sparse-embedding (SPLADE) users feel it: the same vocabulary terms active, the heaviest of them
the same, and documents scored alike by the dot product their search engine computes."""
from __future__ import annotations

import numpy as np

TOP_TERMS = 20  # the heaviest terms of a text compared (a query's SPLADE vector has tens of active terms)

Terms = tuple[np.ndarray, np.ndarray]  # a text's active vocabulary ids and their weights


def terms(vector: np.ndarray) -> Terms:
    """The active (non-zero) vocabulary ids of one vector and their weights."""
    ids = np.flatnonzero(vector)
    return ids, vector[ids].astype(np.float64)


def _top(found: Terms, k: int) -> set[int]:
    ids, weights = found
    return set(ids[np.argsort(-weights, kind="stable")[:k]].tolist())


def _matrix(rows: list[Terms], width: int) -> object:
    from scipy.sparse import csr_matrix

    lengths = [len(ids) for ids, _ in rows]
    pointers = np.concatenate([[0], np.cumsum(lengths)])
    ids = np.concatenate([ids for ids, _ in rows]) if rows else np.zeros(0, dtype=np.int64)
    weights = np.concatenate([w for _, w in rows]) if rows else np.zeros(0)
    return csr_matrix((weights, ids, pointers), shape=(len(rows), width))


def sparse_agreement(got: dict[int, Terms], want: dict[int, Terms], width: int,
                     k: int = TOP_TERMS) -> dict[str, float | int]:
    """Over the texts both hold (same ids):

    - top_k_overlap: the smallest share, over texts, of the reference's `k` heaviest terms among the variant's `k`
      heaviest (a text with fewer active terms compares those it has);
    - active_overlap: mean Jaccard overlap of the active term sets;
    - dot_rel_error: the largest difference of a pair's dot product (every pair of texts, each with itself too: a
      query scoring a document) from the reference's, relative to the largest reference dot product.
    """
    ids = sorted(set(got) & set(want))
    overlaps, jaccards = [], []
    for text in ids:
        wanted = min(k, len(want[text][0]))
        if wanted:
            overlaps.append(len(_top(got[text], wanted) & _top(want[text], wanted)) / wanted)
        union = set(got[text][0].tolist()) | set(want[text][0].tolist())
        jaccards.append(len(set(got[text][0].tolist()) & set(want[text][0].tolist())) / len(union) if union else 1.0)
    a, b = _matrix([got[t] for t in ids], width), _matrix([want[t] for t in ids], width)
    dots_got, dots_want = (a @ a.T).toarray(), (b @ b.T).toarray()  # type: ignore[attr-defined]
    scale = float(np.abs(dots_want).max(initial=0.0))
    error = float(np.abs(dots_got - dots_want).max(initial=0.0)) / scale if scale else 0.0
    return {"texts": len(ids), "top_k": k, "top_k_overlap": float(min(overlaps, default=1.0)),
            "active_overlap": float(np.mean(jaccards)) if jaccards else 1.0, "dot_rel_error": error,
            "mean_active_terms": float(np.mean([len(want[t][0]) for t in ids])) if ids else 0.0}

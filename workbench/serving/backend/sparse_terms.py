"""A sparse embedding's active terms, as a sparse encoder's users index them: each text's non-zero vocabulary ids
and their weights, heaviest first, padded to the request's most active text with id -1 and weight 0. Copied beside
the Python models that serve sparse encoders."""
import numpy as np


def active_terms(rows):
    """INT64 ids and FP32 weights [texts, most active terms] of dense [texts, vocabulary] rows."""
    width = max(int(np.count_nonzero(rows, axis=1).max(initial=0)), 1)
    ids = np.full((rows.shape[0], width), -1, dtype=np.int64)
    weights = np.zeros((rows.shape[0], width), dtype=np.float32)
    for index, row in enumerate(rows):
        active = np.flatnonzero(row)
        active = active[np.argsort(-row[active], kind="stable")]
        ids[index, :len(active)], weights[index, :len(active)] = active, row[active]
    return ids, weights


def dense_rows(ids, weights, vocabulary):
    """The dense [texts, vocabulary] rows `active_terms` was given back (padding ids, -1, skipped)."""
    rows = np.zeros((ids.shape[0], vocabulary), dtype=np.float32)
    for row, found, values in zip(rows, ids, weights):
        kept = found >= 0
        row[found[kept]] = values[kept]
    return rows

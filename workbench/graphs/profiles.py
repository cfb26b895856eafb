"""TensorRT shape profiles designed from token-length data: K length buckets that minimise padding."""
from __future__ import annotations

import numpy as np

from workbench.core.config import ShapeRange
from workbench.graphs.tables import ShapeProfile
from workbench.models.batches import within

ALIGN = 8  # TensorRT kernels favour sequence lengths that are multiples of 8


def _round_up(value: int, align: int = ALIGN) -> int:
    return -(-value // align) * align


def bucket_edges(lengths: np.ndarray, buckets: int) -> list[int]:
    """Upper edges of at most `buckets` length ranges minimising the tokens padded when each text is padded to its
    bucket's upper edge (exact dynamic programme over the distinct lengths)."""
    values, counts = np.unique(np.asarray(lengths, dtype=np.int64), return_counts=True)
    n = len(values)
    k = min(buckets, n)
    weight = np.concatenate([[0], np.cumsum(counts)])
    mass = np.concatenate([[0], np.cumsum(counts * values)])

    def cost(i: int, j: int) -> float:  # texts with values[i..j] padded to values[j]
        return float((weight[j + 1] - weight[i]) * values[j] - (mass[j + 1] - mass[i]))

    best = np.full((k + 1, n), np.inf)
    split = np.zeros((k + 1, n), dtype=np.int64)
    for j in range(n):
        best[1, j] = cost(0, j)
    for b in range(2, k + 1):
        for j in range(b - 1, n):
            options = [best[b - 1, i - 1] + cost(i, j) for i in range(b - 1, j + 1)]
            pick = int(np.argmin(options))
            best[b, j], split[b, j] = options[pick], pick + b - 1
    edges, j = [], n - 1
    for b in range(k, 0, -1):
        edges.append(int(values[j]))
        j = int(split[b, j]) - 1 if b > 1 else j
    return sorted(edges)


def padded_batches(lengths: np.ndarray, rows: int) -> np.ndarray:
    """Padded length of each batch of `rows` consecutive texts (padding to the longest, as tokenizers do)."""
    lengths = np.asarray(lengths)
    return np.array([lengths[i:i + rows].max() for i in range(0, len(lengths), rows)])


def design_profiles(lengths: np.ndarray, buckets: int, batch: ShapeRange, sequence: ShapeRange,
                    max_tokens: int | None = None) -> list[ShapeProfile]:
    """Profiles covering sequence.min..sequence.max whose inner edges follow the data.

    Lengths are clipped to the served range first (longer texts are truncated). Each bucket's opt is the median padded
    length of batches of `batch.opt` texts from that bucket, rounded up to a multiple of 8. A profile's batch opt and
    max hold at most `max_tokens` padded tokens at its opt and max lengths (one text at least: `batches.within`).
    """
    top = sequence.max
    clipped = np.clip(np.asarray(lengths), sequence.min, top)
    edges = bucket_edges(clipped, buckets)
    edges = [min(_round_up(e), top) for e in edges[:-1]] + [top]
    edges = sorted(set(edges))
    profiles, low = [], sequence.min
    for high in edges:
        inside = clipped[(clipped >= low) & (clipped <= high)]
        typical = int(np.median(padded_batches(inside, batch.opt))) if inside.size else high
        opt = min(max(_round_up(typical), low), high)
        rows = within(batch.max, high, max_tokens)
        profiles.append(ShapeProfile(batch=[min(batch.min, rows), min(within(batch.opt, opt, max_tokens), rows), rows],
                                     sequence=[low, opt, high]))
        low = high + 1
    return profiles


def profile_for(profiles: list[ShapeProfile], rows: int, length: int) -> int | None:
    """Index of the first profile that takes a (rows, length) input, or None."""
    return next((i for i, p in enumerate(profiles) if p.fits(rows, length)), None)


def padding_waste(lengths: np.ndarray, profiles: list[ShapeProfile], rows: int) -> dict[str, float]:
    """Share of padded token slots when texts go to their profile and are batched `rows` at a time in arrival order.

    `dynamic`: each batch padded to its longest text (what the server does); `to_profile_max`: every text padded to
    its profile's max sequence (an engine built for one static shape per profile).
    """
    lengths = np.clip(np.asarray(lengths), profiles[0].sequence[0], profiles[-1].sequence[2])
    slots_dynamic = slots_static = 0
    for profile in profiles:
        low, _, high = profile.sequence
        inside = lengths[(lengths >= low) & (lengths <= high)]
        slots_dynamic += int(sum(padded_batches(inside, rows).astype(np.int64) *
                                 [min(rows, len(inside) - i) for i in range(0, len(inside), rows)]))
        slots_static += int(inside.size * high)
    real = int(lengths.sum())
    return {"dynamic": 1 - real / slots_dynamic if slots_dynamic else 0.0,
            "to_profile_max": 1 - real / slots_static if slots_static else 0.0}

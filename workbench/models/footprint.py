"""What a step that holds a model needs at its peak, estimated from the model's weights before anything runs
(preflight refuses a run the memory limit cannot hold; a batch's token budget keeps to what the limit leaves), and
giving back what it freed (`release_memory`)."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal

from workbench.core import memory
from workbench.core.config import BatchRange

# What a step that holds the model peaks at, its whole process tree: WEIGHT_MULTIPLE x the fp32 weights +
# LIBRARY_BYTES (torch, ONNX Runtime, a kernel) + its batches' activations, ACTIVATION_MULTIPLE x the weights up to
# ACTIVATION_BYTES (batch.max_tokens bounds them); measured with defaults on 2 cores: all-mpnet-base-v2 2.74 GB of
# 2.92, all-MiniLM-L6-v2 1.45 GB of 1.82, a tiny BERT (0.16 MB) 0.81 GB (its bench) of 0.88 (docs/bench.md).
WEIGHT_MULTIPLE = 3
LIBRARY_BYTES = 7 * 2**27
ACTIVATION_MULTIPLE = 8
ACTIVATION_BYTES = 3 * 2**28


@dataclass(frozen=True)
class StepMemory:
    """What one step needs at its peak, in bytes, and how that is made up (`3 x the model's 0.16 MB of weights
    ...`)."""

    step: str
    need: int
    how: str


@dataclass(frozen=True)
class MemoryEstimate:
    """Preflight's memory estimate for a run: each step's need at its peak (MB), the limit and where it comes from,
    what the largest is made of, and what preflight did (`fits`, `refused`, or `warned`: over, gone on as asked)."""

    steps: dict[str, float]
    need_mb: float
    limit_mb: float
    source: str
    how: str
    verdict: Literal["fits", "refused", "warned"]

    @classmethod
    def of(cls, needs: list[StepMemory], limit: int, source: str, warn: bool) -> MemoryEstimate:
        """The estimate for `needs` under `limit`: the steps over it (else the largest) named in its description."""
        peak = max(n.need for n in needs)
        over = [n for n in needs if n.need > limit]
        named = over or [n for n in needs if n.need == peak]
        groups = {made: [n for n in named if n.how == made] for made in dict.fromkeys(n.how for n in named)}
        how = "; ".join(f"{', '.join(n.step for n in group)} need{'s' if len(group) == 1 else ''} about "
                        f"{max(n.need for n in group) / 2**20:.0f} MB at {'its' if len(group) == 1 else 'their'} "
                        f"peak ({made})" for made, group in groups.items())
        return cls({n.step: round(n.need / 2**20, 1) for n in needs}, round(peak / 2**20, 1), round(limit / 2**20, 1),
                   source, how, "fits" if not over else "warned" if warn else "refused")

    def describe(self) -> str:
        within = "within" if self.verdict == "fits" else "more than"
        return f"{self.how}, {within} {self.source}: {self.limit_mb:.0f} MB"


def model_step(step: str, weights: int) -> StepMemory:
    """A step holding the run's model of `weights` fp32 bytes."""
    return StepMemory(step, step_need(weights), f"{WEIGHT_MULTIPLE} x the model's {weights / 2**20:.3g} MB of weights "
                                                f"+ {LIBRARY_BYTES / 2**30:g} GB of libraries + activations")


def step_need(weights: int) -> int:
    """About the most a step that holds a model of `weights` fp32 bytes needs at once (its process tree)."""
    return WEIGHT_MULTIPLE * weights + LIBRARY_BYTES + min(ACTIVATION_MULTIPLE * weights, ACTIVATION_BYTES)


def activation_room(weights: int) -> int:
    """The bytes the memory limit leaves past what a step holding a model of `weights` fp32 bytes needs without its
    batches' activations (`step_need`); negative where it does not fit at all (preflight refuses that)."""
    return memory.memory_limit()[0] - step_need(weights)


# The activations one batch may hold when batch.max_tokens is auto. A token costs about ACTIVATION_FACTOR x 4 bytes
# x (heads x sequence.max + intermediate + hidden) at a layer's peak (the attention scores and the feed-forward
# activations live together): measured with ONNX Runtime on all-mpnet-base-v2 (unfused attention), 32 x 384 tokens,
# 2.1 GB over the session's weights, about 4 such vectors a token. OpenVINO holds more for the same batch (its
# compiled all-mpnet-base-v2: 0.47 GB more at 10 x 384 tokens, 0.3 GB at 5 x 384). A quarter GiB keeps a base-size
# model's parity step within 3 x its weights + 1.5 GB (all-mpnet-base-v2: 5 texts of 384 tokens a batch;
# all-MiniLM-L6-v2 13 of 256).
BATCH_ACTIVATION_BYTES = 2**28
ACTIVATION_FACTOR = 4
ROOM_SHARE = 4  # where memory is short: the share of what is left past the model's need that activations may take


def token_budget(batch: BatchRange, per_token: int, sequence_max: int, room: int | None = None) -> tuple[int, str]:
    """The padded tokens one of `batch`'s batches may hold, and where the number comes from: the setting, or (auto)
    BATCH_ACTIVATION_BYTES, or a quarter of `room` (the bytes the memory limit leaves past the step's weights and
    libraries, `activation_room`) where that is less, over `per_token` (a token's activation
    bytes at a layer's peak), never below one text at `sequence_max` nor above `max` texts of it."""
    if batch.max_tokens != "auto":
        return batch.max_tokens, "configured (batch.max_tokens)"
    activations = BATCH_ACTIVATION_BYTES if room is None else max(0, min(BATCH_ACTIVATION_BYTES, room // ROOM_SHARE))
    tokens = min(max(sequence_max, activations // per_token), batch.max * sequence_max)
    limited = "" if activations == BATCH_ACTIVATION_BYTES else (
        f" (1/{ROOM_SHARE} of the {room / 2**30:.2g} GiB the memory limit leaves past the model's need)")
    return tokens, (f"auto: about {activations / 2**30:.2g} GiB of activations{limited} at "
                    f"{per_token / 1024:.0f} KiB a token ({ACTIVATION_FACTOR} x 4 bytes x (heads x sequence.max + "
                    f"intermediate + hidden)), at least one text of sequence.max={sequence_max}, at most "
                    f"batch.max={batch.max} of them")


def activation_bytes_per_token(heads: int, hidden: int, intermediate: int, sequence_max: int) -> int:
    """About what one padded token costs in activations at a layer's peak (`ACTIVATION_FACTOR`)."""
    return ACTIVATION_FACTOR * 4 * (heads * sequence_max + intermediate + hidden)


def model_token_budget(batch: BatchRange, heads: int, hidden: int, intermediate: int, sequence_max: int,
                       weights: int | None) -> tuple[int, str]:
    """`token_budget` for a model of this shape at `sequence_max`, within what the memory limit leaves past a step
    holding its `weights` fp32 bytes (None: not known, the limit is not read)."""
    per_token = activation_bytes_per_token(heads, hidden, intermediate, sequence_max)
    return token_budget(batch, per_token, sequence_max, activation_room(weights) if weights else None)


def release_memory() -> None:
    """Give the memory freed since the last call back to the system (the garbage collector, then glibc's
    malloc_trim): after a step drops a large graph, its pages would otherwise stay with the process."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(libc).malloc_trim(0)
        except (OSError, AttributeError):
            pass  # not glibc: nothing to trim

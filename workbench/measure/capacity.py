"""Capacity on paper: how many replicas a target load needs, from what one replica of the deployment sustained in the
served bench with p99 under the limit, and the queue time per request its autoscaler keeps."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from workbench.core.config import BenchSettings, TritonSettings

MIN_QUEUE_TARGET_MS = 1.0  # below this the autoscaler would chase noise


@dataclass(frozen=True)
class Capacity:
    """Replicas for `target_rps` (one GPU per pod) and the autoscaler's queue-time target, each with its reason."""

    target_rps: float
    per_replica_rps: float | None  # the best served throughput with p99 under the limit; None: not measured
    concurrency: int | None  # the load level it was measured at (requests in flight)
    p99_ms: float | None
    p99_limit_ms: float
    measured_on: str
    min_replicas: int
    max_replicas: int
    queue_target_ms: float
    queue_reason: str
    unmeasured: str = ""  # why no served bench was there to size it, where none was

    @property
    def replicas_reason(self) -> str:
        if self.per_replica_rps is None:
            why = self.unmeasured or f"no served bench level kept p99 under {self.p99_limit_ms:g} ms"
            return f"not measured ({why}): one replica to start; run --steps triton,bench,deploy to size it"
        return (f"{self.target_rps:g} req/s / {self.per_replica_rps:.1f} req/s per replica (concurrency "
                f"{self.concurrency}, p99 {self.p99_ms:.1f} ms <= {self.p99_limit_ms:g} ms, measured on "
                f"{self.measured_on}) = {self.min_replicas}")

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "replicas_reason": self.replicas_reason}


def best_level(served: dict[str, Any], p99_limit_ms: float) -> tuple[int, dict[str, Any]] | None:
    """The deployed configuration's served level (batching on, text in) with the highest throughput whose p99
    stays under the limit and that answered every request."""
    levels = served.get("batching_on", {}).get("text", {})
    within = [(int(c), level) for c, level in levels.items() if level["p99"] <= p99_limit_ms and not level["errors"]]
    return max(within, key=lambda item: item[1]["throughput"], default=None)


def plan_capacity(triton: TritonSettings, bench: BenchSettings, served: dict[str, Any] | None, model: str,
                  max_queue_delay_us: int, measured_on: str, unmeasured: str = "") -> Capacity:
    """Replicas = ceil(target / per-replica throughput), at most `burst_factor` times that; the queue target is
    `triton.queue_target_ms`, else the network `model`'s queue time per request at that best level (at least the
    batcher's own delay and MIN_QUEUE_TARGET_MS). `unmeasured`: why there is no `served` sweep, where there is none."""
    best = best_level(served or {}, bench.p99_limit_ms)
    floor = max(MIN_QUEUE_TARGET_MS, max_queue_delay_us / 1000)
    if best is None:
        per_replica, concurrency, p99, minimum, measured_queue = None, None, None, 1, None
    else:
        concurrency, level = best
        per_replica, p99 = float(level["throughput"]), float(level["p99"])
        minimum = max(1, math.ceil(triton.target_rps / per_replica))
        measured_queue = level.get("server", {}).get(model, {}).get("queue")
    if triton.queue_target_ms is not None:
        queue, reason = triton.queue_target_ms, "set by triton.queue_target_ms"
    elif measured_queue is not None:
        queue = max(floor, float(measured_queue))
        reason = (f"{model}'s queue time per request at the best level within the p99 limit "
                  f"({measured_queue:.3f} ms), at least {floor:g} ms")
    else:
        queue, reason = floor, f"not measured: {floor:g} ms (the batcher's delay, at least {MIN_QUEUE_TARGET_MS:g} ms)"
    return Capacity(triton.target_rps, per_replica, concurrency, p99, bench.p99_limit_ms, measured_on, minimum,
                    max(minimum + 1, math.ceil(minimum * triton.burst_factor)), round(queue, 3), reason,
                    unmeasured)

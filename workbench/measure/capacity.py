"""Capacity on paper: how many replicas a target load needs, from what one replica of the deployment sustained in the
served bench with p99 under the limit, and the queue time per request its autoscaler keeps."""
from __future__ import annotations

import math

from workbench.core.metrics import Metrics
from workbench.measure.settings import BenchSettings
from workbench.measure.tables import ServedBenchmark, ServedLevel
from workbench.serving.settings import DeploySettings

MIN_QUEUE_TARGET_MS = 1.0  # below this the autoscaler would chase noise


class Capacity(Metrics):
    """Replicas for `target_rps` (one GPU per pod) and the autoscaler's queue-time target, each with its reason
    (run.json `metrics.deploy.capacity`)."""

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
    replicas_reason: str
    unmeasured: str = ""  # why no served bench was there to size it, where none was


def replicas_reason(target_rps: float, best: tuple[int, ServedLevel] | None, p99_limit_ms: float, measured_on: str,
                    minimum: int, unmeasured: str) -> str:
    """Why that many replicas: the target over what one sustained (`best`: its concurrency and level), or why
    nothing was measured."""
    if best is None:
        why = unmeasured or f"no served bench level kept p99 under {p99_limit_ms:g} ms"
        return f"not measured ({why}): one replica to start, whatever deploy.target_rps asks"
    concurrency, level = best
    return (f"{target_rps:g} req/s / {level.throughput:.1f} req/s per replica (concurrency {concurrency}, p99 "
            f"{level.p99:.1f} ms <= {p99_limit_ms:g} ms, measured on {measured_on}) = {minimum}")


def plan_capacity(deploy: DeploySettings, bench: BenchSettings, served: ServedBenchmark | None, model: str,
                  max_queue_delay_us: int, measured_on: str, unmeasured: str = "") -> Capacity:
    """Replicas = ceil(target / per-replica throughput), at most `burst_factor` times that; the queue target is
    `deploy.queue_target_ms`, else the network `model`'s queue time per request at that best level (at least the
    batcher's own delay and MIN_QUEUE_TARGET_MS). `unmeasured`: why there is no `served` sweep, where there is none."""
    best = served.best_level(bench.p99_limit_ms) if served else None
    floor = max(MIN_QUEUE_TARGET_MS, max_queue_delay_us / 1000)
    if best is None:
        per_replica, concurrency, p99, minimum, measured_queue = None, None, None, 1, None
    else:
        concurrency, level = best
        per_replica, p99 = level.throughput, level.p99
        minimum = max(1, math.ceil(deploy.target_rps / per_replica))
        measured_queue = level.server.get(model, {}).get("queue")
    if deploy.queue_target_ms is not None:
        queue, reason = deploy.queue_target_ms, "set by deploy.queue_target_ms"
    elif measured_queue is not None:
        queue = max(floor, measured_queue)
        reason = (f"{model}'s queue time per request at the best level within the p99 limit "
                  f"({measured_queue:.3f} ms), at least {floor:g} ms")
    else:
        queue, reason = floor, f"not measured: {floor:g} ms (the batcher's delay, at least {MIN_QUEUE_TARGET_MS:g} ms)"
    why = replicas_reason(deploy.target_rps, best, bench.p99_limit_ms, measured_on, minimum, unmeasured)
    return Capacity(target_rps=deploy.target_rps, per_replica_rps=per_replica, concurrency=concurrency, p99_ms=p99,
                    p99_limit_ms=bench.p99_limit_ms, measured_on=measured_on, min_replicas=minimum,
                    max_replicas=max(minimum + 1, math.ceil(minimum * deploy.burst_factor)),
                    queue_target_ms=round(queue, 3), queue_reason=reason, replicas_reason=why, unmeasured=unmeasured)

"""ONNX Runtime session settings as part of a variant, chosen by measurement.

At batch 1 and a short sequence a call is per-op overhead more than arithmetic, and the settings that shape that
overhead (threads, the graph optimization level applied at load, the execution mode, whether idle threads spin) are
measured per variant on one real batch, in rotating blocks, and the fastest median wins. Only speed follows this
measurement: verdicts never read it, and the defaults stand when no candidate is at least `MIN_GAIN` faster.

Spinning is measured and reported but never chosen: a spinning session keeps its threads busy after each call and
takes the cores from everything else on the host (PyTorch ran 2x slower beside one, even 10 ms after its calls),
so it would distort every side-by-side measurement and starve a served tokenizer.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

OPTIMIZATION_LEVELS = ("all", "extended", "basic")
EXECUTION_MODES = ("sequential", "parallel")
MIN_GAIN = 1.05  # a candidate must beat the default by 5% (median over median) to replace it


@dataclass(frozen=True)
class SessionSettings:
    """How ONNX Runtime runs a variant's session. The default: idle threads sleep, every graph optimization,
    sequential execution."""

    threads: int | None = None  # intra-op threads; None: ONNX Runtime's default (all cores)
    spinning: bool = False
    optimization: str = "all"
    execution: str = "sequential"

    def apply(self, options: Any) -> None:
        """Set these on an `onnxruntime.SessionOptions`."""
        import onnxruntime

        # Idle worker threads spinning for work steal the CPU from whatever runs next (another session, PyTorch, a
        # tokenizer process); on a few cores that distorts every interleaved measurement, so they sleep by default.
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.spinning else "0")
        if self.threads:
            options.intra_op_num_threads = self.threads
            options.inter_op_num_threads = 1
        levels = {"all": onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL,
                  "extended": onnxruntime.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                  "basic": onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC}
        options.graph_optimization_level = levels[self.optimization]
        options.execution_mode = (onnxruntime.ExecutionMode.ORT_PARALLEL if self.execution == "parallel"
                                  else onnxruntime.ExecutionMode.ORT_SEQUENTIAL)

    def label(self) -> str:
        return (f"{self.threads or 'default'} threads, spinning {'on' if self.spinning else 'off'}, "
                f"{self.optimization} optimizations, {self.execution}")

    def record(self) -> dict[str, Any]:
        return asdict(self)


def candidates(threads: int) -> list[SessionSettings]:
    """The default with `threads` first, then every combination of fewer threads, spinning, optimization level and
    execution mode."""
    default = SessionSettings(threads)
    grid = [SessionSettings(t, spin, level, mode)
            for t, spin, level, mode in itertools.product(sorted({1, threads}, reverse=True), (False, True),
                                                          OPTIMIZATION_LEVELS, EXECUTION_MODES)]
    return [default, *(s for s in grid if s != default)]


def measure(calls: dict[SessionSettings, Callable[[], object]], rounds: int, block: int) -> dict[SessionSettings,
                                                                                                  list[float]]:
    """Seconds per call for each candidate, in `rounds` rounds of `block` calls per candidate (the order rotates
    every round). The first call of each block is not counted: it pays for the previous candidate's threads."""
    order = list(calls)
    samples: dict[SessionSettings, list[float]] = {s: [] for s in order}
    for index in range(rounds):
        for settings in order[index % len(order):] + order[:index % len(order)]:
            call = calls[settings]
            call()
            for _ in range(block - 1):
                start = time.perf_counter()
                call()
                samples[settings].append(time.perf_counter() - start)
    return samples


def choose(medians_ms: dict[SessionSettings, float], default: SessionSettings) -> tuple[SessionSettings, str]:
    """The fastest candidate that does not spin when it beats `default` by `MIN_GAIN`, else `default`; and why."""
    fastest = min((s for s in medians_ms if not s.spinning), key=lambda s: (medians_ms[s], s != default))
    gain = medians_ms[default] / medians_ms[fastest]
    if fastest == default or gain < MIN_GAIN:
        return default, f"no setting beat the default by {MIN_GAIN:.2f}x (best {gain:.2f}x)"
    return fastest, f"{gain:.2f}x faster than the default ({fastest.label()})"


def tune(make_session: Callable[[SessionSettings], Any], feed: dict[str, np.ndarray], threads: int,
         rounds: int = 5, block: int = 8) -> dict[str, Any]:
    """Measure every candidate on `feed`; the chosen settings, why, and each candidate's median in ms."""
    options = candidates(threads)
    sessions = {s: make_session(s) for s in options}
    calls = {s: (lambda session=session: session.run(None, feed)) for s, session in sessions.items()}
    samples = measure(calls, rounds, block)
    medians = {s: float(np.median(v)) * 1e3 for s, v in samples.items()}
    chosen, reason = choose(medians, options[0])
    spinning = min((s for s in options if s.spinning), key=medians.__getitem__)
    return {"chosen": chosen.record(), "reason": reason, "default_ms": round(medians[options[0]], 4),
            "chosen_ms": round(medians[chosen], 4),
            "spinning_gain": round(medians[options[0]] / medians[spinning], 3),  # measured, never applied
            "candidates": [{**s.record(), "p50_ms": round(medians[s], 4)} for s in options]}

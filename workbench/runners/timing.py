"""Wall-clock timing, one module for every measurement: a stopwatch, interleaved rounds that rotate their order (so a
slow spell of a shared machine hits every candidate alike), the median of repeated calls, and how many cores other
work kept busy meanwhile."""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Hashable
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """`fn`'s result and the seconds it took."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def elapsed(fn: Callable[[], object]) -> float:
    """The seconds one call of `fn` takes."""
    return timed(fn)[1]


def interleaved(calls: dict[K, Callable[[], object]], rounds: int, warmup: int = 0, block: int = 1,
                budget_s: float | None = None, min_rounds: int = 5) -> dict[K, list[float]]:
    """Seconds per call for each callable, after `warmup` calls each, in rounds whose order rotates every round.
    With `block` > 1 each callable runs that many times in a row per round and the first is not counted (its
    caches are the previous callable's). Stops after `budget_s` seconds of rounds (at least `min_rounds`)."""
    names = list(calls)
    for name in names:
        for _ in range(warmup):
            calls[name]()
    samples: dict[K, list[float]] = {name: [] for name in names}
    start = time.perf_counter()
    for index in range(rounds):
        for name in names[index % len(names):] + names[:index % len(names)]:
            if block > 1:
                calls[name]()
            samples[name] += [elapsed(calls[name]) for _ in range(max(1, block - 1))]
        if budget_s is not None and index + 1 >= min_rounds and time.perf_counter() - start > budget_s:
            break
    return samples


def cell_medians_ms(calls_for: Callable[[str], dict[K, Callable[[], object]]], cells: list[str], rounds: int,
                    warmup: int = 1, block: int = 4, budget_s: float | None = None,
                    min_rounds: int = 5) -> dict[K, dict[str, float]]:
    """Median ms of one call per key and cell: for each cell, the callables `calls_for(cell)` gives, interleaved
    (`interleaved`, each cell's rounds bounded by `budget_s`, at least `min_rounds`); rounded to 0.1 us."""
    found: dict[K, dict[str, float]] = {}
    for cell in cells:
        for key, samples in interleaved(calls_for(cell), rounds, warmup=warmup, block=block, budget_s=budget_s,
                                        min_rounds=min_rounds).items():
            found.setdefault(key, {})[cell] = round(statistics.median(samples) * 1e3, 4)
    return found


def median_ms(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """The median of `repeats` calls, in milliseconds, after `warmup` calls."""
    return statistics.median(interleaved({0: fn}, repeats, warmup)[0]) * 1e3


class Budget:
    """Seconds a piece of work may take, from its creation: what is left, and whether it is spent."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.perf_counter()

    def used(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return max(0.0, self.seconds - self.used())

    @property
    def spent(self) -> bool:
        return self.used() >= self.seconds


def _busy_seconds() -> float | None:
    """CPU seconds all processes have spent busy since boot, from /proc/stat (None where there is none)."""
    try:
        with open("/proc/stat", encoding="utf-8") as handle:
            fields = handle.readline().split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class OthersBusy:
    """How many cores other processes kept busy while the `with` block ran (`cores`, set on leaving it): the cores
    busy in all, less this process's own CPU time, all its threads included. The 1-minute load average where
    /proc/stat is missing."""

    cores: float = 0.0
    _start: float | None
    _own: os.times_result
    _wall: float

    def __enter__(self) -> OthersBusy:
        self._start, self._own, self._wall = _busy_seconds(), os.times(), time.monotonic()
        return self

    def __exit__(self, *_: object) -> None:
        if self._start is None:
            self.cores = os.getloadavg()[0]
            return
        end, now = _busy_seconds() or self._start, os.times()
        own = (now.user + now.system) - (self._own.user + self._own.system)
        self.cores = max(0.0, (end - self._start - own) / max(time.monotonic() - self._wall, 1e-3))


def too_busy(others: float) -> str:
    """"other work kept X of N cores busy" where `others` (cores) is more than half this host's cores, else ""."""
    cores = os.cpu_count() or 1
    return f"other work kept {others:.1f} of {cores} cores busy" if others > cores / 2 else ""


def others_busy(seconds: float = 1.0) -> float:
    """How many cores other processes kept busy over the next `seconds`, this process idle meanwhile: unlike the
    load average, it does not count the work this process itself has just done."""
    with OthersBusy() as others:
        time.sleep(seconds)
    return others.cores

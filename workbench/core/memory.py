"""The memory a piece of work holds at its peak: this process and every process it started (a step's kernel, the
Triton server and its model stubs), sampled on a thread while the work runs."""
from __future__ import annotations

import threading
from types import TracebackType

import psutil

SAMPLE_S = 0.2


def tree_mb(root: psutil.Process) -> float:
    """Memory of `root` and its descendants now, in MB: each process's proportional set size (a page the processes
    share counted once in all), else its resident set where PSS cannot be read."""
    total = 0
    for process in (root, *root.children(recursive=True)):
        try:
            try:
                total += process.memory_full_info().pss
            except (psutil.AccessDenied, AttributeError):
                total += process.memory_info().rss
        except psutil.NoSuchProcess:
            continue  # ended between listing and reading
    return total / 2**20


class PeakMemory:
    """`with PeakMemory() as peak: ...`, then `peak.mb`: the most this process tree held while the block ran,
    sampled every SAMPLE_S (a spike shorter than that may be missed)."""

    def __init__(self) -> None:
        self.mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-memory", daemon=True)
        self._root = psutil.Process()

    def _sample(self) -> None:
        while True:
            self.mb = max(self.mb, tree_mb(self._root))
            if self._stop.wait(SAMPLE_S):
                return

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self.mb = max(self.mb, tree_mb(self._root))

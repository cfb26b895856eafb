"""The memory a piece of work holds at its peak: this process and every process it started (a step's kernel, the
Triton server and its model stubs), sampled from a process of its own while the work runs: a thread of the measured
process would wait for the interpreter lock through the very calls that peak (a session built, a graph parsed)."""
from __future__ import annotations

import subprocess
import sys
from types import TracebackType

import psutil

SAMPLE_S = 0.2


def tree_mb(root: psutil.Process, leave_out: int | None = None) -> float:
    """Memory of `root` and its descendants (but `leave_out`) now, in MB: each process's proportional set size (a
    page the processes share counted once in all), else its resident set where PSS cannot be read."""
    total = 0
    for process in (root, *root.children(recursive=True)):
        if process.pid == leave_out:
            continue
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
    sampled every SAMPLE_S by a child process (a spike shorter than that may be missed)."""

    def __init__(self) -> None:
        self.mb = 0.0
        self._sampler: subprocess.Popen[str] | None = None

    def __enter__(self) -> PeakMemory:
        self._sampler = subprocess.Popen([sys.executable, "-m", "workbench.core.memory", str(psutil.Process().pid)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._sampler is None:
            return
        reported, _ = self._sampler.communicate("")  # its stdin closes: it takes a last sample and answers
        self._sampler = None
        self.mb = float(reported.strip() or 0.0)


def sample(root_pid: int) -> None:
    """The sampler's side: the peak of `root_pid`'s tree (itself left out) until its stdin closes, then printed."""
    import select

    root, own = psutil.Process(root_pid), psutil.Process().pid
    peak = 0.0
    while True:
        try:
            peak = max(peak, tree_mb(root, leave_out=own))
        except psutil.NoSuchProcess:
            break
        if select.select([sys.stdin], [], [], SAMPLE_S)[0]:
            break
    print(f"{peak:.1f}", flush=True)


if __name__ == "__main__":
    sample(int(sys.argv[1]))

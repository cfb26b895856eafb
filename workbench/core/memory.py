"""The memory a piece of work holds at its peak: this process and every process it started (a step's kernel, the
Triton server and its model stubs), sampled from a process of its own while the work runs: a thread of the measured
process would wait for the interpreter lock through the very calls that peak (a session built, a graph parsed)."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from types import TracebackType

import psutil

SAMPLE_S = 0.2
CGROUP_V1 = Path("/sys/fs/cgroup/memory")
CGROUP_V2 = Path("/sys/fs/cgroup")
NO_LIMIT = 2**60  # cgroup v1 writes its "no limit" as a number near 2**63


def memory_limit() -> tuple[int, str]:
    """The bytes this process's tree may hold, and where that comes from: its memory cgroup's limit (v2
    `memory.max`, v1 `memory.limit_in_bytes`) where one is set below the machine's memory, else the machine's."""
    total = psutil.virtual_memory().total
    for path in (CGROUP_V2 / _own_cgroup("") / "memory.max", CGROUP_V1 / _own_cgroup("memory") /
                 "memory.limit_in_bytes", CGROUP_V1 / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < min(total, NO_LIMIT):
            return int(text), f"the memory cgroup's limit ({path})"
    return total, "the machine's memory"


def oom_kills() -> int:
    """Processes the kernel's out-of-memory killer has killed so far: the machine's count (/proc/vmstat) plus this
    process's memory cgroup's (v1 `memory.oom_control`, v2 `memory.events`), which can kill at its own limit."""
    count = 0
    own = CGROUP_V1 / _own_cgroup("memory") / "memory.oom_control"
    for path in dict.fromkeys((Path("/proc/vmstat"), own if own.is_file() else CGROUP_V1 / "memory.oom_control",
                               CGROUP_V2 / _own_cgroup("") / "memory.events")):
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        count += sum(int(line.split()[1]) for line in lines if line.startswith("oom_kill "))
    return count


def first_to_go(pid: int | None = None) -> None:
    """Make process `pid` (default: this one), and what it starts from now on, the out-of-memory killer's first
    choice: oom_score_adj 1000, which a user may raise for their own processes. A step's kernel or the Triton server
    then dies before the CLI that reports why (`OutOfMemoryError`); where /proc cannot be written, nothing changes."""
    try:
        Path(f"/proc/{pid or 'self'}/oom_score_adj").write_text("1000")
    except OSError:
        pass


def _own_cgroup(controller: str) -> str:
    """This process's cgroup path for `controller` ("" for cgroup v2's unified one), relative to the mount."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(",") or (not controller and not controllers):
            return path.lstrip("/")
    return ""


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
    try:
        print(f"{peak:.1f}", flush=True)
    except BrokenPipeError:  # the measured process is gone (killed): nobody to answer
        pass


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the measured process ends it
    sample(int(sys.argv[1]))

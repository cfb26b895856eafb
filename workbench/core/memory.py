"""The memory a piece of work holds at its peak: this process and every process it started (a step's kernel, the
Triton server and its model stubs), sampled from a process of its own while the work runs: a thread of the measured
process would wait for the interpreter lock through the very calls that peak (a session built, a graph parsed)."""
from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal

import psutil

SAMPLE_S = 0.2
CGROUP_V1 = Path("/sys/fs/cgroup/memory")
CGROUP_V2 = Path("/sys/fs/cgroup")
NO_LIMIT = 2**60  # cgroup v1 writes its "no limit" as a number near 2**63
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
    return memory_limit()[0] - step_need(weights)


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

"""`workbench node start`: `ray start` for a node that advertises its host kind (its CPU's int8/bf16 flags and GPUs,
or the kind it is told), so a sweep's cells of that kind are placed on it; stopped by its PID, with every process
of the node."""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from workbench.core.errors import DependencyMissingError
from workbench.core.machine import cpu_features, gpu_name
from workbench.serving.hostkinds import HostKind, host_kind, kind_of, node_resources

STOP_GRACE_S = 10.0
PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class NodeStart:
    """What `workbench node start` runs: the `ray start` command line and the kind it advertises."""

    kind: HostKind
    told: bool
    argv: list[str]
    resources: dict[str, float]


def ray_executable() -> str:
    found = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    if found is None:
        raise DependencyMissingError("Ray is not installed", "pip install -e '.[ray]' (make env installs it)")
    return found


def plan_start(address: str | None, port: int | None = None, kind: str | None = None, num_cpus: int | None = None,
               ip: str | None = None, temp_dir: str | None = None, object_store_mb: int | None = None) -> NodeStart:
    """The `ray start --block` of a head node (no `address`; `port` its GCS port) or of a node joining `address`,
    advertising `kind` (default: this machine's, from its CPU flags and GPU)."""
    features = cpu_features()
    chosen = host_kind(kind) if kind else kind_of(features, gpu_name())
    resources = node_resources(chosen, features)
    argv = [ray_executable(), "start", "--block", f"--resources={json.dumps(resources)}"]
    argv += [f"--node-ip-address={ip}"] if ip else []  # else Ray's choice: the address other hosts reach
    if address is None:
        argv += ["--head", f"--port={port or 6379}", "--include-dashboard=false"]
        argv += [f"--temp-dir={temp_dir}"] if temp_dir else []
    else:
        argv += [f"--address={address}"]
    argv += [f"--num-cpus={num_cpus}"] if num_cpus else []
    argv += [f"--object-store-memory={object_store_mb << 20}"] if object_store_mb else []
    return NodeStart(chosen, kind is not None, argv, resources)


def _prctl(option: int, value: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def die_with_parent() -> None:
    """For a child's preexec_fn: SIGTERM when the process that started it dies (a node lost mid-cell ends its run)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def run_node(start: NodeStart) -> int:
    """Run the node until this process is told to stop (SIGTERM, SIGINT): then every process of the node ends, its
    workers included (they are reparented here, not to init, when a raylet dies). The exit status of `ray start`."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    child = subprocess.Popen(start.argv, env=env)
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    while child.poll() is None and not stopping:
        time.sleep(0.2)
    stop_descendants()
    return child.returncode if child.returncode is not None else 0


def stop_descendants(grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to every process below this one, SIGKILL to those still there after `grace_s`."""
    found = psutil.Process().children(recursive=True)
    for process in found:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(found, timeout=grace_s)
    for process in alive + psutil.Process().children(recursive=True):
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(psutil.Process().children(recursive=True), timeout=grace_s)

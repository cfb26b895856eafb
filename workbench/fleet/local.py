"""A Ray cluster of several nodes on this machine, each told its host kind (`workbench node start --kind`): what the
tests, `benchmarks/fleet.py` and a first try of `workbench sweep --ray` run on. Ray listens on the host's address
(it does not keep to 127.0.0.1 on Linux), so the cluster takes only requests carrying its own random token; each
node is stopped by its PID with every process it started."""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import psutil

from workbench.fleet.errors import ClusterError
from workbench.serving.server import free_port

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0


class LocalCluster:
    """Nodes of `kinds` (the first is the head), each with `cpus` CPUs; `address` once started."""

    def __init__(self, kinds: list[str], cpus: int = 1, object_store_mb: int = 300) -> None:
        self.kinds, self.cpus, self.object_store_mb = kinds, cpus, object_store_mb
        self.folder = Path(tempfile.mkdtemp(prefix="wbray-", dir="/tmp"))  # Ray's socket paths must stay short
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[subprocess.Popen[bytes]] = []
        # Ray resolves 127.0.0.1 to the host's routable address and listens there: only holders of this token may
        # talk to the cluster (Ray's token authentication, read from the environment by its nodes and drivers)
        self.auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self._saved: dict[str, str | None] = {}

    def _start(self, kind: str, head: bool) -> subprocess.Popen[bytes]:
        where = ["--head", "--port", str(self.port), "--temp-dir", str(self.folder / "ray")] if head \
            else ["--address", self.address]
        argv = [sys.executable, "-m", "workbench", "node", "start", *where, "--kind", kind,
                "--num-cpus", str(self.cpus), "--object-store-mb", str(self.object_store_mb)]
        log = (self.folder / f"node-{len(self.nodes)}.log").open("wb")
        env = {**os.environ, **self.auth, "TMPDIR": str(self.folder)}  # cells' folders and kernels' files: in it
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def __enter__(self) -> LocalCluster:
        """The nodes started, and this process's environment holding the cluster's token (for the drivers it
        starts) until the cluster stops."""
        self._saved = {name: os.environ.get(name) for name in self.auth}
        os.environ.update(self.auth)
        try:
            for index, kind in enumerate(self.kinds):
                self.nodes.append(self._start(kind, head=index == 0))
                self.wait_for(index + 1)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()

    def alive(self) -> int:
        """Live nodes, as the cluster's GCS sees them (asked from a child process: this one stays no driver)."""
        probe = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
                 "print(sum(n['Alive'] for n in ray.nodes()))")
        done = subprocess.run([sys.executable, "-c", probe, self.address], capture_output=True, text=True,
                              timeout=120)
        return int(done.stdout.split()[-1]) if done.returncode == 0 and done.stdout.split() else 0

    def wait_for(self, count: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if any(node.poll() is not None for node in self.nodes):
                raise ClusterError(f"a node of the local cluster exited: see {self.folder}/node-*.log",
                                   "free its port, or read the log")
            if self.alive() >= count:
                return
            time.sleep(1.0)
        raise ClusterError(f"the local cluster has not {count} live nodes after {START_TIMEOUT_S:.0f} s",
                           f"read {self.folder}/node-*.log")

    def raylet(self, index: int) -> psutil.Process:
        """Node `index`'s raylet (killing it loses the node)."""
        for process in psutil.Process(self.nodes[index].pid).children(recursive=True):
            if process.name() == "raylet":
                return process
        raise ClusterError(f"node {index} has no raylet", "it has stopped")

    def node_id(self, index: int) -> str:
        """Ray's id of node `index`, from its raylet's command line."""
        for arg in self.raylet(index).cmdline():
            if arg.startswith("--node_id="):
                return arg.split("=", 1)[1]
        raise ClusterError(f"node {index}'s raylet names no node id", "Ray changed its command line")

    def stop(self) -> None:
        """Every node by its PID (its wrapper ends all its processes), then this cluster's folder."""
        for node in self.nodes:
            if node.poll() is None:
                node.send_signal(signal.SIGTERM)
        for node in self.nodes:
            try:
                node.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
        self.nodes.clear()
        shutil.rmtree(self.folder, ignore_errors=True)
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved = {}

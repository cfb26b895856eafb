"""One sweep cell on the node it was placed on: `workbench run` of the cell's configuration in a folder of the
node's own, with the node recorded in run.json, its lines posted to the sweep's board with the cell's name (the
folder named as the driver will hold it), and the finished folder packed to travel back. Cancelled (the board says
so after the driver's Ctrl-C) or orphaned (its node lost), the run is stopped with everything it started."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

import yaml

from workbench.core.machine import NODE_VARIABLE, cpu_features, gpu_name
from workbench.core.results import NodeInfo
from workbench.fleet.node import die_with_parent
from workbench.fleet.transfer import PackedRun, pack
from workbench.serving.hostkinds import kind_of

if TYPE_CHECKING:
    from ray.actor import ActorHandle

STOP_GRACE_S = 30.0  # the run's own cleanup (kernels, servers) gets this long after SIGTERM
TAIL_LINES = 20
POLL_S = 0.5  # how often the cell asks the board whether the sweep was cancelled


@dataclass(frozen=True)
class CellSpec:
    """What a node needs to measure a cell: its name (its folder's), host kind, run configuration, where the
    driver will put its folder (the lines name that one), and the sweep's board."""

    name: str
    kind: str
    settings: dict[str, object]  # RunConfig.to_params() without output_dir
    destination: str
    board: ActorHandle


@dataclass(frozen=True)
class CellOutcome:
    """What came back: the node, the run's wall seconds there, the packed folder (None: the run failed) and the
    last lines it printed."""

    name: str
    node: NodeInfo
    seconds: float
    packed: PackedRun | None
    tail: list[str]
    exit_code: int
    cancelled: bool = False


def this_node(kind: str) -> NodeInfo:
    """The Ray node this task runs on, advertising `kind` (told: not the kind its flags make it)."""
    import ray

    context = ray.get_runtime_context()
    try:
        own = kind_of(cpu_features(), gpu_name()).name
    except Exception:  # noqa: BLE001 - a CPU with no kind's flags: the kind it advertises was told
        own = None
    return NodeInfo(id=context.get_node_id(), address=ray.util.get_node_ip_address(), kind=kind, told=own != kind)


def _pump(stream: IO[str], cell: CellSpec, run_dir: Path, tail: list[str]) -> None:
    """Each line the run prints to the board with the cell's name, the node's folder named as the driver's (progress
    bars' redraws dropped), and the last ones kept."""
    for line in stream:
        text = line.rstrip("\n").replace(str(run_dir), cell.destination)
        if "\r" in text or not text.strip():
            continue
        _say(cell, text)
        tail.append(text)
        del tail[:-TAIL_LINES]


def _say(cell: CellSpec, text: str) -> None:
    cell.board.say.remote(f"{cell.name}: {text}")


def _cancelled(cell: CellSpec) -> bool:
    """Whether the driver has cancelled the sweep (a board out of reach: not cancelled, the driver is gone and Ray
    ends this task with it)."""
    import ray

    try:
        return bool(ray.get(cell.board.cancelled.remote(), timeout=POLL_S * 5))
    except ray.exceptions.RayError:
        return False


def _stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)  # `workbench run` interrupts its kernel and ends what it started
        try:
            process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def measure_cell(cell: CellSpec) -> CellOutcome:
    """Run the cell here and bring its folder back packed; the node's folder is removed either way."""
    node = this_node(cell.kind)
    _say(cell, f"on node {node.id[:12]} ({node.address}, {cell.kind})")
    work = Path(tempfile.mkdtemp(prefix="workbench-cell-"))
    try:
        run_dir = work / cell.name
        settings = work / "settings.yaml"
        settings.write_text(yaml.safe_dump(cell.settings, sort_keys=False), encoding="utf-8")
        env = {**os.environ, NODE_VARIABLE: node.model_dump_json(), "PYTHONUNBUFFERED": "1"}  # lines as they come
        started = time.perf_counter()
        process = subprocess.Popen(
            [sys.executable, "-m", "workbench", "run", "--config", str(settings), "--output-dir", str(run_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, preexec_fn=die_with_parent)
        tail: list[str] = []
        pump = threading.Thread(target=_pump, args=(process.stdout, cell, run_dir, tail), daemon=True)
        pump.start()
        cancelled = False
        try:
            while process.poll() is None and not cancelled:
                time.sleep(POLL_S)
                cancelled = _cancelled(cell)
        finally:
            _stop(process)
        pump.join(5)
        seconds = time.perf_counter() - started
        packed = pack(run_dir) if process.returncode == 0 and not cancelled else None
        return CellOutcome(cell.name, node, round(seconds, 3), packed, tail, process.returncode, cancelled)
    finally:
        shutil.rmtree(work, ignore_errors=True)

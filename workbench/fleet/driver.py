"""`workbench sweep --ray ADDRESS`: every run of a sweep once per host kind, each cell measured on a node of its
kind, one cell per node at a time (a node measures alone), its folder brought back whole into the output root.
A lost node's cell goes to another node of its kind, or fails naming the node; the other cells go on. Ctrl-C
cancels every cell and waits for their runs to stop."""
from __future__ import annotations

import json
import re
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from workbench.core.atomic import write_text
from workbench.core.errors import DependencyMissingError, RunInterruptedError, WorkbenchError
from workbench.core.record import RECORD_NAME, RunRecord
from workbench.fleet.board import Board
from workbench.fleet.cell import CellOutcome, CellSpec, measure_cell
from workbench.fleet.deployments import write_fleet
from workbench.fleet.errors import ClusterError, TransferError
from workbench.fleet.transfer import install
from workbench.serving.hostkinds import host_kind, kinds_offered
from workbench.sweep import PlannedRun, Sweep, pending_steps

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

STATUS_NAME = "sweep.json"  # in the output root: every cell's state, node and seconds
POLL_S = 1.0
CONNECT_TIMEOUT_S = 10.0
CANCEL_GRACE_S = 60.0  # cancelled cells' runs stop their kernels and servers within this


@dataclass
class Cell:
    """One run on one host kind, and what became of it."""

    name: str
    run: str
    kind: str
    run_dir: Path
    status: str = "pending"  # pending, running, done, failed
    node: str | None = None
    address: str | None = None
    attempts: int = 0
    seconds: float | None = None  # on the driver: from placing the cell to its folder in place
    run_seconds: float | None = None  # on the node: the run alone
    error: str | None = None
    lost_nodes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Node:
    id: str
    address: str
    kinds: tuple[str, ...]


def cell_name(run: str, kind: str) -> str:
    return f"{run}-{re.sub(r'[^a-z0-9]+', '-', kind)}"


def plan_cells(sweep: Sweep, kinds: list[str]) -> list[tuple[Cell, PlannedRun]]:
    """Each run once per kind, in the sweep's order, each in `<output root>/<run>-<kind>`."""
    for kind in kinds:
        host_kind(kind)
    planned = []
    for run in sweep.runs:
        for kind in kinds:
            name = cell_name(run.name, kind)
            planned.append((Cell(name, run.name, kind, run.run_dir.parent / name), run))
    return planned


def _ray() -> ModuleType:
    """The ray module (an extra: imported where a sweep uses it)."""
    try:
        import ray
    except ImportError:
        raise DependencyMissingError("Ray is not installed", "pip install -e '.[ray]' (make env installs it)"
                                     ) from None
    return ray


def live_nodes() -> list[Node]:
    ray = _ray()
    return [Node(n["NodeID"], n["NodeManagerAddress"], tuple(kinds_offered(n["Resources"])))
            for n in ray.nodes() if n["Alive"]]


@contextmanager
def connected(address: str) -> Iterator[None]:
    """Connected to the cluster at `address` as its driver."""
    ray = _ray()
    if address != "auto":  # ray.init retries an address nobody answers at for minutes: asked once, here
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except (OSError, ValueError) as exc:
            raise ClusterError(f"cannot reach the Ray cluster at {address}: {exc}",
                               "start one with `workbench node start --head`, or pass its address (host:port)"
                               ) from None
    try:
        ray.init(address=address, log_to_driver=False, logging_level="WARNING")  # the cells' lines: the board
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ClusterError(f"cannot connect to the Ray cluster at {address}: {str(exc).splitlines()[0]}",
                           "where the cluster uses Ray's token authentication, set RAY_AUTH_MODE=token and "
                           "RAY_AUTH_TOKEN as its nodes have them; else check the address") from None
    try:
        yield
    finally:
        ray.shutdown()


class FleetSweep:
    """The driver's side of a sweep on a cluster: places cells, collects their folders, keeps sweep.json."""

    def __init__(self, sweep: Sweep, address: str, kinds: list[str], retries: int) -> None:
        self.sweep, self.address, self.retries = sweep, address, retries
        self.planned = plan_cells(sweep, kinds)
        self.cells = [cell for cell, _ in self.planned]
        self.root = self.cells[0].run_dir.parent
        self.in_flight: dict[ObjectRef, tuple[Cell, Node, float]] = {}
        ray = _ray()
        self.remote = ray.remote(max_retries=0, num_cpus=0)(measure_cell)  # placed by its host-kind resource
        here = _pinned(ray.get_runtime_context().get_node_id())
        self.board = ray.remote(num_cpus=0)(Board).options(scheduling_strategy=here).remote()
        self.lost: dict[str, Node] = {}  # by id: nodes lost mid-cell, never given a cell again

    def line(self, cell: Cell, text: str) -> None:
        number = self.cells.index(cell) + 1
        print(f"[{number}/{len(self.cells)}] {cell.name}: {text}", flush=True)

    def save(self) -> None:
        cells = [{**asdict(c), "run_dir": str(c.run_dir)} for c in self.cells]
        write_text(self.root / STATUS_NAME, json.dumps({"sweep": str(self.sweep.path), "cells": cells}, indent=1))

    def fail(self, cell: Cell, error: str) -> None:
        cell.status, cell.error = "failed", error
        self.line(cell, f"failed: {error}")

    def start(self) -> deque[tuple[Cell, PlannedRun]]:
        """The cells left to run; finished ones reported done, ones whose folder holds something else failed."""
        queue: deque[tuple[Cell, PlannedRun]] = deque()
        offered = {kind for node in live_nodes() for kind in node.kinds}
        for cell, run in self.planned:
            if (cell.run_dir / RECORD_NAME).is_file() and pending_steps(_at(run, cell.run_dir)) is None:
                cell.status = "done"
                self.line(cell, f"done ({cell.run_dir})")
            elif cell.run_dir.exists():
                self.fail(cell, f"{cell.run_dir} exists and is not this cell's finished run; move it away")
            elif cell.kind not in offered:
                self.fail(cell, f"no live node of the cluster offers host kind {cell.kind!r} (offered: "
                                f"{', '.join(sorted(offered)) or 'none'}); start one with "
                                f"`workbench node start --address ADDRESS` on such a host")
            else:
                queue.append((cell, run))
        return queue

    def place(self, queue: deque[tuple[Cell, PlannedRun]]) -> None:
        """Each idle live node of a waiting cell's kind takes the first such cell; a kind whose every node was lost
        fails its waiting cells."""
        nodes = [node for node in live_nodes() if node.id not in self.lost]
        busy = {node.id for _, node, _ in self.in_flight.values()}
        for cell, run in list(queue):
            if not any(cell.kind in node.kinds for node in nodes):
                queue.remove((cell, run))
                lost = ", ".join(_label(n) for n in self.lost.values() if cell.kind in n.kinds)
                self.fail(cell, f"its node {', '.join(cell.lost_nodes)} was lost and no other node offers host kind "
                                f"{cell.kind!r}" if cell.lost_nodes else
                          f"no live node offers host kind {cell.kind!r} any more (lost: {lost or 'none'})")
                continue
            idle = [node for node in nodes if cell.kind in node.kinds and node.id not in busy]
            if not idle:
                continue
            node = idle[0]
            queue.remove((cell, run))
            busy.add(node.id)
            spec = CellSpec(cell.name, cell.kind, run.config.model_copy(update={"output_dir": None}).to_params(),
                            str(cell.run_dir.resolve()), self.board)
            ref = self.remote.options(
                resources={host_kind(cell.kind).resource: 1},
                scheduling_strategy=_pinned(node.id)).remote(spec)
            cell.status, cell.node, cell.address = "running", node.id, node.address
            cell.attempts += 1
            self.in_flight[ref] = (cell, node, time.perf_counter())
            self.line(cell, f"placed on node {node.id[:12]} ({node.address}, {cell.kind})")
        self.save()

    def collect(self, ref: ObjectRef, queue: deque[tuple[Cell, PlannedRun]]) -> None:
        """What came of one finished cell: its folder in place, its failure, or its node lost (placed again)."""
        ray = _ray()
        cell, node, started = self.in_flight.pop(ref)
        try:
            outcome: CellOutcome = ray.get(ref)
        except ray.exceptions.RayTaskError as error:
            self.fail(cell, f"on node {node.id[:12]}: {str(error).strip().splitlines()[-1]}")
            return
        except ray.exceptions.RayError:  # the node died, or its worker, or the object with the folder
            self.lost[node.id] = node
            cell.lost_nodes.append(_label(node))
            self.line(cell, f"node {_label(node)} was lost mid-cell; nothing of it kept")
            if cell.attempts <= self.retries:
                cell.status = "pending"
                queue.appendleft((cell, self._run_of(cell)))
            else:
                self.fail(cell, f"node {', '.join(cell.lost_nodes)} was lost (tried {cell.attempts} times)")
            return
        cell.run_seconds = outcome.seconds
        if outcome.packed is None:
            last = next((line for line in reversed(outcome.tail) if line.strip()), "no output")
            self.fail(cell, f"its run exited {outcome.exit_code} on node {node.id[:12]}: {last}")
            return
        try:
            install(outcome.packed, cell.run_dir)
        except (TransferError, WorkbenchError) as error:
            self.fail(cell, error.problem)
            return
        RunRecord.load(cell.run_dir).moved_here()
        cell.status, cell.seconds = "done", round(time.perf_counter() - started, 3)
        self.line(cell, f"finished in {cell.seconds:.0f} s on node {node.id[:12]} ({node.address}), "
                        f"{len(outcome.packed.files)} files checked -> {cell.run_dir}")

    def write_fleet_manifests(self) -> None:
        """Per run, every kind's Deployment in one file beside the cells (where their deploy steps wrote one)."""
        for run in self.sweep.runs:
            done = [cell.run_dir for cell in self.cells if cell.run == run.name and cell.status == "done"]
            written = write_fleet(run.name, done, self.root / f"{run.name}-fleet.yaml")
            if written is not None:
                print(f"{run.name}: each host kind's deployment in {written}", flush=True)

    def _run_of(self, cell: Cell) -> PlannedRun:
        return next(run for c, run in self.planned if c is cell)

    def relay(self) -> None:
        """The lines the cells posted since the last call, printed here."""
        for line in _ray().get(self.board.take.remote()):
            print(line, flush=True)

    def cancel(self) -> None:
        """Tell every cell in flight to stop its run and wait until they have (then end what is left by force)."""
        ray = _ray()
        self.board.cancel.remote()
        refs = list(self.in_flight)
        deadline = time.monotonic() + CANCEL_GRACE_S
        while refs and time.monotonic() < deadline:
            _, refs = ray.wait(refs, num_returns=len(refs), timeout=POLL_S)
            self.relay()
        for ref in refs:
            ray.cancel(ref, force=True)
        for cell, _, _ in self.in_flight.values():
            cell.status, cell.error = "failed", "interrupted"
        for partial in self.root.glob(f".{STATUS_NAME}.*.partial"):  # a save the signal cut between create and try
            partial.unlink(missing_ok=True)
        self.save()

    def run(self) -> int:
        """Every cell to its end; 0 when each finished, 1 when one failed. SIGTERM or Ctrl-C cancels them."""
        stopped: list[int] = []  # a signal noted, not raised: Ray's calls may defer or swallow a KeyboardInterrupt
        previous = {sig: signal.signal(sig, lambda signum, _frame: stopped.append(signum))
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            queue = self.start()
            self.save()
            while (queue or self.in_flight) and not stopped:
                self.place(queue)
                if not self.in_flight:
                    continue
                ready, _ = _ray().wait(list(self.in_flight), num_returns=1, timeout=POLL_S)
                self.relay()
                for ref in ready:
                    self.collect(ref, queue)
                self.save()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if stopped:
            self.cancel()
            raise RunInterruptedError(f"the sweep {self.sweep.path} was interrupted; its cells were cancelled",
                                      f"the same command again (`workbench sweep {self.sweep.path} --ray "
                                      f"{self.address}`) runs what is left: finished cells are kept",
                                      stopped[0])
        self.write_fleet_manifests()
        failed = [cell.name for cell in self.cells if cell.status == "failed"]
        if failed:
            print(f"failed: {', '.join(failed)}; the same command again runs them (finished cells are kept)",
                  file=sys.stderr, flush=True)
        return 1 if failed else 0


def _pinned(node_id: str) -> NodeAffinitySchedulingStrategy:
    """Placed on that node, or not at all."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def _label(node: Node) -> str:
    return f"{node.id[:12]} ({node.address})"


def _at(run: PlannedRun, run_dir: Path) -> PlannedRun:
    return PlannedRun(run.name, run.config, run_dir)


def run_on_cluster(sweep: Sweep, address: str, kinds: list[str] | None, retries: int) -> int:
    """Every run of `sweep` on each of `kinds` (default: every kind the cluster's live nodes offer)."""
    with connected(address):
        chosen = kinds or sorted({kind for node in live_nodes() for kind in node.kinds})
        if not chosen:
            raise ClusterError(f"no node of the cluster at {address} advertises a host kind",
                               "start nodes with `workbench node start`, which advertises one")
        return FleetSweep(sweep, address, chosen, retries).run()

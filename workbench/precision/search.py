"""The repair search: find a small set of nodes to keep in fp32 so a reduced-precision variant passes parity.

The search is the same for fp16 and int8; what differs is how a candidate is built (the fp16 converter's node
block list, or the quantizer's nodes to exclude) and how units are ordered (most likely culprit first):
1. order the units; 2. bisect the shortest prefix of that order that passes; 3. drop, one at a time from the least
likely end, every unit the set still passes without. Every build is evaluated and timed; the passing candidate that
keeps the least compute in fp32 wins (a cost read from the graph, never a timing: the choice must not follow the
machine's load). A candidate that keeps every unit in fp32 is no repair.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from workbench.core.progress import Progress
from workbench.graphs import onnxfiles
from workbench.models.footprint import release_memory
from workbench.precision.tables import RepairCandidate, RepairOutcome
from workbench.runners.timing import Budget

if TYPE_CHECKING:
    from onnx import ModelProto

    from workbench.precision.checker import Checker

# Pruning a passing prefix moves units back to reduced precision: a prefix slower than this times the variant a
# repair must beat is not pruned. Measured on all-mpnet-base-v2's OpenVINO int8 (b8 s128): the shortest passing
# prefix, 24 of 99 quantizers in float, ran 587 ms, and pruning it to 17 gained 1.09x (ending at 0.91x the bf16 graph
# it had to beat, after 17 more builds).
PRUNE_HEADROOM = 1.15
RANKED_BY = "fp32 compute kept (weight elements per token, from the graph), then node count"
# The primary output's metric a progress note shows, by preference: key, words, format.
NOTED_METRICS = (("min_cosine", "min cosine", ".6f"), ("kendall_tau", "Kendall tau", ".4f"),
                 ("agreement", "agreement", ".4f"), ("max_abs", "max abs", ".3g"))


def noted_metric(candidate: RepairCandidate) -> str:
    """The candidate's primary metric in words, the first of `NOTED_METRICS` it has ("" if none)."""
    return next((f"{words} {value:{spec}}" for key, words, spec in NOTED_METRICS
                 if (value := getattr(candidate, key, None)) is not None), "")


@dataclass
class Candidate:
    """A built candidate: the units it keeps in fp32, its timing and its verdict on the search's batches."""

    blocked: tuple[str, ...]
    latency_ms: float
    build_seconds: float
    summary: RepairCandidate

    @property
    def passed(self) -> bool:
        return self.summary.passed

    @property
    def violation(self) -> float:
        return self.summary.violation

    def record(self) -> RepairCandidate:
        return self.summary.model_copy(update={"blocked": list(self.blocked), "latency_ms": round(self.latency_ms, 3),
                                               "build_seconds": round(self.build_seconds, 3)})


@dataclass
class RepairProblem:
    """What to repair: `build(blocked, dest)` writes the variant keeping `blocked` nodes in fp32."""

    precision: str
    units: list[str]
    build: Callable[[list[str], Path], None]
    ordering: str = ""
    costs: dict[str, float] = field(default_factory=dict)  # compute each unit moves back to fp32 when blocked
    sensitivity: dict[str, float] = field(default_factory=dict)
    # The variant a repair must beat to be served (name, its median ms on the checker's latency batch): a repair
    # whose shortest passing prefix is slower than PRUNE_HEADROOM times that is not pruned (`run_search`).
    ceiling: tuple[str, float] | None = None


class RepairSearch:
    """Builds, checks (with `checker`) and times candidates, caching by blocked set; keeps only the best file on
    disk. Builds stop at `max_builds` or when `budget` is spent. Each build is counted on `progress`, with the best
    repair so far and the time left as its note."""

    def __init__(self, problem: RepairProblem, checker: Checker, workdir: Path, max_builds: int, budget: Budget,
                 progress: Progress | None = None) -> None:
        self.problem = problem
        self.checker = checker
        self.workdir = workdir
        self.max_builds = max_builds
        self.budget = budget
        self.progress = progress
        self.candidates: dict[frozenset[str], Candidate] = {}
        self.best: tuple[Candidate, Path] | None = None
        self.history: list[RepairCandidate] = []
        self.round = 0
        self.probes = 0  # builds measured by `probe`
        self.phase = ""  # what the builds are for, while no repair has been found
        workdir.mkdir(parents=True, exist_ok=True)

    def _bounds(self) -> None:
        """BudgetSpent where another build would pass a bound: builds (candidates and probes) or seconds."""
        if len(self.history) + self.probes >= self.max_builds:
            raise BudgetSpent(f"its {self.max_builds} builds were spent (parity.repair.max_builds)")
        if self.budget.spent:
            raise BudgetSpent(f"its {self.budget.seconds:g} s ran out (parity.repair.budget_s)")

    def probe(self, blocked: list[str]) -> float:
        """The loss with `blocked` kept in fp32 on the checker's probe batches (`Checker.probe`): built like a
        candidate and counted against the same bounds, but neither judged nor kept."""
        self._bounds()
        path = self.workdir / "candidate-probe.onnx"
        try:
            self.problem.build(list(blocked), path)
            loss = self.checker.probe(path)
        finally:
            onnxfiles.remove(path)
        self.probes += 1
        if self.progress:
            self.progress.update(1, note=self.best_so_far())
        return loss

    def try_blocked(self, blocked: list[str]) -> Candidate:
        key = frozenset(blocked)
        if key in self.candidates:
            return self.candidates[key]
        self._bounds()
        path = self.workdir / f"candidate-{len(self.history):03d}.onnx"
        start = time.perf_counter()
        self.problem.build(list(blocked), path)
        seconds = time.perf_counter() - start
        result, latency_ms = self.checker.assess(path)
        release_memory()  # the candidate's session: a base-size one held hundreds of MB
        candidate = Candidate(tuple(sorted(blocked)), latency_ms, seconds, self.checker.summarize(result))
        self.candidates[key] = candidate
        self.history.append(self.describe(candidate).model_copy(update={"round": self.round}))
        self._keep_if_best(candidate, path)
        if self.progress:
            self.progress.update(1, note=self.best_so_far())
        return candidate

    def best_so_far(self) -> str:
        """The best repair yet (the units it keeps in fp32, their share of the compute, its primary metric) and the
        time left."""
        left = f"; {self.budget.left():.0f} s left"
        if self.best is None:
            return (self.phase or "no repair yet") + left
        blocked, summary = self.best[0].blocked, self.best[0].summary
        total = sum(self.problem.costs.values())
        share = f", {self.cost(blocked) / total:.0%} of their compute" if total else ""
        shown = noted_metric(summary)
        metric = f"; {shown}" if shown else ""
        return f"best so far: {len(blocked)} of {len(self.problem.units)} units in fp32{share}{metric}{left}"

    def closest(self) -> Candidate | None:
        """The candidate nearest the gate among all built (the smallest violation, then the least kept in fp32),
        passing or not; one that keeps every unit in fp32 is no repair, so it is not one."""
        repairs = [c for c in self.candidates.values() if len(c.blocked) < len(self.problem.units)]
        return min(repairs, key=lambda c: (c.violation, self.cost(c.blocked), len(c.blocked)), default=None)

    def reset_results(self) -> None:
        """Forget verdicts (the check set changed); the build budget and history carry on."""
        self.discard()
        self.candidates.clear()
        self.best = None
        self.round += 1

    def cost(self, blocked: tuple[str, ...]) -> float:
        """Compute kept in fp32 (weight elements multiplied per token), from the graph alone."""
        return sum(self.problem.costs.get(unit, 0.0) for unit in blocked)

    def _rank(self, candidate: Candidate) -> tuple[float, int, tuple[str, ...]]:
        return self.cost(candidate.blocked), len(candidate.blocked), candidate.blocked

    def describe(self, candidate: Candidate) -> RepairCandidate:
        return candidate.record().model_copy(update={"fp32_cost": self.cost(candidate.blocked)})

    def is_repair(self, candidate: Candidate) -> bool:
        """Passes while keeping at least one unit in reduced precision."""
        return candidate.passed and len(candidate.blocked) < len(set(self.problem.units))

    def _keep_if_best(self, candidate: Candidate, path: Path) -> None:
        best = self.best[0] if self.best else None
        better = self.is_repair(candidate) and (best is None or self._rank(candidate) < self._rank(best))
        if better:
            if self.best:
                onnxfiles.remove(self.best[1])
            self.best = (candidate, path)
        else:
            onnxfiles.remove(path)

    def discard(self) -> None:
        """Remove the best candidate's file (the others are removed as they are judged); the chosen base's source
        stays for the next round."""
        if self.best:
            onnxfiles.remove(self.best[1])
        self.best = None

    def passes(self, blocked: list[str]) -> bool:
        return self.try_blocked(blocked).passed


def remove_candidates(workdir: Path) -> None:
    """Remove every candidate file in `workdir`, then the folder and its parent (repair/) once empty."""
    for path in workdir.glob("candidate-*.onnx*"):
        path.unlink(missing_ok=True)
    for folder in (workdir, workdir.parent):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


class BudgetSpent(Exception):
    """The repair stops: its builds or its seconds are spent, or it cannot become worth serving (the message says
    which)."""


def run_search(search: RepairSearch) -> RepairOutcome:
    """Bisect the shortest passing prefix of the unit order, then prune it; returns what was found."""
    units = search.problem.units
    start = time.perf_counter()
    outcome, stopped = "repaired", None
    try:
        if search.passes([]):
            pass  # the base alone passes: nothing to keep in fp32
        elif not search.passes(units):
            outcome = "unrepairable: fails even with every candidate node in fp32"
        else:
            low, high = 0, len(units)  # units[:low] fails, units[:high] passes
            while high - low > 1:
                mid = (low + high) // 2
                if search.passes(units[:mid]):
                    high = mid
                else:
                    low = mid
            kept = list(units[:high])
            too_slow(search, kept)
            for unit in reversed(units[:high]):
                trial = [u for u in kept if u != unit]
                if search.passes(trial):
                    kept = trial
    except BudgetSpent as spent:
        outcome = stopped = str(spent)
    chosen = search.best[0] if search.best else None
    if chosen is None and outcome == "repaired":
        outcome = "unrepairable: passes only with every candidate node in fp32"
    return RepairOutcome(precision=search.problem.precision, ordering=search.problem.ordering, ranked_by=RANKED_BY,
                         units=len(units), outcome=outcome, stopped=stopped,
                         chosen=search.describe(chosen) if chosen else None, candidates=search.history,
                         sensitivity=search.problem.sensitivity, seconds=round(time.perf_counter() - start, 2))


def too_slow(search: RepairSearch, kept: list[str]) -> None:
    """BudgetSpent where the passing set `kept` runs slower than `PRUNE_HEADROOM` times the variant the repair must
    beat (`RepairProblem.ceiling`): pruning it would not make a repair worth serving; its file is discarded."""
    ceiling = search.problem.ceiling
    ms = search.try_blocked(kept).latency_ms
    if ceiling is not None and ms > PRUNE_HEADROOM * ceiling[1]:
        search.discard()
        raise BudgetSpent(f"the shortest passing set ({len(kept)} units) ran {ms:.1f} ms on the latency batch, over "
                          f"{PRUNE_HEADROOM:g}x {ceiling[0]}'s {ceiling[1]:.1f} ms: no pruned repair would be served "
                          "ahead of it")


def sensitivity_order(search: RepairSearch, costs: dict[str, float]) -> list[str]:
    """Units ordered by error removed per unit of compute moved back to fp32: keeping each node alone in fp32
    (one probe each, on the hard texts' batches: `RepairSearch.probe`) measures the error it removes; `costs` says
    what that node computes (its weight size)."""
    search.phase = f"measuring each of {len(search.problem.units)} units alone in fp32"
    baseline = search.probe([])
    for unit in search.problem.units:
        search.problem.sensitivity[unit] = baseline - search.probe([unit])
    search.phase = ""
    floor = max(min((c for c in costs.values() if c > 0), default=1.0), 1.0)
    return sorted(search.problem.units,
                  key=lambda u: -search.problem.sensitivity[u] / max(costs.get(u, 0.0), floor))


def matmul_costs(model: ModelProto, units: list[str]) -> dict[str, float]:
    """Weight elements a node multiplies by (FLOPs per token up to a factor); 0 for nodes with no 2-D weight
    (an embedding lookup costs nothing next to a matmul)."""
    import numpy as np

    weights = {i.name: int(np.prod(i.dims)) for i in model.graph.initializer if len(i.dims) == 2}
    wanted = set(units)
    costs = {}
    for node in model.graph.node:
        if node.name in wanted:
            matrices = [weights[t] for t in node.input if t in weights]
            costs[node.name] = float(max(matrices)) if matrices and node.op_type != "EmbedLayerNormalization" else 0.0
    return costs


def activation_order(model_path: Path, feeds: list[dict[str, np.ndarray]], candidates: set[str]) -> list[str]:
    """Nodes with float activations, ordered by the largest magnitude their inputs or outputs reach in fp32.

    fp16 overflows past 65504, so the nodes that touch the largest values are the first suspects.
    """
    from polygraphy import constants

    peak: dict[str, float] = {}
    for values in onnxfiles.tensor_values(model_path, constants.MARK_ALL, feeds):
        for name, value in values.items():
            if np.issubdtype(np.asarray(value).dtype, np.floating) and np.asarray(value).size:
                peak[name] = max(peak.get(name, 0.0), float(np.nanmax(np.abs(value))))
    node_peak = {node.name: max(peak[t] for t in [*node.input, *node.output] if t in peak)
                 for node in onnxfiles.skeleton(model_path).graph.node
                 if node.name in candidates and any(t in peak for t in [*node.input, *node.output])}
    return sorted(node_peak, key=lambda n: -node_peak[n])

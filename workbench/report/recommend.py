"""What to deploy, from recorded values only: per goal, the fastest variant that passes parity in this run.

Goals: `latency` (batch 1 at the shortest sequence measured: one short query at a time) and `throughput` (the
largest batch at the longest sequence measured: bulk work). Speedups are the bench step's in-process ratios over
PyTorch eager in that cell; a variant qualifies only when its parity verdict (parity step, or tensorrt step for
engines) is a pass now. `candidates` lists what was measured, `pick` chooses among them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import ValidationError

from workbench.core.advice import run_again
from workbench.core.record import RunRecord, StepStatus
from workbench.core.results import Verdict
from workbench.graphs.tables import OptimizeMetrics
from workbench.measure.latency import is_variant_row
from workbench.measure.precisions import MIN_GAIN
from workbench.measure.tables import BenchMetrics, CellTiming
from workbench.models.batches import Cell
from workbench.serving.plan import int8_decision
from workbench.serving.tables import TritonMetrics

GOALS = ("latency", "throughput")
# A lower-precision variant is recommended over a passing more precise one only when it is at least this much faster
# in the same cell of the same run: below it, the more precise one gives about the same speed with less accuracy loss.
# The same rule decides which precisions `precisions: auto` builds (measure.precisions).
PRECISION_MIN_GAIN = MIN_GAIN
PRECISION_RANK = {"fp32": 0, "fp16": 1, "bf16": 1, "int8": 2}  # higher: less precise
# (tolerance key, recorded value key, what people call it); a criterion is "at least" the threshold
_AT_LEAST = (("min_cosine", "min_cosine", "min cosine"), ("min_agreement", "agreement", "label agreement"))
# gates on outputs.<o>.retrieval (embeddings), .ranking (a reranker's scores) or .sparse (a sparse embedding)
_NEIGHBOURS = (("min_agreement_at_1", "agreement_at_1", "agreement@1"),
               ("min_recall_at_10", "recall_at_10", "recall@10"), ("min_spearman", "spearman", "Spearman"),
               ("min_kendall_tau", "kendall_tau", "Kendall tau"),
               ("min_top_k_overlap", "top_k_overlap", "top-20 terms"))


@dataclass(frozen=True)
class Gate:
    """The parity criterion a variant passes (or fails) by the least, relative to its tolerance."""

    metric: str
    output: str
    value: float
    threshold: float
    at_least: bool  # min cosine / agreement must reach the threshold; max abs error must stay under it

    @property
    def margin(self) -> float:
        """How far the value is on the passing side of the threshold (negative: failing)."""
        return self.value - self.threshold if self.at_least else self.threshold - self.value

    @property
    def relative_margin(self) -> float:
        """The margin over the room the tolerance leaves (1 - threshold, or the threshold for an error)."""
        return self.margin / max(1.0 - self.threshold if self.at_least else self.threshold, 1e-12)

    def __str__(self) -> str:
        if not self.at_least:
            limit = "atol " if self.metric == "max abs error" else "at most "
            return f"{self.metric} {self.value:.2e} vs {limit}{self.threshold:g} (margin {self.margin:+.2e})"
        threshold = f"{self.threshold:.12g}"
        digits = len(threshold.partition(".")[2]) + 2
        return f"{self.metric} {self.value:.{digits}f} vs {threshold} (margin {self.margin:+.{digits}f})"


@dataclass(frozen=True)
class Candidate:
    """A variant measured in one cell: its speedup over PyTorch and its parity verdict now (why it fails, if so)."""

    variant: str
    speedup: float
    passed: bool
    gate: Gate | None
    failures: tuple[str, ...]
    precision: str | None = None
    retrieval: dict[str, float] | None = None  # embeddings: nearest-neighbour agreement with PyTorch


@dataclass(frozen=True)
class Recommendation:
    """The variant to deploy for `goal` at `cell`, or none: `reason` says why and `steps` which `--steps` to run to
    get one."""

    goal: str
    cell: Cell | None
    variant: str | None = None
    speedup: float | None = None
    gate: Gate | None = None
    reason: str = ""
    steps: tuple[str, ...] = ()
    retrieval: dict[str, float] | None = None
    disturbed: bool = False  # the speedup comes from a grid other work on the host disturbed

    @property
    def margin(self) -> float | None:
        return self.gate.margin if self.gate else None

    @property
    def gate_metric(self) -> str | None:
        return self.gate.metric if self.gate else None

    @property
    def where(self) -> str:
        return self.cell.label if self.cell else "not measured"

    def line(self, run_dir: Path) -> str:
        """One plain-text line, e.g. `latency: int8_repaired, 2.83x faster than PyTorch at b1 s16, min cosine
        0.9903 vs 0.99 (margin +0.0003)`; where there is none, why and what to run again in `run_dir`."""
        if self.variant is None:
            return f"{self.goal}: nothing to recommend: {self.reason}; {run_again(self.steps, run_dir)}"
        gate = str(self.gate) if self.gate else "parity passed"
        pace = "faster than" if self.speedup and self.speedup >= 1 else "the speed of"
        neighbours = (f", recall@10 {self.retrieval['recall_at_10']:.3f} of PyTorch's neighbours"
                      if self.retrieval else "")
        if self.disturbed:  # a speedup from a disturbed grid is not a speed to expect: no headline figure
            return (f"{self.goal}: {self.variant} at {self.where}, the fastest in timings other work disturbed "
                    f"({self.speedup:.3g}x PyTorch there, not a speed to expect), {gate}{neighbours}")
        return f"{self.goal}: {self.variant}, {self.speedup:.3g}x {pace} PyTorch at {self.where}, {gate}{neighbours}"


def gate(verdict: Verdict) -> Gate | None:
    """The criterion with the least relative margin over the outputs that gate: min cosine or label agreement where
    the tolerance sets one, else max abs error against atol."""
    gates = []
    for output, result in verdict.outputs.items():
        if not result.gated:
            continue
        tolerance, retrieval = result.tolerance, result.order
        found = [Gate(name, output, measured, tolerance[key], True) for key, value, name in _AT_LEAST
                 if key in tolerance and (measured := getattr(result, value)) is not None]
        found += [Gate(name, output, retrieval[value], tolerance[key], True)
                  for key, value, name in _NEIGHBOURS if key in tolerance and value in retrieval]
        dots = retrieval.get("dot_rel_error")
        if "max_dot_error" in tolerance and dots is not None:
            found.append(Gate("dot product error", output, dots, tolerance["max_dot_error"], False))
        if not found and "atol" in tolerance and result.max_abs is not None:
            found = [Gate("max abs error", output, result.max_abs, tolerance["atol"], False)]
        gates += found
    return min(gates, key=lambda g: g.relative_margin, default=None)


def candidates(cell: dict[str, CellTiming], verdicts: dict[str, Verdict]) -> list[Candidate]:
    """Every variant measured in `cell` end to end (PyTorch, torch.compile and the on-device rows left out: the
    deployment pays numpy in and out) with its current parity verdict."""
    measured = []
    for name, stats in cell.items():
        if not is_variant_row(name) or stats.speedup is None:
            continue
        verdict = verdicts.get(name)
        if verdict is None:
            measured.append(Candidate(name, stats.speedup, False, None, ("no parity verdict in this run",)))
        else:
            measured.append(Candidate(name, stats.speedup, verdict.passed, gate(verdict),
                                      tuple(verdict.failures), verdict.precision, verdict.retrieval))
    return measured


def pick(goal: str, cell: Cell, measured: list[Candidate], int8_dot_product: str | None = None,
         int8_decision: str | None = None) -> Recommendation:
    """The fastest candidate that passes parity; the faster ones that fail are named in the reason. A winner of lower
    precision less than PRECISION_MIN_GAIN faster than a more precise passing one gives way to the most precise
    within that band (for the reason: the optimize step's `int8_decision`, else this host's `int8_dot_product`
    instructions)."""
    passing = [c for c in measured if c.passed]
    if not passing:
        failing = "; ".join(f"{c.variant}: {c.failures[0]}" for c in measured) or "none measured"
        return Recommendation(goal, cell, reason=f"no variant measured at {cell.label} passes "
                              f"parity in this run ({failing}); the parity step's precision repair may fix one",
                              steps=("parity", "bench"))
    best = max(passing, key=lambda c: c.speedup)
    reason = f"fastest of {len(passing)} variant(s) that pass parity"
    faster = [c for c in measured if not c.passed and c.speedup > best.speedup]
    if faster:
        reason += "; faster but failing parity: " + "; ".join(f"{c.variant} ({c.speedup:.3g}x, {c.failures[0]})"
                                                               for c in faster)
    band = [c for c in passing if c.speedup * PRECISION_MIN_GAIN > best.speedup]  # not meaningfully slower
    precise = min(band, key=lambda c: (_rank(c), -c.speedup))
    if _rank(precise) < _rank(best):
        reason = (f"{best.variant} is only {best.speedup / precise.speedup:.2f}x {precise.variant} here (under "
                  f"{PRECISION_MIN_GAIN}x): {precise.variant} serves about the same speed with less precision loss")
        if best.precision == "int8" and int8_decision:
            reason += f"; the optimize step measured that plain int8 {int8_decision}"
        elif best.precision == "int8":
            reason += (f"; this CPU has {int8_dot_product}, yet int8 gains little at this shape" if int8_dot_product
                       else "; this CPU has no int8 dot-product instructions: AVX-512 VNNI, AVX-VNNI or AMX make "
                            "int8 pay")
        best = precise
    if best.speedup < 1:
        reason += "; slower than PyTorch eager"
    return Recommendation(goal, cell, best.variant, best.speedup, best.gate, reason,
                          retrieval=best.retrieval)


def _rank(candidate: Candidate) -> int:
    return PRECISION_RANK.get(candidate.precision or "fp32", 0)


def served_failures(record: RunRecord) -> dict[str, Verdict]:
    """Variants that passed parity in process but failed it served (the triton step passed them over), as failing
    verdicts: a deployment would answer as the server did."""
    try:
        deployment = record.current(TritonMetrics)
    except ValidationError:  # a damaged triton section: its own section of the report says so
        deployment = None
    verification = deployment.verification if deployment else None
    found = {}
    for variant, failures in (verification.passed_over if verification else {}).items():
        verdict = record.verdict(variant)
        if verdict is not None and verdict.passed and failures and failures[0].startswith("served over"):
            found[variant] = verdict.model_copy(update={"passed": False, "failures": list(failures)})
    return found


def recommend(record: RunRecord) -> list[Recommendation]:
    """One recommendation per goal from the bench step's in-process latency (when the step is ok) and the
    parity verdicts of this run."""
    bench = record.step_entry("bench")
    measured = record.results_as("bench", BenchMetrics) if bench.status == StepStatus.OK else None
    cells = measured.latency.cells if measured and measured.latency else {}
    shapes = [cell for name in cells if (cell := Cell.parse(name))]
    verdicts = {**record.verdicts(), **served_failures(record)}
    if not shapes:
        state = bench.label + (f": {bench.detail}" if bench.detail else "")
        steps = ("bench",) if any(v.passed for v in verdicts.values()) else ("parity", "bench")
        return [Recommendation(goal, None, reason=f"nothing was benchmarked in process in this run (bench: "
                               f"{state})", steps=steps) for goal in GOALS]
    recommendations, int8 = [], int8_decision(record.results_of(OptimizeMetrics))
    for goal, shape in goal_cells(shapes).items():
        if shape is None:
            recommendations.append(Recommendation(goal, None, reason="batch 1 was not measured; add 1 to "
                                                  "bench.batches", steps=("bench",)))
        else:
            choice = pick(goal, shape, candidates(cells[shape.key], verdicts),
                          record.environment.int8_dot_product,
                          int8.reason if int8 else None)
            recommendations.append(replace(choice, disturbed=bool(measured and measured.disturbed())))
    return recommendations


def goal_cells(cells: list[Cell]) -> dict[str, Cell | None]:
    """The cell per goal among the measured ones: batch 1 at its shortest sequence (latency; none when batch 1 was
    not measured) and the largest batch at its longest sequence (throughput)."""
    ones = [cell.sequence for cell in cells if cell.batch == 1]
    largest = max(cell.batch for cell in cells)
    return {"latency": Cell(1, min(ones)) if ones else None,
            "throughput": Cell(largest, max(cell.sequence for cell in cells if cell.batch == largest))}

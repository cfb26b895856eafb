"""How the repair judges a candidate file: on the search's batches (the corner batches and the texts the unrepaired
variant gets most wrong, with a latency), on the full parity lab, and in a short summary of the primary output."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from workbench.core.record import Variant
from workbench.core.results import Verdict
from workbench.precision.compare import OutputParity
from workbench.precision.lab import ParityLab
from workbench.precision.tables import RepairCandidate
from workbench.runners import Runner
from workbench.runners.onnxruntime import SessionSettings
from workbench.runners.registry import open_variant
from workbench.runners.timing import median_ms

HARD_TEXTS = 16  # worst texts per output whose batches the search checks candidates on
SUMMARY_KEYS = ("max_abs", "min_cosine", "agreement", "loss", "retrieval")
RANKING_KEYS = ("kendall_tau", "agreement_at_1")  # a reranker's scores: each query's document order


class Checker:
    """Checks candidate files of one `variant` against `lab`, each run by the runtime its file names
    (`runners.registry.open_variant`: ONNX Runtime on `device`, or OpenVINO) with `threads`. The search's batches
    (`checks`) start as those of the texts the variant's own file gets most wrong and grow with `add_failing`; the
    corner batches join them once a search's winner failed the full lab (`probe_lab` is the same without them):
    accuracy is decided on the hard texts, the shapes at confirmation, so a base-size candidate is judged in seconds."""

    def __init__(self, lab: ParityLab, variant: Variant, device: str, threads: int | None) -> None:
        self.lab, self.variant, self.device, self.threads = lab, variant, device, threads
        self.hard: list[int] = []
        self.corners = False  # whether the search's batches hold the corner batches
        self.batch = lab.latency_batch()
        self.add_failing(self.collect(variant.path), only_failing=False)

    @property
    def precision(self) -> str:
        return self.variant.precision

    def runner(self, path: Path) -> Runner:
        return open_variant(dataclasses.replace(self.variant, path=path), self.device, self.threads,
                            SessionSettings(self.threads, arena=False))

    def collect(self, path: Path) -> dict[str, OutputParity]:
        """Per output, every text's parity on the full lab."""
        with self.runner(path) as runner:
            return self.lab.collect(runner, self.precision)

    def add_failing(self, collected: dict[str, OutputParity], only_failing: bool = True) -> list[int]:
        """Add the hardest texts of the (failing) outputs that gate to the search's batches; returns the texts
        found."""
        found = [i for output in collected.values()
                 if output.gated and (not only_failing or not output.summary().passed)
                 for i in output.hardest(HARD_TEXTS)]
        self.hard += [i for i in found if i not in self.hard]
        self.corners = self.corners or only_failing  # a winner failed the full lab: the shapes join the search
        self.checks = self.lab.subset(self.hard, corners=self.corners)
        self.probe_lab = self.lab.subset(self.hard, corners=False)
        self.with_corners = self.lab.subset(self.hard)
        return found

    def probe(self, path: Path) -> float:
        """The primary output's loss on the hard texts' batches alone (no corners, no latency): a quick measure of
        how much an edit helps, for ordering, never a verdict."""
        return self.summarize(self.check(path, self.probe_lab)).loss or 0.0

    def assess(self, path: Path, lab: ParityLab | None = None) -> tuple[Verdict, float]:
        """The parity result on `lab` (default: the search's batches) and the median latency (ms) of the lab's
        latency batch."""
        with self.runner(path) as runner:
            return ((lab or self.checks).compare(runner, self.precision),
                    median_ms(lambda: runner.infer(self.batch), repeats=5, warmup=1))

    def check(self, path: Path, lab: ParityLab) -> Verdict:
        """The parity result on `lab`: `self.lab` (the full lab), `self.checks`, `self.probe_lab` or
        `self.with_corners`."""
        with self.runner(path) as runner:
            return lab.compare(runner, self.precision)

    def confirm(self, path: Path) -> Verdict:
        """The parity result on the full lab."""
        return self.check(path, self.lab)

    def summarize(self, result: Verdict) -> RepairCandidate:
        """A parity result as a repair records it: passed, how far past the gate, the failures and the primary
        output's headline metrics."""
        primary = result.outputs[self.lab.primary.name].recorded()
        ranking = {k: primary["ranking"][k] for k in RANKING_KEYS if k in primary.get("ranking", {})}
        return RepairCandidate(passed=result.passed, violation=result.violation, failures=result.failures,
                               **{k: primary[k] for k in SUMMARY_KEYS if k in primary}, **ranking)

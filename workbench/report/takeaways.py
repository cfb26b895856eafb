"""The verdict line each step notebook ends with: `takeaway` runs the lines a step declares (`StepSpec.takeaway`, in
the step's own module) or says why the step did not run; the phrases several steps' lines share."""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from workbench.core.advice import set_settings
from workbench.core.record import RunRecord, StepStatus
from workbench.core.results import Verdict
from workbench.measure.latency import disturbance_note
from workbench.measure.tables import BenchMetrics


class Declared(Protocol):
    """A step declaration as far as its verdict line goes (workbench.steps.StepSpec)."""

    @property
    def name(self) -> str: ...

    @property
    def takeaway(self) -> Callable[[RunRecord], list[str]]: ...


def takeaway(step: Declared, record: RunRecord) -> str:
    """One or a few lines: what the step found (its declared `takeaway`), or why it did not run."""
    entry = record.step_entry(step.name)
    if entry.status == StepStatus.OK:
        return "\n".join(step.takeaway(record))
    # a skipped step can still have found something, e.g. TensorRT's profiles
    found = step.takeaway(record) if entry.status == StepStatus.SKIPPED and entry.metrics else []
    return "\n".join([f"{step.name}: {entry.label} - {entry.detail.splitlines()[0] if entry.detail else ''}",
                      *found])


def cut_line(deployment: int, own: int, count: int, library: str, beyond: Verdict | None) -> str:
    """Where the run cuts texts (`deployment` tokens) against where the model's library does (`own`), in words:
    equal up to the run's cut, and what the `count` texts past it get (`beyond`: their comparison, when the run
    cuts shorter)."""
    if deployment >= own:
        return (f"texts are cut at {deployment} tokens, where {library} cuts them ({_texts(count)} longer, inside the "
                "gate)")
    worst = ""
    if beyond:
        primary = list(beyond.outputs.values())[-1]
        worst = f": min cosine {primary.min_cosine:.4f}" if primary.min_cosine is not None else \
            f": max abs {primary.max_abs:.3g}"
    return (f"equal to {library} up to {deployment} tokens; longer texts are cut at {deployment} where {library} "
            f"cuts at {own} ({_texts(count)} longer{worst}; to cut where the library does: "
            f"{set_settings({'sequence.max': 'auto'})})")


def _texts(count: int) -> str:
    return f"{count} checked text{'' if count == 1 else 's'}"


def disturbed_lines(record: RunRecord) -> list[str]:
    bench = record.results_as("bench", BenchMetrics)
    found = bench.disturbed() if bench else []
    return [f"{disturbance_note(found)} below"] if found else []



"""The catalog of steps: each step declares itself once (a StepSpec: its facts, which the configuration and the
record read from the registry, and what it does) and is registered; the pipeline, preflight and the report read the
catalog, so core imports no step."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any

from workbench.core.registry import NEEDS, StepFacts, facts, register, run_order, step_names

if TYPE_CHECKING:
    from workbench.core.config import RunConfig
    from workbench.core.memory import StepMemory
    from workbench.core.record import RunRecord, StepEntry

__all__ = ["NEEDS", "Parts", "Section", "StepSpec", "register", "run_order", "spec", "specs", "step_names"]
Parts = list[tuple[str, str, list[Any]]]  # a report section's (title, text, figures)


@dataclass(frozen=True)
class Section:
    """Part of report.html, declared by the step whose metrics fill it (`StepSpec.sections`): its title and how the
    metrics render (none: the step left nothing); a served section names what Triton serves."""

    title: str
    render: Callable[[Any], Parts]  # the step's metrics model (StepSpec.metrics) in, parts out
    served: bool = False


@dataclass(frozen=True)
class StepSpec(StepFacts):
    """A step, declared once in its own module: its facts (`StepFacts`) and what it does.

    `run`: the step itself; `check`: a check of the step's own settings, before anything runs; `takeaway`: its
    verdict line from the record; `sections`: its parts of report.html, drawn from its metrics as `metrics` (its
    model) has them; `headline` and `warning`: the lines and the warning report.html opens with, from its metrics
    model; `served` and `served_differs`, for the step that deploys: what the served sections open with, and a note
    where it serves another variant than the recommended one ("" where not); `memory`: what a step that does not
    hold the run's model needs at its peak (preflight's estimate; a step that needs "model" is estimated from the
    model's weights)."""

    run: Callable[[RunConfig, RunRecord], StepEntry]
    takeaway: Callable[[RunRecord], list[str]]
    _: KW_ONLY
    sections: tuple[Section, ...] = ()
    check: Callable[[RunConfig], None] | None = None
    headline: Callable[[Any], list[str]] | None = None
    warning: Callable[[Any], str] | None = None
    served: Callable[[RunRecord], str] | None = None
    served_differs: Callable[[RunRecord, str], str] | None = None
    memory: Callable[[RunConfig], StepMemory] | None = None


def specs() -> tuple[StepSpec, ...]:
    """The registered steps in run order."""
    return tuple(s for s in facts() if isinstance(s, StepSpec))


def spec(name: str) -> StepSpec:
    found = next((s for s in specs() if s.name == name), None)
    if found is None:
        raise KeyError(name)
    return found

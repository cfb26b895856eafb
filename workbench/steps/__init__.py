"""Pipeline steps: one module per step, each declaring itself once in `SPEC` (a `StepSpec`): its name,
its notebook's number, what it needs, the folders it owns, its verdict line and its report sections. Importing this
package registers every declaration (its facts in workbench.core.registry), which the pipeline, preflight,
`workbench steps`, `workbench doctor`, the notebooks and the report read: a new step is a new module here plus its
notebook.

One word names a step everywhere: `--steps <step>`, the module `workbench/steps/<step>.py`, the notebook
`notebooks/NN_<step>.ipynb` (NN: its declared number) and the run.json keys `steps.<step>` and `metrics.<step>`.
Step modules kept outside the package are found in the folders $WORKBENCH_STEPS_PATH names (os.pathsep between
them); the kernels a run starts inherit it."""
from __future__ import annotations

import importlib
import os
import pkgutil
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any

from workbench.core.registry import NEEDS, StepFacts, facts, register, step_names
from workbench.report.page import Section

if TYPE_CHECKING:
    from workbench.core.config import RunConfig
    from workbench.core.record import RunRecord, StepEntry
    from workbench.models.footprint import StepMemory

__all__ = ["NEEDS", "STEPS_PATH", "StepSpec", "discover", "spec", "specs", "step_names", "verdict_line"]
STEPS_PATH = "WORKBENCH_STEPS_PATH"
_HOME = __path__[0]  # this package's own folder


@dataclass(frozen=True)
class StepSpec(StepFacts):
    """A step, declared once in its own module: its facts (`StepFacts`, which the configuration and the record read
    from the registry) and what it does.

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


def discover() -> tuple[StepSpec, ...]:
    """Register every step module's declaration (this package's modules and those in $WORKBENCH_STEPS_PATH) in the
    registry, in place of what it held; the steps in run order."""
    paths = [p for p in os.environ.get(STEPS_PATH, "").split(os.pathsep) if p]
    __path__[:] = [p for p in __path__ if p == _HOME or p in paths] + [p for p in paths if p not in __path__]
    found = []
    for module in pkgutil.iter_modules(__path__):
        declared = getattr(importlib.import_module(f"{__name__}.{module.name}"), "SPEC", None)
        if isinstance(declared, StepSpec):
            if declared.name != module.name:
                raise RuntimeError(f"the step declared in {module.name}.py is named {declared.name!r}: a step's "
                                   "module has its name")
            found.append(declared)
    register(found)
    return specs()


def verdict_line(name: str, record: RunRecord) -> str:
    """What step `name` found, in one or a few lines (the last cell of its notebook), or why it did not run; in
    JupyterLab, then the later steps this run made stale and the notebook to open next."""
    from workbench.core.advice import IN_LAB
    from workbench.report.takeaways import takeaway

    found = takeaway(spec(name), record)
    return "\n".join([found, *whats_next(name, record)]) if os.environ.get(IN_LAB) else found


def whats_next(name: str, record: RunRecord) -> list[str]:
    """`now stale (...): parity, report: run 03_parity.ipynb, then 09_report.ipynb` where this step's outputs
    changed what later steps read, then `next: open 03_parity.ipynb (...)`."""
    from workbench.core.advice import run_again
    from workbench.core.record import StepStatus

    order = step_names()
    later = order[order.index(name) + 1:]
    stale = [step for step in later if record.status(step) == StepStatus.STALE]
    lines = [f"now stale (what they read changed): {', '.join(stale)}: {run_again(stale, lab=True)}"] if stale else []
    if not later:
        return [*lines, "this was the last step of the run"]
    following = spec(later[0])
    return [*lines, f"next: open {following.notebook} ({following.name}: {following.summary})"]


discover()

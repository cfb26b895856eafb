"""Pipeline steps: one module per step, each declaring itself once in `SPEC` (a StepSpec): its name, its notebook's
number, what it needs, the folders it owns, its verdict line and its report sections. The pipeline, preflight,
`workbench steps`, `workbench doctor`, the notebooks and the report read the declarations: a new step is a new
module here plus its notebook.

One word names a step everywhere: `--steps <step>`, the module `workbench/steps/<step>.py`, the notebook
`notebooks/NN_<step>.ipynb` (NN: its declared number) and the run.json keys `steps.<step>` and `metrics.<step>`.
Step modules kept outside the package are found in the folders $WORKBENCH_STEPS_PATH names (os.pathsep between
them); the kernels a run starts inherit it."""
from __future__ import annotations

import importlib
import os
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from workbench.core.results import Metrics

if TYPE_CHECKING:
    from workbench.core.config import RunConfig
    from workbench.core.record import RunRecord, StepEntry
    from workbench.report.page import Section

# What preflight checks for a step that needs it (workbench/preflight.py): the model resolves and fits `sequence`,
# the Triton ports are free, the repository folder is writable.
NEEDS = ("model", "ports", "repository")
STEPS_PATH = "WORKBENCH_STEPS_PATH"


@dataclass(frozen=True)
class StepSpec:
    """A step, declared once in its own module.

    `needs`: what preflight checks before anything runs (see NEEDS); `check`: a check of the step's own settings,
    also before anything runs; `reads`: earlier steps whose outputs it reads (each must be in the run, or ok in the
    resumed record); `machine`: what `workbench doctor` must find for it (its check names, e.g. "tritonserver");
    `owns`: the run folders it writes (removed when a run folder is overwritten); `writes`: about how much it
    leaves on disk, in multiples of the model's weight bytes (preflight's size estimate); `takeaway`: its verdict line
    from the record; `sections`: its parts of report.html, drawn from its metrics as `metrics` (its model) has
    them."""

    name: str
    number: int
    summary: str
    run: Callable[[RunConfig, RunRecord], StepEntry]
    takeaway: Callable[[RunRecord], list[str]]
    sections: tuple[Section, ...] = ()
    needs: tuple[str, ...] = ()
    check: Callable[[RunConfig], None] | None = None
    reads: tuple[str, ...] = ()
    machine: tuple[str, ...] = ()
    owns: tuple[str, ...] = ()
    writes: float = 0.0
    metrics: type[Metrics] = Metrics

    @property
    def notebook(self) -> str:
        return f"{self.number:02d}_{self.name}.ipynb"


@lru_cache(maxsize=1)
def specs() -> tuple[StepSpec, ...]:
    """Every step module's declaration (this package's modules and those in $WORKBENCH_STEPS_PATH), in run order
    (by number)."""
    __path__.extend(p for p in os.environ.get(STEPS_PATH, "").split(os.pathsep) if p and p not in __path__)
    found = []
    for module in pkgutil.iter_modules(__path__):
        spec = getattr(importlib.import_module(f"{__name__}.{module.name}"), "SPEC", None)
        if isinstance(spec, StepSpec):
            found.append(spec)
    found.sort(key=lambda s: s.number)
    numbers = [s.number for s in found]
    if len(set(numbers)) != len(numbers) or any(s.name != m for s, m in zip(found, (s.run.__module__.rsplit(
            ".", 1)[-1] for s in found))):
        raise RuntimeError(f"step declarations must have distinct numbers and their module's name: {found}")
    return tuple(found)


def step_names() -> tuple[str, ...]:
    return tuple(s.name for s in specs())


def spec(name: str) -> StepSpec:
    for declared in specs():
        if declared.name == name:
            return declared
    raise KeyError(name)


def verdict_line(name: str, record: RunRecord) -> str:
    """What step `name` found, in one or a few lines (the last cell of its notebook), or why it did not run."""
    from workbench.report.takeaways import takeaway

    return takeaway(spec(name), record)

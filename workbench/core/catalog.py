"""The catalog of steps: each step declares itself once (a StepSpec) and is registered here; the configuration, the
record, the pipeline and the report read the catalog, so core imports no step.

`import workbench.steps` registers the package's steps and those in the folders $WORKBENCH_STEPS_PATH names; the
commands, the notebooks and the tests import it before they read the catalog."""
from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from workbench.core.metrics import Metrics

if TYPE_CHECKING:
    from workbench.core.config import RunConfig
    from workbench.core.memory import StepMemory
    from workbench.core.record import RunRecord, StepEntry

# What preflight checks for a step that needs it (workbench/preflight.py): the model resolves and fits `sequence`,
# the Triton ports are free, the repository folder is writable.
NEEDS = ("model", "ports", "repository")
Parts = list[tuple[str, str, list[Any]]]  # a report section's (title, text, figures)


@dataclass(frozen=True)
class Section:
    """Part of report.html, declared by the step whose metrics fill it (`StepSpec.sections`): its title and how the
    metrics render (none: the step left nothing); a served section names what Triton serves."""

    title: str
    render: Callable[[Any], Parts]  # the step's metrics model (StepSpec.metrics) in, parts out
    served: bool = False


@dataclass(frozen=True)
class StepSpec:
    """A step, declared once in its own module.

    `after`: the step it runs right after (None: it runs first; steps after the same one run by `number`, then
    name), so a step goes in between two others without renumbering them; `number`: its notebook's prefix
    (`NN_<name>.ipynb`), the number of the step it follows where it goes in between;
    `needs`: what preflight checks before anything runs (see NEEDS); `check`: a check of the step's own settings,
    also before anything runs; `reads`: earlier steps whose outputs it reads (each must be in the run, or ok in the
    resumed record); `machine`: what `workbench doctor` must find for it (its check names, e.g. "tritonserver");
    `owns`: the run folders it writes (removed when a run folder is overwritten); `writes`: about how much it
    leaves on disk, in multiples of the model's weight bytes (preflight's size estimate); `takeaway`: its verdict line
    from the record; `sections`: its parts of report.html, drawn from its metrics as `metrics` (its model) has
    them; `settings`: its section of the run configuration (RunConfig's field of that name, e.g. `optimize`), the
    settings only it reads; `first_reads`: the run-wide settings no earlier step reads (a change to them leaves the
    earlier steps as they are); `verdicts`: where under its metrics it records a parity verdict per variant (e.g.
    `variants`), which the record's `verdict` reads; `headline` and `warning`: the lines and the warning report.html
    opens with, from its metrics model; `served` and `served_differs`, for the step that deploys: what the served
    sections open with, and a note where it serves another variant than the recommended one ("" where not);
    `memory`: what a step that does not hold the run's model needs at its peak (preflight's estimate; a step that
    needs "model" is estimated from the model's weights)."""

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
    after: str | None = None
    settings: str | None = None
    first_reads: tuple[str, ...] = ()
    verdicts: str | None = None
    headline: Callable[[Any], list[str]] | None = None
    warning: Callable[[Any], str] | None = None
    served: Callable[[RunRecord], str] | None = None
    served_differs: Callable[[RunRecord, str], str] | None = None
    memory: Callable[[RunConfig], StepMemory] | None = None
    lighter: str = ""  # the settings that make this step hold less, said when it runs out of memory

    @property
    def notebook(self) -> str:
        return f"{self.number:02d}_{self.name}.ipynb"


_REGISTERED: dict[str, StepSpec] = {}
STEPS_PACKAGE = "workbench.steps"  # importing it registers the steps (its `discover`)


def register(found: Iterable[StepSpec]) -> None:
    """Make `found` the catalog, in run order (a fresh scan replaces the last: a plug-in folder taken off the path
    leaves it)."""
    declared = list(found)
    names = [s.name for s in declared]
    if len(set(names)) != len(names):
        raise RuntimeError(f"two step declarations have one name: {sorted(names)}")
    ordered = run_order(declared)
    _REGISTERED.clear()
    _REGISTERED.update((s.name, s) for s in ordered)


def run_order(declared: list[StepSpec]) -> list[StepSpec]:
    """Each step right after the one it names in `after` (and after what it reads); steps after the same one by
    number, then name."""
    following: dict[str | None, list[StepSpec]] = {}
    for step in sorted(declared, key=lambda s: (s.number, s.name)):
        following.setdefault(step.after, []).append(step)
    ordered: list[StepSpec] = []
    waiting = list(reversed(following.get(None, [])))
    while waiting:
        step = waiting.pop()
        ordered.append(step)
        waiting += reversed(following.get(step.name, []))
    placed = {s.name for s in ordered}
    if len(ordered) != len(declared):
        lost = sorted(f"{s.name} (after {s.after!r})" for s in declared if s.name not in placed)
        raise RuntimeError(f"steps that follow no registered step: {', '.join(lost)}")
    for index, step in enumerate(ordered):
        later = [name for name in step.reads if name not in {s.name for s in ordered[:index]}]
        if later:
            raise RuntimeError(f"the {step.name} step reads {', '.join(later)}, which would run after it: declare "
                               f"it after {later[-1]!r}")
    return ordered


def specs() -> tuple[StepSpec, ...]:
    """The registered steps in run order; the first call with none registered imports the steps' package, which
    registers them (core names no step module: the package is found by its name, as a plug-in is)."""
    if not _REGISTERED:
        importlib.import_module(STEPS_PACKAGE)
    return tuple(_REGISTERED.values())


def step_names() -> tuple[str, ...]:
    return tuple(s.name for s in specs())


def spec(name: str) -> StepSpec:
    specs()
    return _REGISTERED[name]

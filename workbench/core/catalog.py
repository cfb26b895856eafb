"""The catalog of steps: each step declares itself once (a StepSpec) and is registered here; the configuration, the
record, the pipeline and the report read the catalog, so core imports no step.

`import workbench.steps` registers the package's steps and those in the folders $WORKBENCH_STEPS_PATH names; the
commands, the notebooks and the tests import it before they read the catalog."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from workbench.core.results import Metrics

if TYPE_CHECKING:
    from workbench.core.config import RunConfig
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


_REGISTERED: dict[str, StepSpec] = {}


def register(found: Iterable[StepSpec]) -> None:
    """Make `found` the catalog (a fresh scan replaces the last: a plug-in folder taken off the path leaves it)."""
    declared = sorted(found, key=lambda s: s.number)
    names, numbers = [s.name for s in declared], [s.number for s in declared]
    if len(set(names)) != len(names) or len(set(numbers)) != len(numbers):
        raise RuntimeError(f"step declarations must have distinct names and numbers: {declared}")
    _REGISTERED.clear()
    _REGISTERED.update((s.name, s) for s in declared)


def specs() -> tuple[StepSpec, ...]:
    """The registered steps in run order (by number)."""
    if not _REGISTERED:
        raise RuntimeError("no step is registered: `import workbench.steps` first (the commands, the notebooks and "
                           "the tests do)")
    return tuple(_REGISTERED.values())


def step_names() -> tuple[str, ...]:
    return tuple(s.name for s in specs())


def spec(name: str) -> StepSpec:
    specs()
    return _REGISTERED[name]

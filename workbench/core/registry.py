"""The registered steps as the configuration and the record read them: names in run order, the settings section and
the metrics table each declares, where it records verdicts, what it reads and owns. A step declares itself once, in
its own module, as a `workbench.steps.StepSpec` (these facts, and what the step does); registering it puts it here.

`import workbench.steps` registers the package's steps and those in the folders $WORKBENCH_STEPS_PATH names; the
first read of an empty registry imports it."""
from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import KW_ONLY, dataclass
from typing import TypeVar

from pydantic import BaseModel

from workbench.core.metrics import Metrics

# What preflight checks for a step that needs it (workbench/preflight.py): the model resolves and fits `sequence`,
# the Triton ports are free, the repository folder is writable.
NEEDS = ("model", "ports", "repository")
STEPS_PACKAGE = "workbench.steps"  # importing it registers the steps (its `discover`)


@dataclass(frozen=True)
class StepFacts:
    """What a step declares that the configuration and the record read (`workbench.steps.StepSpec` adds what it does).

    `after`: the step it runs right after (None: it runs first; steps after the same one run by `number`, then
    name), so a step goes in between two others without renumbering them; `number`: its notebook's prefix
    (`NN_<name>.ipynb`), the number of the step it follows where it goes in between;
    `needs`: what preflight checks before anything runs (see NEEDS); `reads`: earlier steps whose outputs it reads
    (each must be in the run, or ok in the resumed record); `machine`: what `workbench doctor` must find for it (its
    check names, e.g. "tritonserver"); `owns`: the run folders it writes (removed when a run folder is overwritten);
    `writes`: about how much it leaves on disk, in multiples of the model's weight bytes (preflight's size estimate);
    `metrics`: its table in run.json (`metrics.<name>`); `settings`: its section of the run configuration, kept
    under its name (`-p <name>.<setting>`), the settings only it reads (a `config.StepSettings`); `first_reads`: the
    run-wide settings no earlier step reads (a change to them leaves the earlier steps as they are); `verdicts`:
    where under its metrics it records a parity verdict per variant (e.g. `variants`), which the record's `verdict`
    reads; `lighter`: the settings that make it hold less, said when it runs out of memory."""

    name: str
    number: int
    summary: str
    _: KW_ONLY
    needs: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    machine: tuple[str, ...] = ()
    owns: tuple[str, ...] = ()
    writes: float = 0.0
    metrics: type[Metrics] = Metrics
    after: str | None = None
    settings: type[BaseModel] | None = None
    first_reads: tuple[str, ...] = ()
    verdicts: str | None = None
    lighter: str = ""

    @property
    def notebook(self) -> str:
        return f"{self.number:02d}_{self.name}.ipynb"


_REGISTERED: dict[str, StepFacts] = {}
F = TypeVar("F", bound=StepFacts)


def register(found: Iterable[StepFacts]) -> None:
    """Make `found` the registry, in run order (a fresh scan replaces the last: a plug-in folder taken off the path
    leaves it)."""
    declared = list(found)
    names = [s.name for s in declared]
    if len(set(names)) != len(names):
        raise RuntimeError(f"two step declarations have one name: {sorted(names)}")
    ordered = run_order(declared)
    _REGISTERED.clear()
    _REGISTERED.update((s.name, s) for s in ordered)


def run_order(declared: list[F]) -> list[F]:
    """Each step right after the one it names in `after` (and after what it reads); steps after the same one by
    number, then name."""
    following: dict[str | None, list[F]] = {}
    for step in sorted(declared, key=lambda s: (s.number, s.name)):
        following.setdefault(step.after, []).append(step)
    ordered: list[F] = []
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


def facts() -> tuple[StepFacts, ...]:
    """The registered steps in run order; the first call with none registered imports the steps' package, which
    registers them (core names no step module: the package is found by its name, as a plug-in is)."""
    if not _REGISTERED:
        importlib.import_module(STEPS_PACKAGE)
    return tuple(_REGISTERED.values())


def step_names() -> tuple[str, ...]:
    return tuple(s.name for s in facts())


def fact(name: str) -> StepFacts:
    facts()
    return _REGISTERED[name]

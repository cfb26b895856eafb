"""Typed errors: each names what was wrong and what to do about it."""
from __future__ import annotations

from collections.abc import Callable

DOCTOR_HINT = "`workbench doctor` shows what this machine can run"


class WorkbenchError(Exception):
    """Base of every error the workbench raises on purpose."""

    def __init__(self, problem: str, fix: str) -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(f"{self.headline()}\n  fix: {fix}")

    def headline(self) -> str:
        """The message's first line, the one that one-line summaries (`workbench run`'s step table) show."""
        return self.problem

    def __reduce__(self) -> tuple[Callable[..., WorkbenchError], tuple[type[WorkbenchError], tuple[object, ...],
                                                                      dict[str, object]]]:
        """Pickled as it is, whatever its subclass's constructor takes: raised in a child process (preflight), it
        reaches the parent whole."""
        return _rebuilt, (type(self), self.args, self.__dict__)


def _rebuilt(kind: type[WorkbenchError], args: tuple[object, ...], state: dict[str, object]) -> WorkbenchError:
    error = kind.__new__(kind)
    error.args = args
    error.__dict__.update(state)
    return error


class ConfigError(WorkbenchError):
    """The run configuration is invalid."""


class OutputDirError(WorkbenchError):
    """The output directory cannot be used."""


class DiskFullError(WorkbenchError):
    """The filesystem of a file being written has no room left."""


class MissingArtifactError(WorkbenchError):
    """A step needs an artifact that an earlier step did not produce."""


class StepFailedError(WorkbenchError):
    """A pipeline step failed; the record says which and why."""


class OutOfMemoryError(WorkbenchError):
    """Not enough memory: preflight found the limit below what the run needs, or the out-of-memory killer took a
    step's process."""


class StepSkipped(WorkbenchError):
    """Raised inside a step to end it as `skipped` (not failed) with a reason."""


class RunInterruptedError(WorkbenchError):
    """The run was stopped by a signal (SIGINT, SIGTERM, SIGHUP); the record says which step it stopped."""

    def __init__(self, problem: str, fix: str, signum: int) -> None:
        super().__init__(problem, fix)
        self.signum = signum


class MissingHereError(StepSkipped):
    """This machine lacks what the operation needs (a GPU, a package, a tool); its message names `workbench doctor`."""

    def headline(self) -> str:
        return f"{self.problem}; {DOCTOR_HINT}"


class DependencyMissingError(MissingHereError):
    """An optional dependency (tensorrt, ctranslate2, ...) is not installed."""


class GpuRequiredError(MissingHereError):
    """The operation needs an NVIDIA GPU and none was found."""


class ShapeError(WorkbenchError):
    """Inputs fall outside the shapes a model or engine supports."""

"""Typed errors: each names what was wrong and what to do about it."""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

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


class ModelNotFoundError(WorkbenchError):
    """The model path or id cannot be found."""


class ZippedModelError(ModelNotFoundError):
    """The model path holds the model as a zip (as some pip packages ship one) instead of a model folder."""


class TokenizerNotFoundError(WorkbenchError):
    """The model has no loadable tokenizer."""


class UnsupportedModelError(WorkbenchError):
    """The architecture or task is not supported."""


class OpsetError(WorkbenchError):
    """The ONNX opset is outside what the exporter supports."""


class OnnxModelError(WorkbenchError):
    """An ONNX file is missing, corrupt or not what a step expects."""


class OutputDirError(WorkbenchError):
    """The output directory cannot be used."""


class RunLockedError(OutputDirError):
    """Another workbench run holds the output directory."""


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


class CudaFallbackError(WorkbenchError):
    """A session asked for a GPU provider was created without it (ONNX Runtime fell back to the CPU): the step
    fails, it is not a skip, since what was asked for did not run."""


class ShapeError(WorkbenchError):
    """Inputs fall outside the shapes a model or engine supports."""


class InputMismatchError(WorkbenchError):
    """Two models that should be compared take different inputs."""


class ParityError(WorkbenchError):
    """A variant's outputs differ from the reference beyond tolerance; carries the worst case."""

    def __init__(self, problem: str, fix: str, variant: str, output: str, worst: dict) -> None:
        super().__init__(problem, fix)
        self.variant = variant
        self.output = output
        self.worst = worst


class UnverifiedError(WorkbenchError):
    """A deployment would serve a variant that did not pass parity in this run."""


class TritonNotFoundError(DependencyMissingError):
    """No tritonserver binary could be found."""


class ServerStartError(WorkbenchError):
    """The server did not become ready; the message carries its log."""


class PortInUseError(WorkbenchError):
    """A port the server should bind is taken."""


class ServedError(WorkbenchError):
    """The server answered a request with an error."""


class RepositoryError(WorkbenchError):
    """A model repository cannot be written or is not valid."""


class UnstableMeasurementError(WorkbenchError):
    """perf_analyzer found no stable measurement window within its trials."""


class ServerUnreachableError(ServedError):
    """A request never got an answer: connection refused, the server closed the connection, or it timed out."""


class ModelLoadError(WorkbenchError):
    """The model's files are there but cannot be read (truncated or corrupt weights)."""


class ExportError(OnnxModelError):
    """torch.onnx cannot export the model with these settings (an operator unsupported at the opset, ...)."""


class PoolingMismatchError(ConfigError):
    """`pooling` contradicts what the model's sentence-transformers files declare."""


class ReferenceMismatchError(WorkbenchError):
    """The workbench's PyTorch module does not reproduce what the model's own library returns for the same texts."""


class DeviceMismatchError(WorkbenchError):
    """Two measurements from different devices were about to be compared as if they were one."""


class ClusterError(WorkbenchError):
    """A sweep's Ray cluster cannot do what the sweep asks: unreachable, no node of a host kind, a node lost."""


class TransferError(WorkbenchError):
    """A run folder packed on a cluster node does not match its checksums on the driver: nothing of it was kept."""


class ProblemsError(ConfigError):
    """Several problems found by one check (preflight lists them all at once), each with its own fix."""

    def __init__(self, problems: list[WorkbenchError]) -> None:
        self.problems = problems
        super().__init__(
            f"{len(problems)} problems: " + " ".join(f"({i}) {type(p).__name__}: {p.problem}"
                                                     for i, p in enumerate(problems, start=1)),
            " ".join(f"({i}) {p.fix}" for i, p in enumerate(problems, start=1)))


class Problems:
    """Collects the typed errors of independent checks, so one refusal lists them all (`raise_all`)."""

    def __init__(self) -> None:
        self.found: list[WorkbenchError] = []

    def check(self, function: Callable[..., T], *args: object) -> T | None:
        """`function(*args)`, or None when it raised a WorkbenchError: kept, not raised."""
        try:
            return function(*args)
        except ProblemsError as several:
            self.found.extend(several.problems)
        except WorkbenchError as problem:
            self.found.append(problem)
        return None

    def raise_all(self) -> None:
        """The one problem found as itself, several as a ProblemsError; nothing when none was found."""
        if len(self.found) == 1:
            raise self.found[0]
        if self.found:
            raise ProblemsError(self.found)

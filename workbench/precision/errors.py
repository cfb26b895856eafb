"""Typed errors of parity: outputs that differ beyond tolerance, a reference that disagrees with the model's library."""
from __future__ import annotations

from workbench.core.errors import WorkbenchError


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


class ReferenceMismatchError(WorkbenchError):
    """The workbench's PyTorch module does not reproduce what the model's own library returns for the same texts."""

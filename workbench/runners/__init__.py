"""One interface, many backends: each runner maps a batch of named numpy inputs to named numpy outputs."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import numpy as np

    from workbench.batches import Batch

R = TypeVar("R", bound="Runner")


class RunnerClosedError(RuntimeError):
    """A runner was used after `close()`."""


class Runner(ABC):
    """What every runner has: `infer(batch)` returns exactly `output_names`; `providers` says what really runs it.

    Use it in a `with` block (or call `close()`): closing releases what it holds and is safe to repeat.
    """

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    providers: list[str]

    @abstractmethod
    def infer(self, batch: Batch) -> dict[str, np.ndarray]:
        """The outputs named `output_names` for the batch's inputs."""

    def close(self) -> None:
        """Release the runner's resources (nothing by default)."""

    def __enter__(self: R) -> R:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

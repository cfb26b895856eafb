"""One interface, many backends: each runner maps a batch of named numpy inputs to named numpy outputs, and says
where and how it runs (device, precision, providers, where its inputs and outputs live)."""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

if TYPE_CHECKING:
    import numpy as np

    from workbench.models.batches import Batch

R = TypeVar("R", bound="Runner")
Device = Literal["cpu", "cuda"]
# host: numpy arrays in and out on every call (what a server pays); device: the batch's inputs copied to the device
# once, outputs left there (what the device itself takes).
IO = Literal["host", "device"]
IO_LABELS = {"host": "end to end", "device": "on device"}
# A variant that is a folder, not an ONNX file, names its runtime (and what its runner needs) in this file inside it.
FOLDER_METADATA = "workbench.json"


def folder_metadata(path: Path) -> dict[str, str | bool]:
    """What a variant folder's FOLDER_METADATA says (empty: not a folder this workbench wrote)."""
    found = path / FOLDER_METADATA
    return json.loads(found.read_text(encoding="utf-8")) if found.is_file() else {}


class RunnerClosedError(RuntimeError):
    """A runner was used after `close()`."""


class Runner(ABC):
    """What every runner has: `infer(batch)` returns exactly `output_names`; `providers` says what really runs it;
    `device`, `precision` and `io` say where it runs, in what precision and where its data lives; `engine` names the
    software ("PyTorch eager", "ONNX Runtime <variant>", ...); `identity`, for a reference, whatever decides its
    outputs besides the inputs (None: not kept between runs).

    Use it in a `with` block (or call `close()`): closing releases what it holds and is safe to repeat.
    """

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    providers: list[str]
    identity: str | None = None  # what fixes its outputs (model files, library, versions): a key to keep them by
    engine: str = ""
    device: Device = "cpu"
    precision: str = "fp32"
    io: IO = "host"

    @abstractmethod
    def infer(self, batch: Batch) -> dict[str, np.ndarray]:
        """The outputs named `output_names` for the batch's inputs."""

    def timed(self, batch: Batch) -> Callable[[], object]:
        """A call to time on `batch` that returns once the device is done with it. Host I/O: the whole `infer`
        (numpy in and out); a device-I/O runner prepares the inputs on the device here, outside the timed call."""
        return lambda: self.infer(batch)

    def label(self) -> str:
        """How the row reads in a table, e.g. "PyTorch eager fp32 · cuda · on device" ("· cpu" alone on the CPU)."""
        io = f" · {IO_LABELS[self.io]}" if self.device != "cpu" else ""
        return f"{self.engine or self.name} · {self.device}{io}"

    def describe(self) -> dict[str, Any]:
        """What a record says of the runner."""
        return {"label": self.label(), "device": self.device, "precision": self.precision,
                "providers": list(self.providers), "io": self.io}

    def close(self) -> None:
        """Release the runner's resources (nothing by default)."""

    def __enter__(self: R) -> R:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

"""A TensorRT engine behind the runner interface (Polygraphy's TrtRunner), switching profiles by input shape."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from workbench.core.errors import ShapeError
from workbench.graphs.profiles import profile_for
from workbench.graphs.tables import ShapeProfile
from workbench.models.batches import Batch
from workbench.runners import Device, Runner


class TrtEngineRunner(Runner):
    """Runs a serialized engine on the GPU; each call uses the first profile whose ranges hold the input shape and
    returns once the outputs are copied back to the host (Polygraphy's runner synchronizes its stream), so a timed
    call ends when the GPU is done, end to end like ONNX Runtime's numpy row."""

    device: Device = "cuda"

    def __init__(self, name: str, engine_path: Path, profiles: list[ShapeProfile], precision: str = "fp32") -> None:
        import tensorrt as trt
        from polygraphy.backend.trt import EngineFromBytes, TrtRunner

        self.name, self.precision, self.engine = name, precision, f"TensorRT {name}"
        self.profiles = profiles
        self.runner = TrtRunner(EngineFromBytes(Path(engine_path).read_bytes()), name=name)
        self.active = 0
        self.runner.activate()
        try:
            self.input_names = tuple(self.runner.get_input_metadata().keys())
            # Polygraphy's TrtRunner has no output metadata; the engine lists its I/O tensors.
            engine = self.runner.context.engine
            names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
            self.output_names = tuple(n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT)
        except BaseException:
            self.runner.deactivate()
            raise
        self.providers = ["TensorRT"]

    def infer(self, batch: Batch) -> dict[str, np.ndarray]:
        rows, length = batch.shape
        index = profile_for(self.profiles, rows, length)
        if index is None:
            ranges = "; ".join(f"batch {p.batch[0]}-{p.batch[2]}, sequence {p.sequence[0]}-{p.sequence[2]}"
                               for p in self.profiles)
            raise ShapeError(f"{self.name}: input batch {rows} x sequence {length} fits no profile ({ranges})",
                             "truncate or split the input, or rebuild the engine with wider batch/sequence ranges")
        if index != self.active:
            self.runner.set_profile(index)
            self.active = index
        outputs = self.runner.infer({name: batch.feed[name] for name in self.input_names})
        return {name: np.asarray(outputs[name]) for name in self.output_names}

    def close(self) -> None:
        if self.runner.is_active:
            self.runner.deactivate()

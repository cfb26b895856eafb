"""A TensorRT engine behind the runner interface (Polygraphy's TrtRunner), switching profiles by input shape."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from workbench.errors import ShapeError
from workbench.profiles import Profile, profile_for


class TrtEngineRunner:
    """Runs a serialized engine; each call uses the first profile whose ranges hold the input shape."""

    def __init__(self, name: str, engine_path: Path, profiles: list[Profile]) -> None:
        from polygraphy.backend.trt import EngineFromBytes, TrtRunner

        self.name = name
        self.profiles = profiles
        self.runner = TrtRunner(EngineFromBytes(Path(engine_path).read_bytes()), name=name)
        self.runner.activate()
        self.active = 0
        self.input_names = tuple(self.runner.get_input_metadata().keys())
        self.providers = ["TensorRT"]

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows, length = feed["input_ids"].shape
        index = profile_for(self.profiles, rows, length)
        if index is None:
            ranges = "; ".join(f"batch {p.batch[0]}-{p.batch[2]}, sequence {p.sequence[0]}-{p.sequence[2]}"
                               for p in self.profiles)
            raise ShapeError(f"{self.name}: input batch {rows} x sequence {length} fits no profile ({ranges})",
                             "truncate or split the input, or rebuild the engine with wider batch/sequence ranges")
        if index != self.active:
            self.runner.set_profile(index)
            self.active = index
        outputs = self.runner.infer({name: feed[name] for name in self.input_names})
        return {name: np.asarray(value) for name, value in outputs.items()}

    def close(self) -> None:
        self.runner.deactivate()

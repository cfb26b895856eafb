"""OpenVINO's CPU plugin behind the runner interface: the exported ONNX graph compiled by OpenVINO (which reads ONNX
itself and applies its own transformations), at f32 so it answers as the fp32 graph does."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from workbench.core.batches import Batch
from workbench.core.errors import DependencyMissingError
from workbench.graphs import onnxfiles
from workbench.runners import Runner, RunnerClosedError

if TYPE_CHECKING:
    from openvino import CompiledModel, InferRequest

# f32 inference precision (OpenVINO's default on a CPU with bf16 or AMX is bf16, beyond the fp32 gate), one stream at
# the latency hint, threads not pinned to cores (the Python model's instances and the tokenizer share them); the
# served Python model compiles with the same (serving/backend/ort_batches.py).
OPENVINO_CONFIG: dict[str, object] = {"INFERENCE_PRECISION_HINT": "f32", "NUM_STREAMS": 1,
                                      "PERFORMANCE_HINT": "LATENCY", "ENABLE_CPU_PINNING": False}
INSTALL = "pip install -e '.[openvino]' (`make env` installs it with its default EXTRAS)"


def openvino_problem() -> str | None:
    """Why OpenVINO cannot run here, or None."""
    try:
        import openvino  # noqa: F401
    except ImportError as exc:
        return f"OpenVINO is not installed ({exc})"
    return None


def compile_graph(path: Path | str, threads: int | None) -> CompiledModel:
    """The graph compiled for OpenVINO's CPU plugin with OPENVINO_CONFIG and `threads` inference threads (None: its
    default)."""
    problem = openvino_problem()
    if problem:
        raise DependencyMissingError(f"the OpenVINO variant needs OpenVINO: {problem}", INSTALL)
    import openvino

    config = {**OPENVINO_CONFIG, **({"INFERENCE_NUM_THREADS": threads} if threads else {})}
    return openvino.Core().compile_model(str(path), "CPU", config)


class OpenVinoRunner(Runner):
    """Runs one ONNX file with OpenVINO on the CPU, one infer request reused; `close()` drops the compiled model."""

    def __init__(self, name: str, path: Path | str, threads: int | None = None, precision: str = "fp32") -> None:
        import openvino

        self.name, self.precision, self.path = name, precision, Path(path)
        self.compiled: CompiledModel | None = compile_graph(path, threads)
        self.request: InferRequest | None = self.compiled.create_infer_request()
        graph = onnxfiles.load(path, load_external_data=False).graph  # a port's any-name can be an inner tensor's
        self.input_names = tuple(i.name for i in graph.input)
        self.output_names = tuple(o.name for o in graph.output)
        self.providers = [f"OpenVINO {openvino.__version__} CPU"]
        self.engine = f"OpenVINO {name}"

    def infer(self, batch: Batch) -> dict[str, np.ndarray]:
        if self.request is None:
            raise RunnerClosedError(f"{self.name}: the OpenVINO model of {self.path} is closed")
        results = self.request.infer({name: batch.feed[name] for name in self.input_names})
        return {name: np.array(results[name]) for name in self.output_names}

    def close(self) -> None:
        self.request = self.compiled = None

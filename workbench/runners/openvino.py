"""OpenVINO's CPU plugin behind the runner interface: the exported ONNX graph compiled by OpenVINO (which reads ONNX
itself and applies its own transformations), at the inference precision the file names (`onnxfiles.openvino_precision`:
f32, so the fp32 variant answers as the fp32 graph does, or bf16 for an int8 file's float ops where it ran faster)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from workbench.core.errors import DependencyMissingError
from workbench.graphs import onnxfiles
from workbench.models.batches import Batch
from workbench.runners import Runner, RunnerClosedError

if TYPE_CHECKING:
    from openvino import CompiledModel, InferRequest

# One stream at the latency hint, threads not pinned to cores (the Python model's instances and the tokenizer share
# them); the inference precision is the file's (f32 unless it names bf16: OpenVINO's own default on a CPU with bf16 is
# bf16, beyond the fp32 gate). The served Python model compiles with the same (serving/backend/ort_batches.py).
OPENVINO_CONFIG: dict[str, object] = {"NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY", "ENABLE_CPU_PINNING": False}
INSTALL = "pip install -e '.[openvino]' (`make env` installs it with its default EXTRAS)"


def openvino_problem() -> str | None:
    """Why OpenVINO cannot run here, or None."""
    try:
        import openvino  # noqa: F401
    except ImportError as exc:
        return f"OpenVINO is not installed ({exc})"
    return None


def bf16_problem() -> str | None:
    """Why OpenVINO cannot compute in bf16 on this CPU (its plugin lists no BF16 capability), or None."""
    import openvino

    if "BF16" in openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        return None
    return "this CPU has no bf16 instructions (OpenVINO's CPU plugin lists no BF16 capability)"


def compile_graph(path: Path | str, threads: int | None, precision: str | None = None) -> CompiledModel:
    """The graph compiled for OpenVINO's CPU plugin with OPENVINO_CONFIG, `threads` inference threads (None: its
    default) and the inference `precision` ("f32" or "bf16"; None: the one the file names)."""
    problem = openvino_problem()
    if problem:
        raise DependencyMissingError(f"the OpenVINO variant needs OpenVINO: {problem}", INSTALL)
    import openvino

    hint = precision or onnxfiles.openvino_precision(path)
    config = {**OPENVINO_CONFIG, "INFERENCE_PRECISION_HINT": hint,
              **({"INFERENCE_NUM_THREADS": threads} if threads else {})}
    return openvino.Core().compile_model(str(path), "CPU", config)


class OpenVinoRunner(Runner):
    """Runs one ONNX file with OpenVINO on the CPU, one infer request reused, at the file's inference precision or
    `inference_precision`; `close()` drops the compiled model."""

    def __init__(self, name: str, path: Path | str, threads: int | None = None, precision: str = "fp32",
                 inference_precision: str | None = None) -> None:
        import openvino

        self.name, self.precision, self.path = name, precision, Path(path)
        self.compiled: CompiledModel | None = compile_graph(path, threads, inference_precision)
        self.inference_precision = self.compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
        self.request: InferRequest | None = self.compiled.create_infer_request()
        graph = onnxfiles.skeleton(path).graph  # a port's any-name can be an inner tensor's
        self.input_names = tuple(i.name for i in graph.input)
        self.output_names = tuple(o.name for o in graph.output)
        self.providers = [f"OpenVINO {openvino.__version__} CPU ({self.inference_precision} inference precision)"]
        self.engine = f"OpenVINO {name}"

    def infer(self, batch: Batch) -> dict[str, np.ndarray]:
        if self.request is None:
            raise RunnerClosedError(f"{self.name}: the OpenVINO model of {self.path} is closed")
        results = self.request.infer({name: batch.feed[name] for name in self.input_names})
        return {name: np.array(results[name]) for name in self.output_names}

    def close(self) -> None:
        self.request = self.compiled = None

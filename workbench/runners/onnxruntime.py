"""ONNX Runtime sessions with the providers the run's device asks for."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from workbench.batches import Batch
from workbench.environment import gpu_name
from workbench.errors import GpuRequiredError, OnnxModelError
from workbench.runners import Runner, RunnerClosedError

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"


def cuda_usable() -> bool:
    """CUDA EP listed *and* a GPU present (onnxruntime-gpu lists CUDA even on machines without one)."""
    import onnxruntime

    return gpu_name() is not None and CUDA in onnxruntime.get_available_providers()


def providers_for(device: str) -> list[str]:
    if device == "cuda":
        if not cuda_usable():
            raise GpuRequiredError("device 'cuda' needs an NVIDIA GPU with onnxruntime-gpu; none was found",
                                   "run on a GPU host with the [gpu] extra, or set device: cpu")
        return [CUDA, CPU]
    if device == "auto" and cuda_usable():
        return [CUDA, CPU]
    return [CPU]


def tensorrt_providers(options: dict[str, Any]) -> list[Any]:
    """ONNX Runtime's TensorRT EP first (options from `engines.ort_tensorrt_options`), CUDA and CPU for the rest."""
    import onnxruntime

    if not cuda_usable() or TENSORRT not in onnxruntime.get_available_providers():
        raise GpuRequiredError("ONNX Runtime's TensorRT execution provider needs an NVIDIA GPU and onnxruntime-gpu "
                               "built with TensorRT; none was found",
                               "run on a GPU host with the [gpu] extra, or use the CPU/CUDA variants")
    return [(TENSORRT, options), CUDA, CPU]


def session(path: Path | str, providers: list[Any], threads: int | None = None) -> Any:
    """An InferenceSession; a file ORT cannot load is an OnnxModelError."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    # Idle worker threads spinning for work steal the CPU from whatever runs next (another session, PyTorch, a
    # tokenizer process); on a few cores that distorts every interleaved measurement, so they sleep instead.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    try:
        return onnxruntime.InferenceSession(str(path), sess_options=options, providers=providers)
    except (onnxruntime.capi.onnxruntime_pybind11_state.Fail,
            onnxruntime.capi.onnxruntime_pybind11_state.InvalidGraph,
            onnxruntime.capi.onnxruntime_pybind11_state.InvalidProtobuf,
            onnxruntime.capi.onnxruntime_pybind11_state.NoSuchFile) as exc:
        raise OnnxModelError(f"ONNX Runtime cannot load {path}: {exc}", "re-run the step that wrote it") from None


class OrtRunner(Runner):
    """Runs one ONNX file; `providers` records what the session really uses; `close()` drops the session."""

    def __init__(self, name: str, path: Path | str, providers: list[Any], threads: int | None = None) -> None:
        self.name = name
        self.path = Path(path)
        self.session: Any = session(path, providers, threads)
        self.input_names = tuple(i.name for i in self.session.get_inputs())
        self.output_names = tuple(o.name for o in self.session.get_outputs())
        self.providers = self.session.get_providers()

    def infer(self, batch: Batch) -> dict[str, np.ndarray]:
        if self.session is None:
            raise RunnerClosedError(f"{self.name}: the ONNX Runtime session of {self.path} is closed")
        outputs = self.session.run(None, {name: batch.feed[name] for name in self.input_names})
        return dict(zip(self.output_names, outputs))

    def close(self) -> None:
        self.session = None

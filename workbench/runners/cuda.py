"""Whether ONNX Runtime really runs on CUDA here, and why not: a probe session, never the provider list alone."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from workbench.core.machine import gpu_name

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"


def cuda_usable() -> bool:
    """A session really runs on CUDA here (a probe session, never `get_available_providers()`: onnxruntime-gpu lists
    CUDA even where its libraries or a GPU are missing, and then runs everything on the CPU)."""
    return cuda_problem() is None


@lru_cache(maxsize=1)
def cuda_problem() -> str | None:
    """Why ONNX Runtime cannot run on CUDA here, or None when a probe session was created on CUDA."""
    import onnxruntime

    if CUDA not in onnxruntime.get_available_providers():
        return (f"this ONNX Runtime build (onnxruntime {onnxruntime.__version__}) has no CUDA provider: install the "
                "[gpu] extra (onnxruntime-gpu with its cuda and cudnn extras) in place of onnxruntime")
    if gpu_name() is None:
        return "no NVIDIA GPU (nvidia-smi found none)"
    _preload_cuda_libraries()
    probe = onnxruntime.InferenceSession(_probe_model(), providers=[CUDA, CPU])
    if CUDA in probe.get_providers():
        return None
    return f"ONNX Runtime's CUDA provider did not load: {_provider_load_error()}"


def _preload_cuda_libraries() -> None:
    """Load CUDA and cuDNN from the nvidia-* pip packages the [gpu] extra installs (no system CUDA needed)."""
    import onnxruntime

    if hasattr(onnxruntime, "preload_dlls"):
        try:
            onnxruntime.preload_dlls()
        except Exception:  # noqa: BLE001 - a failed preload shows as the provider's own load error below
            pass


def _provider_load_error() -> str:
    """The dynamic loader's reason the CUDA provider library does not load (it names the missing library)."""
    import ctypes

    import onnxruntime

    library = Path(onnxruntime.__file__).parent / "capi" / "libonnxruntime_providers_cuda.so"
    if not library.exists():
        return f"{library.name} is not in {library.parent}"
    try:
        ctypes.CDLL(str(library))
    except OSError as exc:
        return f"{exc}; the pinned onnxruntime-gpu needs CUDA 13 and cuDNN 9 (the [gpu] extra installs them)"
    return "the library loads, yet the session fell back to the CPU (see ONNX Runtime's log above)"


def _probe_model() -> bytes:
    """A one-node float model, enough for ONNX Runtime to place a node on a provider."""
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()

"""What the run ran on: versions, CPU, GPU (or none) and ONNX Runtime providers."""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import time
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

from workbench.core.results import CpuFeatures

PACKAGES = ("torch", "transformers", "onnx", "onnxruntime", "onnxruntime-gpu", "tensorrt", "polygraphy",
            "tritonclient", "nvidia-pytriton", "ctranslate2", "numpy")


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpuinfo(field: str) -> str | None:
    """The first `field` line's value in /proc/cpuinfo (None where there is none, e.g. not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


NODE_VARIABLE = "WORKBENCH_NODE"  # a sweep cell's run reads the cluster node it runs on from here (JSON)

# The instruction-set features that decide how fast int8 (and fp32) matmuls run on a CPU.
SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16",
               "amx_tile", "amx_int8", "amx_bf16")
# Best first: the int8 matmul instructions ONNX Runtime's kernels use when the CPU has them.
INT8_INSTRUCTIONS = (("amx_int8", "AMX"), ("avx512_vnni", "AVX-512 VNNI"), ("avx_vnni", "AVX-VNNI"))


def cpu_flags() -> set[str]:
    return set((_cpuinfo("flags") or "").split())


def cpu_features(flags: set[str] | None = None) -> CpuFeatures:
    """The speed-relevant flags this CPU has, and its best int8 dot-product instructions (None: none of them)."""
    flags = cpu_flags() if flags is None else flags
    int8 = next((name for flag, name in INT8_INSTRUCTIONS if flag in flags), None)
    return CpuFeatures(flags=[f for f in SPEED_FLAGS if f in flags], int8_dot_product=int8)


GPU_FINDING = "NVIDIA GPU"  # what `workbench doctor` calls the GPU among its findings


@lru_cache(maxsize=1)
def gpu_name() -> str | None:
    """Name of the first NVIDIA GPU that nvidia-smi reports, or None when there is none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    names = [line.strip() for line in out.splitlines() if line.strip()]
    return names[0] if names else None


def collect_environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_features": cpu_features().recorded(),
        "gpu": gpu_name(),
        "packages": {name: version for name in PACKAGES if (version := package_version(name))},
    }
    node = os.environ.get(NODE_VARIABLE)
    if node:
        env["node"] = json.loads(node)
    try:
        import onnxruntime

        env["onnxruntime"] = {"available_providers": onnxruntime.get_available_providers(), "providers_used": []}
    except ImportError:
        env["onnxruntime"] = None
    return env


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


def _busy_seconds() -> float | None:
    """CPU seconds all processes have spent busy since boot, from /proc/stat (None where there is none)."""
    try:
        with open("/proc/stat", encoding="utf-8") as handle:
            fields = handle.readline().split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class OthersBusy:
    """How many cores other processes kept busy while the `with` block ran (`cores`, set on leaving it): the cores
    busy in all, less this process's own CPU time, all its threads included. The 1-minute load average where
    /proc/stat is missing."""

    cores: float = 0.0
    _start: float | None
    _own: os.times_result
    _wall: float

    def __enter__(self) -> OthersBusy:
        self._start, self._own, self._wall = _busy_seconds(), os.times(), time.monotonic()
        return self

    def __exit__(self, *_: object) -> None:
        if self._start is None:
            self.cores = os.getloadavg()[0]
            return
        end, now = _busy_seconds() or self._start, os.times()
        own = (now.user + now.system) - (self._own.user + self._own.system)
        self.cores = max(0.0, (end - self._start - own) / max(time.monotonic() - self._wall, 1e-3))


def too_busy(others: float) -> str:
    """"other work kept X of N cores busy" where `others` (cores) is more than half this host's cores, else ""."""
    cores = os.cpu_count() or 1
    return f"other work kept {others:.1f} of {cores} cores busy" if others > cores / 2 else ""


def others_busy(seconds: float = 1.0) -> float:
    """How many cores other processes kept busy over the next `seconds`, this process idle meanwhile: unlike the
    load average, it does not count the work this process itself has just done."""
    with OthersBusy() as others:
        time.sleep(seconds)
    return others.cores


def release_memory() -> None:
    """Give the memory freed since the last call back to the system (the garbage collector, then glibc's
    malloc_trim): after a step drops a large graph, its pages would otherwise stay with the process."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc and platform.system() == "Linux":
        try:
            ctypes.CDLL(libc).malloc_trim(0)
        except (OSError, AttributeError):
            pass  # not glibc: nothing to trim

"""What the run ran on: versions, CPU, GPU (or none) and ONNX Runtime providers."""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from functools import lru_cache
from importlib import metadata
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

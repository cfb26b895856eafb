"""What the run ran on: versions, CPU, GPU (or none) and ONNX Runtime providers."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
from functools import lru_cache
from importlib import metadata
from typing import Any

PACKAGES = ("torch", "transformers", "onnx", "onnxruntime", "onnxruntime-gpu", "tensorrt", "polygraphy",
            "tritonclient", "nvidia-pytriton", "ctranslate2", "numpy")


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
        "gpu": gpu_name(),
        "packages": {name: version for name in PACKAGES if (version := package_version(name))},
    }
    try:
        import onnxruntime

        env["onnxruntime"] = {"available_providers": onnxruntime.get_available_providers(), "providers_used": []}
    except ImportError:
        env["onnxruntime"] = None
    return env

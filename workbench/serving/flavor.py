"""The Triton flavor a deployment is served by, spelled once (the configuration, the serving plan and the
recorded results name it)."""
from __future__ import annotations

from enum import Enum


class Flavor(str, Enum):
    """How Triton runs the network: the one place these names are spelled."""

    ONNXRUNTIME = "onnxruntime"  # Triton's ONNX Runtime backend (C++), on the CPU or a GPU
    TENSORRT_PLAN = "tensorrt_plan"  # a TensorRT engine (GPU)
    PYTHON_ORT = "python-ort"  # a Python-backend model running onnxruntime: what CPU-only Triton builds serve

    @property
    def artifact_kind(self) -> str:
        """The kind of run artifact it serves: an engine, or an ONNX file."""
        return "engine" if self is Flavor.TENSORRT_PLAN else "onnx"

"""The runner for a variant's file: OpenVINO for the variant whose file says so (`onnxfiles.runtime`), ONNX Runtime
on the run's device for every other."""
from __future__ import annotations

from workbench.core.record import Variant
from workbench.graphs import onnxfiles
from workbench.runners import Runner
from workbench.runners.onnxruntime import OrtRunner, SessionSettings, providers_for
from workbench.runners.openvino import OpenVinoRunner


def open_variant(variant: Variant, device: str, threads: int | None, settings: SessionSettings | None = None) -> Runner:
    """`variant`'s runner: OpenVINO on the CPU, or ONNX Runtime with the providers of `device` (and `settings`)."""
    if onnxfiles.runtime(variant.path) == "openvino":
        return OpenVinoRunner(variant.name, variant.path, threads, variant.precision)
    return OrtRunner(variant.name, variant.path, providers_for(device), threads, settings, variant.precision)

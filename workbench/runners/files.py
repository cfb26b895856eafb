"""The runner for a variant's file: OpenVINO for the variant whose file says so (`onnxfiles.runtime`), ONNX Runtime
on the run's device for every other."""
from __future__ import annotations

from pathlib import Path

from workbench.graphs import onnxfiles
from workbench.runners import Runner
from workbench.runners.onnxruntime import OrtRunner, SessionSettings, providers_for
from workbench.runners.openvino import OpenVinoRunner


def open_variant(name: str, path: Path, device: str, threads: int | None, precision: str = "fp32",
                 settings: SessionSettings | None = None) -> Runner:
    """`name`'s runner: OpenVINO on the CPU, or ONNX Runtime with the providers of `device` (and `settings`)."""
    if onnxfiles.runtime(path) == "openvino":
        return OpenVinoRunner(name, path, threads, precision)
    return OrtRunner(name, path, providers_for(device), threads, settings, precision)

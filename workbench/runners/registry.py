"""The runners a variant's file can be run by, one record each: the files it opens (the runtime an ONNX file's
metadata names, `onnxfiles.runtime`, or a variant folder's `workbench.json`), the devices and precisions it runs,
and what the latency grid may do with it. Opening a variant (`open_variant`), the grid's rows and the served model's
runtime ask this registry; adding a runner is one `RunnerKind` here and its module (docs/contributing.md)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from workbench.core.record import Variant
from workbench.graphs import onnxfiles
from workbench.models.errors import UnsupportedModelError
from workbench.runners import Device, Runner, folder_metadata
from workbench.runners.onnxruntime import SessionSettings

Opener = Callable[[Variant, str, int | None, SessionSettings | None], Runner]


@dataclass(frozen=True)
class RunnerKind:
    """A runner of variant files: `runtime`, the value of the file's runtime metadata it opens; `devices` and
    `precisions` it runs; `files`: what a variant of it is (an ONNX file, or a folder with its `workbench.json`);
    `tuned`: the grid measures its session settings first (`measure.sessions.tune`); `bound`:
    on CUDA the grid also times it with inputs and outputs bound on the device (`<variant>@device`)."""

    runtime: str
    devices: tuple[Device, ...]
    precisions: tuple[str, ...]
    opens: Opener
    files: Literal["onnx", "folder"] = "onnx"
    tuned: bool = False
    bound: bool = False


def _onnxruntime(variant: Variant, device: str, threads: int | None, settings: SessionSettings | None) -> Runner:
    from workbench.runners.onnxruntime import OrtRunner, providers_for

    return OrtRunner(variant.name, variant.path, providers_for(device), threads, settings, variant.precision)


def _ctranslate2(variant: Variant, device: str, threads: int | None, settings: SessionSettings | None) -> Runner:
    from workbench.runners.ctranslate2 import Ct2EncoderRunner

    on: Device = "cuda" if device == "cuda" else "cpu"
    return Ct2EncoderRunner(variant.name, variant.path, threads, variant.precision, on)


def _openvino(variant: Variant, device: str, threads: int | None, settings: SessionSettings | None) -> Runner:
    from workbench.runners.openvino import OpenVinoRunner

    return OpenVinoRunner(variant.name, variant.path, threads, variant.precision)


RUNNERS = {kind.runtime: kind for kind in (
    RunnerKind("onnxruntime", ("cpu", "cuda"), ("fp32", "fp16", "int8"), _onnxruntime, tuned=True, bound=True),
    RunnerKind("openvino", ("cpu",), ("fp32", "bf16", "int8"), _openvino),
    RunnerKind("ctranslate2", ("cpu", "cuda"), ("fp32", "int8"), _ctranslate2, files="folder"),
)}


def runner_kind(path: Path) -> RunnerKind:
    """The registered runner of the file (or variant folder) at `path`; UnsupportedModelError where its metadata
    names another."""
    runtime = str(folder_metadata(path).get("runtime", "none")) if path.is_dir() else onnxfiles.runtime(path)
    kind = RUNNERS.get(runtime)
    if kind is None:
        raise UnsupportedModelError(f"{path} asks for the runtime {runtime!r}, which no registered runner runs "
                                    f"(registered: {', '.join(RUNNERS)})",
                                    "rebuild the variant with this workbench, or register its runner in "
                                    "workbench/runners/registry.py")
    if kind.files != ("folder" if path.is_dir() else "onnx"):
        opens = "a variant folder" if kind.files == "folder" else "an ONNX file"
        raise UnsupportedModelError(f"{path} asks for {runtime}, which opens {opens}",
                                    "rebuild the variant with this workbench")
    return kind


def open_variant(variant: Variant, device: str, threads: int | None, settings: SessionSettings | None = None) -> Runner:
    """`variant`'s runner, as its file's registered runner opens it (ONNX Runtime with the providers of `device`
    and `settings`; OpenVINO on the CPU): on the run's device (`auto`: the runner's choice) where the runner runs
    there, else on the first device it declares (the runner's `device` says where it ran); UnsupportedModelError
    where it does not run the variant's precision."""
    kind = runner_kind(variant.path)
    if variant.precision not in kind.precisions:
        raise UnsupportedModelError(f"{variant.name} is {variant.precision}, which {kind.runtime} does not run here "
                                    f"(it runs {', '.join(kind.precisions)})",
                                    f"serve or measure another variant than {variant.name}")
    return kind.opens(variant, device if device in ("auto", *kind.devices) else kind.devices[0], threads, settings)

"""`workbench doctor`: what this machine has (GPU, runtimes, tools, libraries, with versions), what it lacks and how
to get it, and which steps can run here. Quick by design: import checks and `--version` calls with a timeout, no
model loads."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

from workbench.core.machine import GPU_FINDING, gpu_name, package_version
from workbench.measure.perf_analyzer import find_perf_analyzer
from workbench.models.pins import pin
from workbench.runners.onnxruntime import CPU, CUDA, TENSORRT
from workbench.runners.openvino import INSTALL as OPENVINO_INSTALL
from workbench.serving.errors import TritonNotFoundError
from workbench.serving.server import find_tritonserver
from workbench.steps import specs

GPU = GPU_FINDING
NEEDS_GPU = "needs an NVIDIA GPU"
GPU_EXTRA = "pip install -e '.[gpu]'"
GENERATION_EXTRA = "pip install -e '.[generation]'"
TOOL_TIMEOUT_S = 10


@dataclass(frozen=True)
class Finding:
    """One check's answer: `name` found (its version, details) or missing (why, and the fix)."""

    name: str
    available: bool
    version: str | None = None
    detail: str = ""
    reason: str = ""
    fix: str = ""

    def line(self) -> str:
        status = "found" if self.available else "missing"
        text = self.detail if self.available else f"{self.reason}; fix: {self.fix}"
        return f"{self.name:24s} {status:8s} {self.version or '-':22s} {text}".rstrip()


@dataclass(frozen=True)
class StepSupport:
    """Whether a pipeline step can run on this machine, and if not, what it lacks."""

    step: str
    runs: bool
    reason: str = ""

    def line(self) -> str:
        return f"{self.step:12s} {'runs here' if self.runs else f'skipped here: {self.reason}'}"


def _gpu_fix(install: str) -> str:
    """`install` on a machine with a GPU; without one, first of all: it needs one."""
    return install if gpu_name() else f"{NEEDS_GPU}; there: {install}"


def _tool_output(command: list[str], pattern: str, env: dict[str, str] | None = None) -> str | None:
    """The first group of `pattern` in what `command` prints; None when it fails, times out or prints no match."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, env=env)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(pattern, done.stdout + done.stderr)
    return match.group(1) if match else None


def _distribution(name: str, fix: str | None = None) -> Finding:
    """A pure-Python library: installed or not (its metadata, no import)."""
    version = package_version(name)
    if version:
        return Finding(name, True, version)
    return Finding(name, False, reason="not installed", fix=fix or f"pip install {pin(name)}")


def check_gpu() -> Finding:
    name = gpu_name()
    if name:
        return Finding(GPU, True, detail=name)
    reason = "nvidia-smi lists no GPU" if shutil.which("nvidia-smi") else "no nvidia-smi on PATH"
    return Finding(GPU, False, reason=reason, fix=f"{NEEDS_GPU}: run the GPU steps on an NVIDIA host, e.g. "
                   "`workbench run --resume --output-dir <run> --steps tensorrt`")


def check_torch() -> Finding:
    version = package_version("torch")
    if version is None:
        return Finding("torch", False, reason="not installed", fix=f"pip install {pin('torch')}")
    import torch

    if torch.version.cuda is None:
        return Finding("torch", True, version, "torch.cuda: CPU-only build")
    visible = "a GPU visible" if torch.cuda.is_available() else "no GPU visible"
    return Finding("torch", True, version, f"torch.cuda: CUDA {torch.version.cuda}, {visible}")


def check_transformers() -> Finding:
    return _distribution("transformers")


def check_onnx() -> Finding:
    return _distribution("onnx")


def check_polygraphy() -> Finding:
    return _distribution("polygraphy")


def check_openvino() -> Finding:
    """Optional: the optimize step tries the OpenVINO variant where it is installed."""
    return _distribution("openvino", fix=f"optional, for the OpenVINO variant: {OPENVINO_INSTALL}")


def _onnxruntime_build() -> str | None:
    """The installed ONNX Runtime distribution: onnxruntime-gpu, onnxruntime (CPU) or None."""
    return next((name for name in ("onnxruntime-gpu", "onnxruntime") if package_version(name)), None)


def check_onnxruntime() -> Finding:
    build = _onnxruntime_build()
    if build is None:
        return Finding("onnxruntime", False, reason="not installed",
                       fix="pip install -e '.[cpu]' (or '.[gpu]' on an NVIDIA GPU host)")
    import onnxruntime

    providers = ", ".join(onnxruntime.get_available_providers())
    return Finding("onnxruntime", True, onnxruntime.__version__, f"{build}; providers: {providers}")


def _provider(label: str, provider: str) -> Finding:
    """ONNX Runtime's `provider`: in the installed build, and (CUDA, TensorRT) with a GPU to run on."""
    name = f"onnxruntime {label} EP"
    build = _onnxruntime_build()
    if build is None:
        return Finding(name, False, reason="onnxruntime is not installed", fix="pip install -e '.[cpu]'")
    import onnxruntime

    listed = provider in onnxruntime.get_available_providers()
    if listed and (provider == CPU or gpu_name()):
        return Finding(name, True, onnxruntime.__version__, provider)
    if listed:
        return Finding(name, False, reason=f"{build} has {provider} but there is no GPU to run it", fix=NEEDS_GPU)
    return Finding(name, False, reason=f"the installed build ({build}) has no {provider}",
                   fix=_gpu_fix(f"{GPU_EXTRA} (onnxruntime-gpu in place of onnxruntime)"))


def check_cpu_provider() -> Finding:
    return _provider("CPU", CPU)


def check_cuda_provider() -> Finding:
    """Listed is not enough: a probe session must really run on CUDA."""
    listed = _provider("CUDA", CUDA)
    if not listed.available:
        return listed
    from workbench.runners.cuda import cuda_problem

    problem = cuda_problem()
    if problem is None:
        return Finding(listed.name, True, listed.version, f"{CUDA} (a probe session ran on it)")
    return Finding(listed.name, False, reason=problem, fix=_gpu_fix(f"{GPU_EXTRA} (onnxruntime-gpu[cuda,cudnn])"))


def check_tensorrt_provider() -> Finding:
    return _provider("TensorRT", TENSORRT)


def check_tensorrt() -> Finding:
    try:
        import tensorrt
    except (ImportError, OSError) as exc:
        installed = package_version("tensorrt") is not None
        return Finding("tensorrt", False, reason=f"installed but cannot load ({exc})" if installed else "not installed",
                       fix=_gpu_fix(f"{GPU_EXTRA} (tensorrt from NVIDIA's index)"))
    return Finding("tensorrt", True, tensorrt.__version__)


def check_trtexec() -> Finding:
    path = shutil.which("trtexec")
    if path is None:
        return Finding("trtexec", False, reason="not on PATH (the tensorrt wheel does not ship it; the tensorrt step "
                       "builds through the Python API without it)",
                       fix=_gpu_fix("NVIDIA's TensorRT container, or the TensorRT tarball's bin/ on PATH"))
    return Finding("trtexec", True, _tool_output([path, "--help"], r"\[TensorRT (v\d+)\]"), path)


def check_tritonserver() -> Finding:
    try:
        binary = find_tritonserver()
    except TritonNotFoundError as missing:
        return Finding("tritonserver", False, reason=missing.problem, fix=missing.fix)
    if binary.origin == "PATH":  # NVIDIA's Triton containers name their server's version in the environment
        return Finding("tritonserver", True, os.environ.get("TRITON_SERVER_VERSION"), str(binary.executable))
    return Finding("tritonserver", True, f"nvidia-pytriton {package_version('nvidia-pytriton')}",
                   f"{binary.executable} (bundled: Python backend only)")


def check_perf_analyzer() -> Finding:
    tool = find_perf_analyzer()
    if tool is None:
        return Finding("perf_analyzer", False, reason="not installed (served sweeps use the asyncio load generator "
                       "unless bench.load_tool=perf_analyzer)", fix="workbench install-perf-analyzer")
    version = _tool_output([str(tool.executable), "--version"], r"Version (\S+)", tool.environment())
    return Finding("perf_analyzer", True, version, str(tool.executable))


def check_ctranslate2() -> Finding:
    try:
        import ctranslate2
    except ImportError:
        return Finding("ctranslate2", False, reason="not installed", fix=GENERATION_EXTRA)
    return Finding("ctranslate2", True, ctranslate2.__version__)


CHECKS: tuple[Callable[[], Finding], ...] = (
    check_gpu, check_torch, check_transformers, check_onnx, check_onnxruntime, check_cpu_provider, check_openvino,
    check_cuda_provider, check_tensorrt_provider, check_tensorrt, check_trtexec, check_polygraphy,
    check_tritonserver, check_perf_analyzer, check_ctranslate2,
)


def run_checks() -> list[Finding]:
    return [check() for check in CHECKS]


def step_support(findings: list[Finding]) -> list[StepSupport]:
    """Each step in run order: runs here, or skipped for what it lacks (a missing GPU outranks the rest)."""
    missing = {finding.name for finding in findings if not finding.available}
    support = []
    for step in specs():
        lacking = [name for name in step.machine if name in missing]
        reason = NEEDS_GPU if GPU in lacking else f"needs {' and '.join(lacking)}" if lacking else ""
        support.append(StepSupport(step.name, not lacking, reason))
    return support

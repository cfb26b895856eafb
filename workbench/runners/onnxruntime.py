"""ONNX Runtime sessions with the providers the run's device asks for."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from workbench.core.errors import GpuRequiredError, ShapeError
from workbench.graphs import onnxfiles
from workbench.graphs.errors import OnnxModelError
from workbench.models.batches import Batch
from workbench.runners import IO, Device, Runner, RunnerClosedError
from workbench.runners.cuda import CPU, CUDA, cuda_problem, cuda_usable
from workbench.runners.errors import CudaFallbackError

OPTIMIZATION_LEVELS = ("all", "extended", "basic")
EXECUTION_MODES = ("sequential", "parallel")
TENSORRT = "TensorrtExecutionProvider"
# fp32 math stays fp32 on the GPU: ONNX Runtime's CUDA provider otherwise multiplies fp32 matrices in TF32 on Ampere
# and later (a 10-bit mantissa: 4e-3 off on MiniLM's token embeddings on an H100, beyond the fp32 gate).
FP32_MATH = {"use_tf32": "0"}


@dataclass(frozen=True)
class SessionSettings:
    """How ONNX Runtime runs a variant's session. The default: idle threads sleep, every graph optimization,
    sequential execution."""

    threads: int | None = None  # intra-op threads; None: ONNX Runtime's default (all cores)
    spinning: bool = False
    optimization: Literal["all", "extended", "basic", "disabled"] = "all"
    execution: Literal["sequential", "parallel"] = "sequential"
    cuda: tuple[tuple[str, str], ...] = ()  # CUDA provider options (name, value); none: ONNX Runtime's defaults
    # The CPU memory arena keeps the most a run ever needed, grown in powers of two; without it a parity check's
    # largest batch gives its memory back (all-mpnet-base-v2's int8 on the lab: 1.9 -> 1.2 GB over the weights).
    arena: bool = True

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> SessionSettings:
        """The settings a record holds (`record`); older records have no CUDA options."""
        return cls(**{**data, "cuda": tuple((str(k), str(v)) for k, v in data.get("cuda", ()))})

    def providers(self, providers: list[Any]) -> list[Any]:
        """`providers` with these CUDA options on the CUDA provider, over FP32_MATH and under options it already
        has."""
        merged = []
        for provider in providers:
            name, options = provider if isinstance(provider, tuple) else (provider, {})
            merged.append((name, {**FP32_MATH, **dict(self.cuda), **options}) if name == CUDA else provider)
        return merged

    def apply(self, options: Any) -> None:
        """Set these on an `onnxruntime.SessionOptions`."""
        import onnxruntime

        # Idle worker threads spinning for work steal the CPU from whatever runs next (another session, PyTorch, a
        # tokenizer process); on a few cores that distorts every interleaved measurement, so they sleep by default.
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.spinning else "0")
        if self.threads:
            options.intra_op_num_threads = self.threads
            options.inter_op_num_threads = 1
        levels = {"all": onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL,
                  "extended": onnxruntime.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                  "basic": onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                  "disabled": onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL}
        options.graph_optimization_level = levels[self.optimization]
        options.enable_cpu_mem_arena = self.arena
        options.execution_mode = (onnxruntime.ExecutionMode.ORT_PARALLEL if self.execution == "parallel"
                                  else onnxruntime.ExecutionMode.ORT_SEQUENTIAL)

    def label(self) -> str:
        if self.cuda:
            return ", ".join(f"{name}={value}" for name, value in self.cuda)
        threads = f"{self.threads} thread{'s' * (self.threads != 1)}" if self.threads else "default threads"
        return (f"{threads}, spinning {'on' if self.spinning else 'off'}, "
                f"{self.optimization} optimizations, {self.execution}")

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "cuda": [list(option) for option in self.cuda]}


def _why_missing(providers: list[str]) -> str:
    if CUDA in providers and cuda_problem():
        return str(cuda_problem())
    return ("ONNX Runtime's TensorRT provider did not load: it needs TensorRT's libnvinfer (the tensorrt pip "
            "packages or NVIDIA's container)" if TENSORRT in providers else "see ONNX Runtime's log above")


def providers_for(device: str) -> list[str]:
    if device == "cuda":
        problem = cuda_problem()
        if problem is not None:
            raise GpuRequiredError(f"device 'cuda' needs ONNX Runtime on CUDA: {problem}",
                                   "run on a GPU host installed with the [gpu] extra, or set device: cpu")
        return [CUDA, CPU]
    if device == "auto" and cuda_usable():
        return [CUDA, CPU]
    return [CPU]


def device_for(device: str) -> Device:
    """Where the run's ONNX Runtime sessions run for the `device` setting: cuda when they run on CUDA."""
    return "cuda" if CUDA in providers_for(device) else "cpu"


def tensorrt_providers(options: dict[str, str | int | bool]) -> list[Any]:
    """ONNX Runtime's TensorRT EP first (options from `engines.ort_tensorrt_options`), CUDA and CPU for the rest."""
    import onnxruntime

    if not cuda_usable() or TENSORRT not in onnxruntime.get_available_providers():
        raise GpuRequiredError("ONNX Runtime's TensorRT execution provider needs an NVIDIA GPU and onnxruntime-gpu "
                               "built with TensorRT; none was found",
                               "run on a GPU host with the [gpu] extra, or use the CPU/CUDA variants")
    return [(TENSORRT, options), CUDA, CPU]


def session(path: Path | str, providers: list[Any], threads: int | None = None,
            settings: SessionSettings | None = None) -> Any:
    """An InferenceSession with `settings` (default: `threads` threads that sleep when idle); a file ORT cannot load
    is an OnnxModelError."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    settings = settings or SessionSettings(threads)
    settings.apply(options)
    providers = settings.providers(providers)
    try:
        created = onnxruntime.InferenceSession(str(path), sess_options=options, providers=providers,
                                               disabled_optimizers=onnxfiles.disabled_optimizers(path))
    except (onnxruntime.capi.onnxruntime_pybind11_state.Fail,
            onnxruntime.capi.onnxruntime_pybind11_state.InvalidGraph,
            onnxruntime.capi.onnxruntime_pybind11_state.InvalidProtobuf,
            onnxruntime.capi.onnxruntime_pybind11_state.NoSuchFile) as exc:
        raise OnnxModelError(f"ONNX Runtime cannot load {path}: {exc}", "re-run the step that wrote it") from None
    asked = [p[0] if isinstance(p, tuple) else p for p in providers]
    missing = [p for p in asked if p != CPU and p not in created.get_providers()]
    if missing:  # ONNX Runtime falls back to the CPU silently: a GPU run must not become a slow CPU run
        raise CudaFallbackError(f"the session for {path} was asked for {', '.join(missing)} and fell back to "
                                f"{', '.join(created.get_providers())}: {_why_missing(missing)}",
                                "install the [gpu] extra on an NVIDIA host (`workbench doctor` checks it), or set "
                                "device: cpu")
    return created


class OrtRunner(Runner):
    """Runs one ONNX file; `providers` records what the session really uses; `close()` drops the session.

    `io` host: numpy arrays in and out of every call. `io` device: I/O binding, the batch's inputs copied to the
    session's device once per batch (`timed`) and its outputs left there (CPU OrtValues on the CPU, CUDA memory on
    CUDA); `infer` reads them back, so a parity check still compares what a user gets."""

    def __init__(self, name: str, path: Path | str, providers: list[Any], threads: int | None = None,
                 settings: SessionSettings | None = None, precision: str = "fp32", io: IO = "host") -> None:
        self.name, self.precision, self.io = name, precision, io
        self.path = Path(path)
        self.session: Any = session(path, providers, threads, settings)
        self.input_names = tuple(i.name for i in self.session.get_inputs())
        self.output_names = tuple(o.name for o in self.session.get_outputs())
        self.providers = self.session.get_providers()
        self.device = "cuda" if CUDA in self.providers or TENSORRT in self.providers else "cpu"
        self.engine = f"ONNX Runtime {name.split('@')[0]}"

    def _session(self) -> Any:
        if self.session is None:
            raise RunnerClosedError(f"{self.name}: the ONNX Runtime session of {self.path} is closed")
        return self.session

    def bind(self, batch: Batch) -> Any:
        """An I/O binding of `batch`: its inputs copied to the session's device now, outputs allocated there."""
        from onnxruntime import OrtValue

        binding = self._session().io_binding()
        for name in self.input_names:
            binding.bind_ortvalue_input(name, OrtValue.ortvalue_from_numpy(batch.feed[name], self.device, 0))
        for name in self.output_names:
            binding.bind_output(name, self.device)
        return binding

    def infer(self, batch: Batch) -> dict[str, np.ndarray]:
        if self.io == "host":
            outputs = self._session().run(None, {name: batch.feed[name] for name in self.input_names})
            return dict(zip(self.output_names, outputs))
        binding = self.bind(batch)
        self._session().run_with_iobinding(binding)
        return dict(zip(self.output_names, binding.copy_outputs_to_cpu()))

    def timed(self, batch: Batch) -> Callable[[], object]:
        if self.io == "host":
            return super().timed(batch)
        binding, session = self.bind(batch), self._session()

        def call() -> object:
            session.run_with_iobinding(binding)
            binding.synchronize_outputs()  # returns once the device has written them
            return binding
        return call

    def close(self) -> None:
        self.session = None


class CudaGraphRunner(Runner):
    """One fixed-shape batch replayed as a CUDA graph ONNX Runtime captured (`enable_cuda_graph`): inputs and outputs
    in device buffers bound once at fixed addresses, as the capture requires. Where ONNX Runtime refuses the graph
    (a node outside the CUDA provider, a shape it cannot fix) the constructor raises with its reason."""

    def __init__(self, name: str, path: Path | str, batch: Batch, output_shapes: dict[str, tuple[int, ...]],
                 settings: SessionSettings | None = None, precision: str = "fp32") -> None:
        from onnxruntime import OrtValue

        self.name, self.precision, self.device, self.io = name, precision, "cuda", "device"
        self.engine = f"ONNX Runtime {name.split('@')[0]} CUDA graph"
        self.shape = batch.shape
        self.session: Any = session(path, [(CUDA, {"enable_cuda_graph": "1"}), CPU], settings=settings)
        self.providers = self.session.get_providers()
        self.input_names = tuple(i.name for i in self.session.get_inputs())
        self.output_names = tuple(o.name for o in self.session.get_outputs())
        self.inputs = {n: OrtValue.ortvalue_from_numpy(batch.feed[n], "cuda", 0) for n in self.input_names}
        self.outputs = {n: OrtValue.ortvalue_from_shape_and_type(list(output_shapes[n]), np.float32, "cuda", 0)
                        for n in self.output_names}
        self.binding = self.session.io_binding()
        for name, value in self.inputs.items():
            self.binding.bind_ortvalue_input(name, value)
        for name, value in self.outputs.items():
            self.binding.bind_ortvalue_output(name, value)
        self.session.run_with_iobinding(self.binding)  # the first run captures the graph

    def infer(self, batch: Batch) -> dict[str, np.ndarray]:
        if self.session is None:
            raise RunnerClosedError(f"{self.name}: the CUDA-graph session is closed")
        if batch.shape != self.shape:
            raise ShapeError(f"{self.name} replays a graph captured at batch x sequence {self.shape}, not "
                             f"{batch.shape}", "use one CUDA-graph runner per fixed shape")
        for name, value in self.inputs.items():
            value.update_inplace(batch.feed[name])
        self.session.run_with_iobinding(self.binding)
        return {name: value.numpy() for name, value in self.outputs.items()}

    def timed(self, batch: Batch) -> Callable[[], object]:
        self.infer(batch)  # the batch's inputs in the captured buffers; the timed call replays the graph

        def call() -> object:
            self.session.run_with_iobinding(self.binding)
            self.binding.synchronize_outputs()
            return self.binding
        return call

    def close(self) -> None:
        self.session = None

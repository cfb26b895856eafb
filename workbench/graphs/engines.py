"""TensorRT engines: availability, cache keys, trtexec commands, Python-API builds, ORT's TensorRT provider."""
from __future__ import annotations

import hashlib
import json
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.core.atomic import atomic_path
from workbench.core.errors import DependencyMissingError, GpuRequiredError
from workbench.core.machine import gpu_name
from workbench.graphs.errors import OnnxModelError
from workbench.graphs.tables import ShapeProfile

if TYPE_CHECKING:
    from onnx import ModelProto

GPU_FIX = ("run this step on an NVIDIA GPU host with the [gpu] extra: `bash engines/build_engines.sh` there, or "
           "`workbench run --resume --output-dir <this run> --steps tensorrt`")


@dataclass
class EngineSpec:
    """One engine to build: precision, profiles, and the ONNX nodes whose layers must stay fp32."""

    name: str
    precision: str
    profiles: list[ShapeProfile]
    pinned: list[str] = field(default_factory=list)
    workspace_mb: int = 4096

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "precision": self.precision, "profiles": [p.recorded() for p in self.profiles],
                "pinned": self.pinned, "workspace_mb": self.workspace_mb}


def require_tensorrt() -> Any:
    """The tensorrt module on a machine with an NVIDIA GPU, else a StepSkipped error saying what is missing."""
    if gpu_name() is None:
        raise GpuRequiredError("building TensorRT engines needs an NVIDIA GPU; none was found (no nvidia-smi GPU)",
                               GPU_FIX)
    try:
        import tensorrt
    except (ImportError, OSError) as exc:
        raise DependencyMissingError(f"TensorRT is not installed or cannot load ({exc})",
                                     "pip install -e '.[gpu]' (tensorrt from NVIDIA's index) on the GPU host") from None
    return tensorrt


def cache_key(onnx_sha256: str, trt_version: str, gpu: str, spec: EngineSpec) -> str:
    """Engines are reused only for the same graph, TensorRT, GPU, profiles, precision, pins and workspace."""
    material = json.dumps({"onnx": onnx_sha256, "tensorrt": trt_version, "gpu": gpu, **spec.record(),
                           "name": None}, sort_keys=True)
    return hashlib.sha256(material.encode()).hexdigest()[:24]


def shape_arg(input_names: tuple[str, ...], shape: tuple[int, int]) -> str:
    return ",".join(f"{name}:{shape[0]}x{shape[1]}" for name in input_names)


def trtexec_command(onnx_path: Path, engine_path: Path, spec: EngineSpec, input_names: tuple[str, ...],
                    timing_cache: Path, report_dir: Path) -> list[str]:
    """The trtexec line that builds the same engine as `build_engine` (one --profile block per profile)."""
    command = ["trtexec", f"--onnx={onnx_path}", f"--saveEngine={engine_path}"]
    for index, profile in enumerate(spec.profiles):
        low, opt, high = profile.shapes()
        if len(spec.profiles) > 1:
            command.append(f"--profile={index}")
        command += [f"--minShapes={shape_arg(input_names, low)}", f"--optShapes={shape_arg(input_names, opt)}",
                    f"--maxShapes={shape_arg(input_names, high)}"]
    command += ["--noTF32", f"--memPoolSize=workspace:{spec.workspace_mb}M", f"--timingCacheFile={timing_cache}"]
    if spec.precision == "fp16":
        command.append("--fp16")
        if spec.pinned:
            command += ["--precisionConstraints=obey",
                        "--layerPrecisions=" + ",".join(f"{shlex.quote(n)}:fp32" for n in spec.pinned)]
    stem = report_dir / spec.name
    command += [f"--exportTimes={stem}.times.json", f"--exportProfile={stem}.profile.json",
                f"--exportLayerInfo={stem}.layers.json", "--profilingVerbosity=detailed"]
    return command


def layer_matches(layer_name: str, node: str) -> bool:
    """TensorRT's ONNX parser names layers after their node, with suffixes when one node becomes several layers."""
    return (layer_name == node or layer_name.startswith((f"{node}_", f"{node}."))
            or f"[ONNX Layer: {node}]" in layer_name)


@dataclass(frozen=True)
class BuiltEngine:
    """A serialized engine built here, the layers pinned to fp32 in it, the build's seconds, TensorRT's version."""

    engine: bytes
    pinned_layers: int
    seconds: float
    tensorrt: str


def build_engine(onnx_path: Path, spec: EngineSpec, input_names: tuple[str, ...], timing_cache: Path) -> BuiltEngine:
    """Build with TensorRT's Python API."""
    trt = require_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    explicit = getattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH", None)
    modern = int(trt.__version__.split(".")[0]) >= 10  # explicit batch is the only mode from TensorRT 10 on
    network = builder.create_network(0 if explicit is None or modern else 1 << int(explicit))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise OnnxModelError(f"TensorRT cannot parse {onnx_path}: {errors}",
                             "check the opset and the ops TensorRT supports")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, spec.workspace_mb << 20)
    config.clear_flag(trt.BuilderFlag.TF32)
    for profile in spec.profiles:
        shapes = builder.create_optimization_profile()
        for name in input_names:
            shapes.set_shape(name, *profile.shapes())
        config.add_optimization_profile(shapes)
    pinned = 0
    if spec.precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
        if spec.pinned:
            config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
            for index in range(network.num_layers):
                layer = network.get_layer(index)
                if any(layer_matches(layer.name, node) for node in spec.pinned):
                    layer.precision = trt.float32
                    for out in range(layer.num_outputs):
                        if layer.get_output(out).dtype in (trt.float32, trt.float16):
                            layer.set_output_type(out, trt.float32)
                    pinned += 1
    cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    start = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise OnnxModelError(f"TensorRT failed to build {spec.name} from {onnx_path}", "read the TensorRT log above")
    with atomic_path(timing_cache) as tmp:
        tmp.write_bytes(bytes(config.get_timing_cache().serialize()))
    return BuiltEngine(bytes(serialized), pinned, round(time.perf_counter() - start, 2), trt.__version__)


def original_nodes_for(blocked: list[str], optimized: ModelProto, original: ModelProto,
                       limit: int = 40) -> dict[str, list[str]]:
    """Map nodes of the ORT-fused graph to the nodes of the exported graph they replaced.

    A node that kept its name maps to itself; a fused node maps to the original nodes between its input and output
    tensors (ORT keeps those names). A fused node whose region cannot be bounded maps to nothing.
    """
    weights = {init.name for init in original.graph.initializer}
    producers = {out: node for node in original.graph.node for out in node.output
                 if not set(node.input) <= weights}  # nodes that only pass weights along are not compute
    names = {node.name for node in original.graph.node}
    fused = {node.name: node for node in optimized.graph.node}
    order = {node.name: i for i, node in enumerate(original.graph.node)}
    mapping: dict[str, list[str]] = {}
    for name in blocked:
        if name in names:
            mapping[name] = [name]
            continue
        node = fused.get(name)
        if node is None:
            mapping[name] = []
            continue
        stop, seen = set(node.input), set()
        frontier = [t for t in node.output if t in producers]
        while frontier and len(seen) <= limit:
            producer = producers[frontier.pop()]
            if producer.name in seen:
                continue
            seen.add(producer.name)
            frontier += [t for t in producer.input if t not in stop and t in producers]
        mapping[name] = sorted(seen, key=order.__getitem__) if len(seen) <= limit else []
    return mapping


def ort_tensorrt_options(spec: EngineSpec, input_names: tuple[str, ...],
                         cache_dir: Path) -> dict[str, str | int | bool]:
    """Provider options for ONNX Runtime's TensorRT execution provider with the same profiles and caches."""
    def shapes(which: int) -> str:
        return ",".join(shape_arg(input_names, profile.shapes()[which]) for profile in spec.profiles)

    return {
        "trt_fp16_enable": spec.precision == "fp16",
        "trt_max_workspace_size": spec.workspace_mb << 20,
        "trt_profile_min_shapes": shapes(0),
        "trt_profile_opt_shapes": shapes(1),
        "trt_profile_max_shapes": shapes(2),
        "trt_engine_cache_enable": True,
        "trt_engine_cache_path": str(cache_dir),
        "trt_timing_cache_enable": True,
        "trt_timing_cache_path": str(cache_dir),
    }

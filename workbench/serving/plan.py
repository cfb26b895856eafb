"""Decide what to serve and how, from the facts given: the flavor, the layout, the variants a flavor prefers on this
host, threads per instance, the outputs served, and the ServingPlan the repository is generated from."""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from workbench.core.config import BatchRange
from workbench.core.errors import MissingArtifactError
from workbench.core.machine import cpu_features, gpu_name
from workbench.core.record import Variant
from workbench.core.results import CpuFeatures, Verdict
from workbench.graphs import onnxfiles
from workbench.graphs.names import VariantName
from workbench.graphs.tables import ExportMetrics, OptimizeMetrics, PrecisionDecision, ShapeProfile
from workbench.models.tables import PipelineSummary
from workbench.precision.tables import ParityMetrics
from workbench.runners.cuda import cuda_usable
from workbench.serving.flavor import Flavor
from workbench.serving.repository import ServingPlan, graph_output_dims, model_name_for
from workbench.serving.settings import ONE_PYTHON_MODEL, REPOSITORY_VARIABLE, TritonSettings
from workbench.serving.tables import TritonMetrics
from workbench.tasks.registry import OutputSpec

PROJECT_REPOSITORIES = Path(__file__).resolve().parents[2] / "model_repository"

# Variants to serve, best first, when the configuration names none (the first that passed parity wins). On a CPU,
# int8 comes first only where it pays: measured against fp32 at the goal cells by the optimize step
# (metrics.optimize.precisions.decisions.int8), else, for a record without that measurement, where the CPU has int8
# dot-product instructions (VNNI, AMX).
# The `openvino` variant (fp32, run by OpenVINO: kept only where it ran faster than the fp32 graph here) goes before
# fp32, and `openvino_int8` (NNCF's int8 run by OpenVINO: kept only where it ran faster than the fastest graph kept
# before it) goes first, where the Python model serves (python-ort); Triton's ONNX Runtime backend would run their
# files in ONNX Runtime.
# `openvino_bf16` (the same in bf16, held to fp16's gate: kept only where it ran faster than the fp32 graphs here) goes
# before them.
OPENVINO_VARIANTS = (VariantName.OPENVINO_INT8_REPAIRED, VariantName.OPENVINO_INT8, VariantName.OPENVINO_BF16,
                     VariantName.OPENVINO)
CPU_INT8_FIRST = (*OPENVINO_VARIANTS[:2], VariantName.INT8_REPAIRED, VariantName.INT8, *OPENVINO_VARIANTS[2:],
                  VariantName.FP32, VariantName.ORIGINAL)
CPU_FP32_FIRST = (*OPENVINO_VARIANTS, VariantName.FP32, VariantName.INT8_REPAIRED, VariantName.INT8,
                  VariantName.ORIGINAL)
GPU_PREFERENCE = {Flavor.ONNXRUNTIME: (VariantName.FP16_REPAIRED, VariantName.FP16, VariantName.FP32,
                                       VariantName.ORIGINAL),
                  Flavor.TENSORRT_PLAN: (VariantName.TRT_FP16, VariantName.TRT_FP32)}


def int8_decision(optimize: OptimizeMetrics | None) -> PrecisionDecision | None:
    """The optimize step's decision on int8 (None: it recorded none), which orders the CPU's variants."""
    return optimize.decision("int8") if optimize else None


def lost_races(parity: ParityMetrics | None) -> dict[str, str]:
    """Repaired variants the parity step timed against the variant served after them and found not clearly faster,
    each with that variant (`preference` serves them after it)."""
    repairs = parity.repair.items() if parity else ()
    return {VariantName(precision).repaired: outcome.race.against for precision, outcome in repairs
            if outcome.race and not outcome.race.kept and outcome.race.against}


def recorded_preference(flavor: Flavor, optimize: OptimizeMetrics | None,
                        parity: ParityMetrics | None) -> tuple[tuple[str, ...], str]:
    """`preference` as a run's records decide it: the optimize step's int8 decision, the parity step's lost races."""
    return preference(flavor, int8_decision(optimize), lost=lost_races(parity))


def preference(flavor: Flavor, int8: PrecisionDecision | None = None, features: CpuFeatures | None = None,
               lost: dict[str, str] | None = None) -> tuple[tuple[str, ...], str]:
    """The variants `flavor` serves, best first, and why in that order: on a CPU, int8 first where it pays, as the
    optimize step decided (`int8`: its decision), else where the CPU (`features`, default this host's) has int8
    dot-product instructions; a repaired variant that `lost` its race goes after the variant it lost to."""
    if flavor in GPU_PREFERENCE and (flavor is Flavor.TENSORRT_PLAN or gpu_name()):
        return GPU_PREFERENCE[flavor], f"{flavor.value} on a GPU"
    order, reason = _cpu_preference(int8, features or cpu_features())
    if flavor is not Flavor.PYTHON_ORT:
        order = tuple(v for v in order if v not in OPENVINO_VARIANTS)
    for variant, winner in (lost or {}).items():
        if variant in order and winner in order and order.index(variant) < order.index(winner):
            rest = [v for v in order if v != variant]
            rest.insert(rest.index(winner) + 1, variant)
            order = tuple(rest)
            reason += f"; {variant} after {winner}: it was not clearly faster (metrics.parity.repair)"
    return order, reason


def _cpu_preference(int8: PrecisionDecision | None, features: CpuFeatures) -> tuple[tuple[str, ...], str]:
    if int8 is not None and int8.pays is not None:
        first = CPU_INT8_FIRST if int8.pays else CPU_FP32_FIRST
        return first, f"{'int8' if int8.pays else 'fp32'} first: int8 {int8.reason}"
    instructions = features.int8_dot_product
    if instructions is None:
        return CPU_FP32_FIRST, ("fp32 first: this CPU has no int8 dot-product instructions (AVX-512 VNNI, AVX-VNNI or "
                                "AMX), so int8 would serve about the same speed with less accuracy")
    return CPU_INT8_FIRST, f"int8 first: this CPU has {instructions}"


def repository_root(repository_dir: str | None) -> Path:
    """Where generated repositories are published: triton.repository_dir, else $WORKBENCH_REPOSITORY, else the
    project's model_repository/."""
    return Path(repository_dir or os.environ.get(REPOSITORY_VARIABLE) or PROJECT_REPOSITORIES)


def choose_flavor(setting: Flavor | Literal["auto"], device: str, task: str = "feature-extraction") -> Flavor:
    """The configured flavor; `auto`: Triton's ONNX Runtime backend where ONNX Runtime runs on CUDA, else (and for
    a reranker or a sparse encoder, served by one Python model) python-ort."""
    if setting != "auto":
        return Flavor(setting)
    one_python_model = task in ONE_PYTHON_MODEL
    return Flavor.ONNXRUNTIME if device != "cpu" and not one_python_model and cuda_usable() else Flavor.PYTHON_ORT


def choose_layout(setting: str, flavor: Flavor) -> str:
    """The configured layout; `auto` is the one measured faster for the flavor (fused for the Python-hosted
    python-ort, the ensemble for the C++ backends: docs/triton.md)."""
    if setting != "auto":
        return setting
    return "fused" if flavor is Flavor.PYTHON_ORT else "ensemble"


# A second instance on a CPU runs its own session and, in each instance, a wide one for when the other is idle
# (serving/backend/ort_batches.py `sessions`): three sessions more than one instance has. A session holds about
# 1.7 bytes per byte of its file (OpenVINO's compiled all-mpnet-base-v2: 725 MB for a 436 MB file), before its
# activations. Two instances are served only where those sessions stay within SECOND_INSTANCE_BYTES.
ADDED_SESSIONS = 3
SESSION_BYTES_PER_FILE_BYTE = 1.7
SECOND_INSTANCE_BYTES = 2**29


@dataclass(frozen=True)
class Instances:
    """How many model instances serve, with how many ONNX Runtime intra-op threads each, and why."""

    count: int
    threads: int
    reason: str


def instances_for(setting: int | Literal["auto"], threads: int | None, flavor: Flavor, gpu: bool,
                  cores: int | None = None, model_bytes: int = 0) -> Instances:
    """The instances of `setting` (auto: two for python-ort on a CPU with two or more cores where the sessions they
    add, of a `model_bytes` file, stay within SECOND_INSTANCE_BYTES; else one), each with `threads` intra-op threads,
    else its share of the cores (every instance taking all of them would have them fight over the CPU)."""
    cores = cores or os.cpu_count() or 1
    added = ADDED_SESSIONS * SESSION_BYTES_PER_FILE_BYTE * model_bytes
    if setting != "auto":
        count, reason = setting, f"{setting} instance(s), as configured (triton.instances)"
    elif flavor is Flavor.PYTHON_ORT and not gpu and cores >= 2 and added > SECOND_INSTANCE_BYTES:
        count, reason = 1, (
            f"one instance with every core: a second would add {ADDED_SESSIONS} sessions of this "
            f"{model_bytes / 1e6:.0f} MB model (about {added / 2**30:.1f} GiB, over {SECOND_INSTANCE_BYTES / 2**30:g} "
            "GiB): it overlaps tokenizing and answering with inference, which pays for a small model and little for "
            "this one; -p triton.instances=2 to have it anyway")
    elif flavor is Flavor.PYTHON_ORT and not gpu and cores >= 2:
        count = 2
        reason = (f"two instances sharing {cores} cores: while one runs ONNX Runtime the other decodes, tokenizes "
                  "and answers; one alone at work takes the idle one's threads too (measured 1.3-1.5x the "
                  "throughput of one instance with every core at concurrency >= 4, p50 about 15% higher at "
                  "concurrency 1: docs/triton.md); -p triton.instances=1 when one caller at a time is the load")
    else:
        count, reason = 1, ("one instance with every core" if not gpu else "one instance on the GPU")
    return Instances(count, threads or max(1, cores // count), reason)


def candidates(available: set[str], verdict: Callable[[str], Verdict | None], flavor: Flavor,
               configured: str | None, int8: PrecisionDecision | None = None,
               lost: dict[str, str] | None = None) -> list[str]:
    """Variants that could be served, best first: the `configured` one, else those of the flavor's preference
    (`preference`, with the optimize step's `int8` decision and the races `lost`) among the `available` ones, the
    ones whose `verdict` passed ahead of the unchecked (failed ones are left out)."""
    kind = flavor.artifact_kind
    if configured:
        if configured not in available:
            raise MissingArtifactError(
                f"triton.variant={configured!r} has no {kind} file in this run (have {sorted(available)})",
                "run the step that builds it (optimize, parity or tensorrt), or choose one of those")
        return [configured]
    order, _ = preference(flavor, int8, lost=lost)
    preferred = [v for v in order if v in available]
    verdicts = {v: verdict(v) for v in preferred}
    passed = [v for v in preferred if (found := verdicts[v]) and found.passed]
    unchecked = [v for v in preferred if verdicts[v] is None]
    if not passed + unchecked:
        raise MissingArtifactError(
            f"no {kind} variant to serve with flavor {flavor.value}: of {sorted(available)}, the preferred "
            f"{list(order)} failed parity or do not exist",
            "run the optimize/parity (or tensorrt) steps first, or set -p triton.variant=<one of those> "
            "with -p triton.allow_unverified=true")
    return passed + unchecked


@dataclass(frozen=True)
class ServingRequest:
    """What the triton step asks to serve: `variant` in `flavor` under `name`; `export` is what the export step
    recorded about the graph (inputs, outputs, sequence limit, the sentence-transformers pipeline); the tokenizer
    folder with its pad token, the classifier's labels and its head's activation (`tasks.registry.head_activation`); the
    outputs served; the TensorRT shape profiles; the batch range and token limit served; the Triton settings and the
    threads per instance."""

    name: str
    flavor: Flavor
    variant: Variant
    export: ExportMetrics
    tokenizer_dir: Path
    pad_token_id: int
    id2label: dict[str, str]
    activation: str
    outputs: tuple[OutputSpec, ...]
    profiles: list[ShapeProfile]
    triton: TritonSettings
    batch: BatchRange
    sequence_max: int
    threads: int | None


def build_plan(request: ServingRequest) -> ServingPlan:
    """The plan that serves what `request` asks for."""
    flavor, triton, batch, profiles = request.flavor, request.triton, request.batch, request.profiles
    pipeline = request.export.sentence_pipeline or PipelineSummary()
    python = flavor is Flavor.PYTHON_ORT
    gpu = not python and gpu_name() is not None
    instances = instances_for(triton.instances, request.threads, flavor, gpu,
                              model_bytes=onnxfiles.total_bytes(request.variant.path))
    export = request.export
    max_tokens, _ = export.token_budget(batch, request.sequence_max)
    return ServingPlan(
        name=model_name_for(request.name), flavor=flavor, input_names=tuple(request.export.io.inputs),
        outputs=request.outputs, output_dims=graph_output_dims(request.export.io.outputs),
        model_file=request.variant.path, tokenizer_dir=request.tokenizer_dir,
        max_length=request.sequence_max, max_batch_size=batch.max,
        preferred_batch_sizes=triton.preferred_batch_sizes or sorted({batch.opt, batch.max}),
        max_queue_delay_us=triton.max_queue_delay_us, dynamic_batching=triton.dynamic_batching,
        instances=instances.count, instances_reason=instances.reason, gpu=gpu,
        gpu_accelerator=triton.gpu_accelerator, fp16=request.variant.precision == "fp16",
        # Fixed-shape backends batch only equal shapes: pad each request up to its length bucket (the profiles).
        pad_to=[p.sequence[2] for p in profiles] if not python else [],
        profiles=len(profiles) if flavor is Flavor.TENSORRT_PLAN else 1,
        pad_token_id=request.pad_token_id, threads=instances.threads, id2label=request.id2label,
        activation=request.activation,
        layout=choose_layout(triton.layout, flavor), max_documents=triton.max_documents,
        max_texts=triton.max_texts, max_text_chars=triton.max_text_chars,
        prompts=dict(pipeline.prompts), default_prompt_name=pipeline.default_prompt_name,
        lowercase=pipeline.do_lower_case, max_tokens=max_tokens if python else 0,
        max_request_tokens=triton.request_tokens(max_tokens, request.sequence_max) if python else 0)


class RunFiles(Protocol):
    """A run's files by name, as its record keeps them (`RunRecord`)."""

    def variant(self, name: str, kind: str = "onnx") -> Variant: ...

    def artifact(self, name: str) -> Path: ...


def deployed_plan(triton: TritonMetrics | None, files: RunFiles) -> tuple[ServingPlan, str] | None:
    """The plan the triton step deployed (its table when the step is ok now: `record.current(TritonMetrics)`) with
    the run's files, and the variant's name; None when it deployed nothing that is current (the served benchmark
    measures what was deployed, nothing else)."""
    if triton is None or triton.plan is None or triton.flavor is None or triton.variant is None:
        return None
    variant = files.variant(triton.variant, triton.flavor.artifact_kind)
    return ServingPlan.from_record(triton.plan, variant.path, files.artifact("tokenizer")), variant.name


def served_groups(lengths: list[int], rows: int, max_tokens: int = 0) -> list[list[int]]:
    """The groups the served Python model (serving/backend/ort_batches.py) runs texts of these token counts in when
    they arrive together, as indices into `lengths`: by length, a new group where padding would pass MAX_PADDING or
    the group's padded tokens `max_tokens` (0: no bound), and at most `rows` texts (the model's max_batch_size, the
    most Triton's dynamic batcher puts together)."""
    from workbench.serving.backend.ort_batches import MAX_PADDING, length_groups

    return [group[start:start + rows] for group in length_groups([(1, length) for length in lengths], MAX_PADDING,
                                                                 max_tokens)
            for start in range(0, len(group), rows)]

"""Decide what to serve and how: flavor, variant and the ServingPlan the repository is generated from."""
from __future__ import annotations

import os
from pathlib import Path

from workbench.core.config import RunConfig
from workbench.core.errors import ConfigError, MissingArtifactError
from workbench.core.machine import cpu_features, gpu_name
from workbench.core.record import RunRecord
from workbench.serving.repository import ServingPlan, graph_output_dims, model_name_for

PROJECT_REPOSITORIES = Path(__file__).resolve().parents[2] / "model_repository"

# Variants to serve, best first, when the configuration names none (the first that passed parity wins). On a CPU,
# int8 comes first only where the CPU has int8 dot-product instructions (VNNI, AMX): without them ONNX Runtime's int8
# matmuls run about as fast as fp32 (README, "Precision on this host"), so fp32 serves the same speed exactly.
CPU_INT8_FIRST = ("int8_repaired", "int8", "fp32", "original")
CPU_FP32_FIRST = ("fp32", "int8_repaired", "int8", "original")
PREFERENCE = {
    "python-ort": CPU_INT8_FIRST,
    "onnxruntime": ("fp16_repaired", "fp16", "fp32", "original"),
    "onnxruntime-cpu": CPU_INT8_FIRST,
    "tensorrt_plan": ("trt_fp16", "trt_fp32"),
}


def preference(flavor: str, features: dict | None = None) -> tuple[tuple[str, ...], str]:
    """The variants `flavor` serves, best first, on this host, and why in that order."""
    key = flavor if flavor != "onnxruntime" or gpu_name() else "onnxruntime-cpu"
    order = PREFERENCE[key]
    if order != CPU_INT8_FIRST:
        return order, f"{flavor} on a GPU"
    int8 = (features or cpu_features())["int8_dot_product"]
    if int8 is None:
        return CPU_FP32_FIRST, ("fp32 first: this CPU has no int8 dot-product instructions (AVX-512 VNNI, AVX-VNNI or "
                                "AMX), so int8 would serve about the same speed with less accuracy")
    return order, f"int8 first: this CPU has {int8}"


def repository_root(config: RunConfig) -> Path:
    """Where generated repositories are published: triton.repository_dir, else the project's model_repository/."""
    return Path(config.triton.repository_dir) if config.triton.repository_dir else PROJECT_REPOSITORIES


def choose_flavor(config: RunConfig) -> str:
    if config.triton.flavor != "auto":
        return config.triton.flavor
    from workbench.runners.onnxruntime import cuda_usable

    return "onnxruntime" if config.device != "cpu" and cuda_usable() else "python-ort"


def choose_layout(config: RunConfig, flavor: str) -> str:
    """The configured layout; `auto` is the one measured faster for the flavor (fused for the Python-hosted
    python-ort, the ensemble for the C++ backends: README, "Triton")."""
    if config.triton.layout != "auto":
        return config.triton.layout
    return "fused" if flavor == "python-ort" else "ensemble"


def threads_per_instance(config: RunConfig) -> int:
    """ONNX Runtime intra-op threads of each model instance: `threads`, else the cores shared among the instances
    (every instance taking all cores would have them fight over the CPU)."""
    return config.threads or max(1, (os.cpu_count() or 1) // config.triton.instances)


def candidate_variants(config: RunConfig, record: RunRecord, flavor: str) -> list[str]:
    """Variants that could be served, best first: the configured one, else those of the flavor's preference
    that exist, the ones that passed parity in this run ahead of the unchecked (failed ones are left out)."""
    kind = "engine" if flavor == "tensorrt_plan" else "onnx"
    available = set(record.variant_names(kind))
    if config.triton.variant:
        if config.triton.variant not in available:
            raise MissingArtifactError(
                f"triton.variant={config.triton.variant!r} has no {kind} file in this run (have {sorted(available)})",
                "run the step that builds it (optimize, parity or tensorrt), or choose one of those")
        return [config.triton.variant]
    order, _ = preference(flavor)
    preferred = [v for v in order if v in available]
    verdicts = {v: record.verdict(v) for v in preferred}
    passed = [v for v in preferred if verdicts[v] and verdicts[v]["passed"]]
    unchecked = [v for v in preferred if verdicts[v] is None]
    if not passed + unchecked:
        raise MissingArtifactError(
            f"no {kind} variant to serve with flavor {flavor}: of {sorted(available)}, the preferred "
            f"{list(order)} failed parity or do not exist",
            "run the optimize/parity (or tensorrt) steps first, or set -p triton.variant=<one of those> "
            "with -p triton.allow_unverified=true")
    return passed + unchecked


def served_outputs(config: RunConfig) -> tuple:
    """Token states are large (batch x sequence x hidden floats per request): an embedding service sends the
    sentence embedding alone unless `triton.outputs` asks for more."""
    outputs = config.output_specs
    if config.triton.outputs is None:
        embeddings = tuple(o for o in outputs if o.kind == "embedding")
        return embeddings or outputs
    unknown = set(config.triton.outputs) - {o.name for o in outputs}
    if unknown:
        raise ConfigError(f"triton.outputs names {sorted(unknown)}, which {config.task} does not produce",
                          f"choose among {[o.name for o in outputs]}")
    return tuple(o for o in outputs if o.name in config.triton.outputs)


def serving_plan(config: RunConfig, record: RunRecord, variant: str | None = None) -> tuple[ServingPlan, str]:
    """How to serve `variant` (default: the first candidate, see `candidate_variants`)."""
    flavor = choose_flavor(config)
    variant = variant or candidate_variants(config, record, flavor)[0]
    kind = "engine" if flavor == "tensorrt_plan" else "onnx"
    path, precision = record.variant(variant, kind)
    from transformers import AutoConfig

    export = record.export_info()
    pipeline = export.get("sentence_pipeline") or {}
    outputs = served_outputs(config)
    folder = record.artifact("tokenizer")  # tokenizer and model config, saved by the export step
    tokenizer = record.tokenizer()
    classifies = any(o.kind in ("logits", "token_logits") for o in outputs)
    id2label = {str(k): v for k, v in AutoConfig.from_pretrained(folder).id2label.items()} if classifies else {}
    profiles = record.shape_profiles()
    batch = config.batch
    plan = ServingPlan(
        name=model_name_for(config.triton.name or config.model_slug), flavor=flavor,
        input_names=tuple(export["io"]["inputs"]), outputs=outputs,
        output_dims=graph_output_dims(export["io"]["outputs"]),
        model_file=path, tokenizer_dir=folder,
        max_length=min(config.sequence.max, export["max_sequence"]), max_batch_size=batch.max,
        preferred_batch_sizes=config.triton.preferred_batch_sizes or sorted({batch.opt, batch.max}),
        max_queue_delay_us=config.triton.max_queue_delay_us, dynamic_batching=config.triton.dynamic_batching,
        instances=config.triton.instances, gpu=flavor != "python-ort" and gpu_name() is not None,
        gpu_accelerator=config.triton.gpu_accelerator, fp16=precision == "fp16",
        # Fixed-shape backends batch only equal shapes: pad each request up to its length bucket (the profiles).
        pad_to=[p["sequence"][2] for p in profiles] if flavor != "python-ort" else [],
        profiles=len(profiles) if flavor == "tensorrt_plan" else 1,
        pad_token_id=tokenizer.pad_token_id or 0, threads=threads_per_instance(config), id2label=id2label,
        layout=choose_layout(config, flavor), prompts=dict(pipeline.get("prompts") or {}),
        default_prompt_name=pipeline.get("default_prompt_name"))
    return plan, variant

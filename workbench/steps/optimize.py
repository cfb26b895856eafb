"""Step 02 optimize: ONNX Runtime transformer fusions, then fp16 and int8 variants, and symbolic shapes for TensorRT."""
from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

from workbench import onnxfiles
from workbench.config import RunConfig
from workbench.data import encode, load_corpus
from workbench.models import FUSION_MODEL_TYPES
from workbench.record import RunRecord
from workbench.runners.onnxruntime import OrtRunner, providers_for

STEP = "optimize"
FUSED_OPS = (
    "EmbedLayerNormalization", "QEmbedLayerNormalization", "Attention", "MultiHeadAttention", "QAttention", "Gelu",
    "FastGelu", "BiasGelu",
    "GemmFastGelu", "LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization", "RotaryEmbedding", "DynamicQuantizeMatMul", "MatMulInteger",
    "DynamicQuantizeLinear",
)
ATTENTION_OPS = ("Attention", "MultiHeadAttention", "QAttention")
# What ONNX Runtime's transformer optimizer fuses in every layer of the encoder families it has rules for.
TRANSFORMER_FUSIONS = ("EmbedLayerNormalization", "Attention", "SkipLayerNormalization", "BiasGelu")
BASIC_LEVEL = 1  # ORT_ENABLE_BASIC: constant folding and redundant-node removal, standard ONNX operators only


def fusion_stats(model: Any, num_layers: int | None = None,
                 unavailable: dict[str, Any] | None = None) -> dict[str, Any]:
    """Node count, fused-operator counts and, given `num_layers`, whether every layer's attention fused; the
    fusions `unavailable` to this family replace the advice on unfused attention."""
    counts = onnxfiles.op_counts(model)
    stats: dict[str, Any] = {
        "nodes": len(model.graph.node),
        "fused": {op: counts[op] for op in FUSED_OPS if counts.get(op)},
    }
    if num_layers is None:
        return stats
    attention = sum(counts.get(op, 0) for op in ATTENTION_OPS)
    stats["attention_fused"] = attention >= num_layers
    if unavailable:
        stats["unavailable"] = unavailable
    elif attention < num_layers:
        stats["warning"] = (f"Attention fused in {attention} of {num_layers} layers: export with "
                            "attn_implementation=eager and exporter=legacy for full fusion")
    return stats


def unavailable_fusions(export: dict[str, Any]) -> dict[str, Any] | None:
    """The transformer fusions a family without ONNX Runtime fusion rules does not get, and why."""
    if export["optimizer_model_type"]:
        return None
    reason = (f"ONNX Runtime's transformer optimizer has no fusion rules for model type {export['architecture']!r} "
              f"(it has them for {', '.join(FUSION_MODEL_TYPES)}): the graph got ONNX Runtime's basic "
              "optimizations only (constant folding, redundant nodes removed), with standard ONNX operators")
    return {"fusions": list(TRANSFORMER_FUSIONS), "reason": reason}


def optimize_fp32(original: Path, dest: Path, export: dict[str, Any]) -> Any:
    """The transformer optimizer's fusions for the families it knows; ONNX Runtime's basic level for the others."""
    from onnxruntime.transformers.optimizer import optimize_model

    model_type = export["optimizer_model_type"]
    optimized = optimize_model(str(original), model_type=model_type or "bert", num_heads=export["num_heads"],
                               hidden_size=export["hidden_size"], opt_level=None if model_type else BASIC_LEVEL,
                               only_onnxruntime=not model_type)
    onnxfiles.save(optimized.model, dest)
    return optimized.model


def convert_fp16(fp32: Path, dest: Path, op_block_list: list[str], node_block_list: list[str]) -> Any:
    """fp16 weights and compute with fp32 graph inputs/outputs; block-listed ops and nodes stay fp32."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST
    from onnxruntime.transformers.onnx_model import OnnxModel

    model = OnnxModel(onnxfiles.load(fp32))
    model.convert_float_to_float16(keep_io_types=True, op_block_list=DEFAULT_OP_BLOCK_LIST + op_block_list,
                                   node_block_list=node_block_list)
    _drop_repeated_nodes(model.model.graph)
    onnxfiles.save(model.model, dest)
    return model.model


def _drop_repeated_nodes(graph: Any) -> None:
    """Remove exact repeats of a node (the converter inserts the same Cast twice when a tensor feeds two
    fp32-blocked consumers; ONNX Runtime then refuses the duplicate node name)."""
    seen, keep = set(), []
    for node in graph.node:
        key = node.SerializeToString(deterministic=True)
        if key not in seen:
            seen.add(key)
            keep.append(node)
    if len(keep) < len(graph.node):
        del graph.node[:]
        graph.node.extend(keep)


def quantize_int8(fp32: Path, dest: Path, per_channel: bool, nodes_to_exclude: list[str]) -> Any:
    """Dynamic int8 quantization (QInt8 weights) of the already-optimized graph."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with onnxfiles.onnx_destination(dest) as tmp:
        quantize_dynamic(fp32, tmp, weight_type=QuantType.QInt8, per_channel=per_channel,
                         nodes_to_exclude=nodes_to_exclude or None,
                         use_external_data_format=fp32.stat().st_size > onnxfiles.EXTERNAL_DATA_THRESHOLD,
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    return onnxfiles.load(dest, load_external_data=False)


def infer_shapes(original: Path, dest: Path) -> Any:
    """The original graph with symbolic shapes everywhere (what TensorRT and its ORT EP parse best)."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    model = SymbolicShapeInference.infer_shapes(onnxfiles.load(original), auto_merge=True)
    onnxfiles.save(model, dest)
    return model


def smoke_test(record: RunRecord, config: RunConfig, name: str, path: Path) -> dict[str, Any]:
    """Load the variant in ONNX Runtime and run two real texts through it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(record.artifact("tokenizer"))
    runner = OrtRunner(name, path, providers_for(config.device), config.threads)
    feed = encode(tokenizer, list(load_corpus()[:2]), runner.input_names, max_length=64)
    outputs = runner.infer(feed)
    record.note_providers(runner.providers)
    return {"providers": runner.providers, "outputs": {k: list(v.shape) for k, v in outputs.items()}}


def run(config: RunConfig, record: RunRecord) -> dict[str, Any]:
    """Write the optimized variants the configuration asks for and record their fusion counts."""
    with record.step(STEP):
        export = record.metric("export")
        original = record.artifact("onnx.original")
        layers = export["num_layers"]
        unavailable = unavailable_fusions(export)
        onnx_dir = record.run_dir / "onnx"
        fusions: dict[str, Any] = {"original": fusion_stats(onnxfiles.load(original, False))}
        builders = {
            "fp32": lambda dest: optimize_fp32(original, dest, export),
            "fp16": lambda dest: convert_fp16(onnx_dir / "fp32.onnx", dest, config.fp16_op_block_list,
                                              config.fp16_node_block_list),
            "int8": lambda dest: quantize_int8(onnx_dir / "fp32.onnx", dest, config.int8_per_channel,
                                               config.int8_nodes_to_exclude),
            "tensorrt": lambda dest: infer_shapes(original, dest),
        }
        wanted = ["fp32", *[p for p in ("fp16", "int8") if p in config.precisions], "tensorrt"]
        for variant in wanted:
            start = time.perf_counter()
            dest = onnx_dir / f"{variant}.onnx"
            model = builders[variant](dest)
            fused = variant != "tensorrt"
            stats = fusion_stats(model, layers, unavailable) if fused else fusion_stats(model)
            stats["seconds"] = round(time.perf_counter() - start, 3)
            stats["megabytes"] = round(dest.stat().st_size / 1e6, 2)
            if fused:
                stats["smoke_test"] = smoke_test(record, config, variant, dest)
            if "warning" in stats:
                warnings.warn(f"{variant}: {stats['warning']}", stacklevel=2)
            precision = "fp32" if variant in ("fp32", "tensorrt") else variant
            record.add_artifact(f"onnx.{variant}", dest, kind="onnx", variant=variant, precision=precision)
            fusions[variant] = stats
            record.set_metric(f"fusions.{variant}", stats)
        record.set_metric("fusions.original", fusions["original"])
        return fusions

"""Per-node int8 error from ONNX Runtime's `qdq_loss_debug`: QDQ twins of the graph (its MatMuls' weights quantized
per channel, and per tensor; their input activations calibrated on corpus batches) are compared with the fp32 graph
node by node. For each MatMul: the signal-to-quantization-noise ratio (dB, higher is better) of its weight under
either granularity and of its input activation. A diagnostic shown beside the repair's measured sensitivity;
verdicts never read it.

ONNX Runtime's QDQ quantizer has no fused Attention, so the Attention nodes' weights are not covered."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from workbench.graphs import onnxfiles

COVERED_OPS = ("MatMul",)


def node_errors(source: Path, workdir: Path, feeds: list[dict[str, np.ndarray]],
                nodes: list[str]) -> dict[str, dict[str, float | None]]:
    """{node: {"weight_sqnr_db_per_channel", "weight_sqnr_db_per_tensor", "input_sqnr_db"}} for the MatMuls among
    `nodes` (files made in `workdir` are candidate files, removed with the repair's)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.qdq_loss_debug import (
        collect_activations,
        compute_activation_error,
        compute_weight_error,
        create_activation_matching,
        create_weight_matching,
        modify_model_output_intermediate_tensors,
    )

    graph = onnxfiles.skeleton(source)
    wanted = [n for n in graph.graph.node if n.name in set(nodes) and n.op_type in COVERED_OPS]
    if not wanted:
        return {}
    input_names = {i.name for i in graph.graph.input}

    class Feeds(CalibrationDataReader):
        def __init__(self) -> None:
            self.items = iter([{k: v for k, v in feed.items() if k in input_names} for feed in feeds])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.items, None)

    qdq, float_saved, qdq_saved = (workdir / f"candidate-{name}.onnx" for name in ("qdq", "float-saved", "qdq-saved"))
    # Calibration and the saver act only on tensors of known type: ONNX Runtime's symbolic shape inference types
    # the outputs of its contrib ops (Attention, SkipLayerNormalization), which ONNX's own inference leaves unknown
    _with_shapes(source, float_saved)
    weight_error = {}
    for per_channel in (False, True):  # the per-channel twin stays for the activations
        quantize_static(float_saved, qdq, Feeds(), quant_format=QuantFormat.QDQ, per_channel=per_channel,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                        nodes_to_quantize=[n.name for n in wanted], op_types_to_quantize=list(COVERED_OPS),
                        extra_options={"ActivationSymmetric": True})
        granularity = "per_channel" if per_channel else "per_tensor"
        weight_error[granularity] = compute_weight_error(create_weight_matching(str(source), str(qdq)))
    _with_shapes(qdq, qdq_saved)
    modify_model_output_intermediate_tensors(float_saved, float_saved)
    modify_model_output_intermediate_tensors(qdq_saved, qdq_saved)
    activations = create_activation_matching(collect_activations(str(qdq_saved), Feeds()),
                                             collect_activations(str(float_saved), Feeds()))
    activation_error = compute_activation_error(activations)
    for path in (qdq, float_saved, qdq_saved):
        onnxfiles.remove(path)
    return {node.name: {**{f"weight_sqnr_db_{g}": _rounded(errors.get(node.input[1]))
                           for g, errors in weight_error.items()},
                        "input_sqnr_db": _rounded(activation_error.get(node.input[0], {}).get("qdq_err"))}
            for node in wanted}


def agreement_with_sensitivity(errors: dict[str, dict[str, float]], sensitivity: dict[str, float]) -> float | None:
    """Spearman correlation between the measured sensitivity (error removed by keeping a node in fp32) and the
    input activation's quantization noise (negated SQNR) over the MatMuls both cover: near 1 when the cheap
    diagnostic would have ranked the nodes as the builds did."""
    from workbench.precision.retrieval import spearman

    both = [n for n, e in errors.items() if e["input_sqnr_db"] is not None and n in sensitivity]
    if len(both) < 3:
        return None
    return round(spearman([sensitivity[n] for n in both], [-errors[n]["input_sqnr_db"] for n in both]), 4)


def _with_shapes(path: Path, dest: Path) -> None:
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    onnxfiles.save(SymbolicShapeInference.infer_shapes(onnxfiles.load(path), auto_merge=True), dest)


def _rounded(value: Any) -> float | None:
    return None if value is None else round(float(value), 3)

"""Building the model variants from the exported graph: ONNX Runtime's fusions (fp32), fp16, dynamic int8, and the
graph with symbolic shapes for TensorRT. The optimize step builds them; the parity step's repair rebuilds fp16/int8
with nodes kept in fp32."""
from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Collection
from contextlib import chdir
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.core.atomic import temporary_dir
from workbench.graphs import onnxfiles
from workbench.graphs.attention import (
    ATTENTION_OPS,
    biased_attention,
    fuse_biased_attention,
    remove_dead,
    topological,
    unpack_biased_attention,
)
from workbench.graphs.tables import ExportMetrics
from workbench.models.batches import Feed
from workbench.models.families import BORROWED_RULES

if TYPE_CHECKING:
    from onnx import GraphProto, ModelProto, NodeProto

BASIC_LEVEL = 1  # ORT_ENABLE_BASIC: constant folding and redundant-node removal, standard ONNX operators only
# The layer norms of a fused encoder, as ONNX Runtime's transformer optimizer writes them ("fused": the residual Add
# and the embeddings' Gathers inside SkipLayerNormalization / EmbedLayerNormalization) or left as Add +
# LayerNormalization ("separate"). They compute the same; which runs faster depends on the host's kernels (on the CPU
# of ONNX Runtime 1.31 the separate form was up to 25% faster in int8), so the optimize step measures both.
GRAPH_FORMS = ("fused", "separate")
# ONNX Runtime fuses Add + LayerNormalization again when it loads a graph: a separate-form file names the fusions its
# sessions leave out (onnxfiles.DISABLED_OPTIMIZERS_KEY).
SEPARATE_FORM_DISABLED = ("SkipLayerNormFusion", "EmbedLayerNormFusion")


def optimize_fp32(original: Path, dest: Path, export: ExportMetrics, form: str = "fused") -> Any:
    """The transformer optimizer's fusions for the families it knows (layer norms in `form`, one of GRAPH_FORMS);
    ONNX Runtime's basic level for the others. The fusions run without the optimizer's symbolic shape inference
    (it copies the whole graph, weights included: a base-size model's peak memory 1 GB higher), and again with it
    only where attention then fused in fewer than every layer."""
    model = _fused(original, export, form, shape_inference=False)
    attention = sum(n.op_type in ATTENTION_OPS for n in model.graph.node)
    if export.optimizer_model_type and attention < export.num_layers:
        del model
        model = _fused(original, export, form, shape_inference=True)
    onnxfiles.save(model, dest)
    return model


def borrowed_fp32(original: Path, dest: Path, export: ExportMetrics) -> tuple[ModelProto, int]:
    """For a family without fusion rules of its own: the rules of the nearest family ONNX Runtime has them for
    (BORROWED_RULES, as Optimum maps such families), then attention with an additive position bias fused
    (`attention.fuse_biased_attention`); the graph and the number of layers whose attention that fused."""
    model = _fused(original, export, "fused", shape_inference=False, model_type=BORROWED_RULES)
    biased = fuse_biased_attention(model, export.num_heads)
    onnxfiles.save(model, dest)
    return model, biased


def _fused(original: Path, export: ExportMetrics, form: str, shape_inference: bool,
           model_type: str | None = None) -> ModelProto:
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    model_type = model_type or export.optimizer_model_type
    options = FusionOptions(model_type or "bert")
    options.enable_shape_inference = shape_inference
    separate = form == "separate" and model_type is not None
    if separate:
        options.enable_skip_layer_norm = options.enable_embed_layer_norm = False
    optimized = optimize_model(str(original), model_type=model_type or "bert", num_heads=export.num_heads,
                               hidden_size=export.hidden_size, opt_level=None if model_type else BASIC_LEVEL,
                               only_onnxruntime=not model_type, optimization_options=options)
    if separate:
        from onnx import helper

        helper.set_model_props(optimized.model, {onnxfiles.DISABLED_OPTIMIZERS_KEY: ",".join(SEPARATE_FORM_DISABLED)})
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


def _drop_repeated_nodes(graph: GraphProto) -> None:
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
    """Dynamic int8 quantization (QInt8 weights) of the already-optimized graph; attention with a position bias is
    unpacked first (`attention.unpack_biased_attention`). The quantizer holds one copy of the float weights
    (`_shapes_in_place`)."""
    import onnx
    from onnxruntime.quantization import QuantType, onnx_quantizer, quantize_dynamic

    workdir = temporary_dir(dest) if biased_attention(onnxfiles.skeleton(fp32), nodes_to_exclude) else None
    reload = onnx_quantizer.save_and_reload_model_with_shape_infer
    try:
        if workdir:
            model = onnxfiles.load(fp32)
            unpack_biased_attention(model, nodes_to_exclude)
            source = onnxfiles.save(model, workdir / "unpacked.onnx")
            del model
        else:
            source = fp32
        onnx_quantizer.save_and_reload_model_with_shape_infer = _shapes_in_place
        with onnxfiles.onnx_destination(dest) as tmp:
            quantize_dynamic(source, tmp, weight_type=QuantType.QInt8, per_channel=per_channel,
                             nodes_to_exclude=nodes_to_exclude or None,
                             use_external_data_format=onnxfiles.total_bytes(fp32) > onnxfiles.EXTERNAL_DATA_THRESHOLD,
                             extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    finally:
        onnx_quantizer.save_and_reload_model_with_shape_infer = reload
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return onnxfiles.skeleton(dest)


def _shapes_in_place(model: ModelProto) -> ModelProto:
    """`model` with the shapes ONNX's inference finds written into its value_info, inferred on a copy of the graph
    whose initializers keep their dims but not their values. It stands in for onnxruntime.quantization's
    `save_and_reload_model_with_shape_infer`, which the dynamic quantizer calls to refresh shapes: it deep-copies
    the model, saves the copy and loads it again, three copies of the weights at once (7 GB for a 2.27 GB model)."""
    import onnx
    from onnxruntime.quantization.quant_utils import add_infer_metadata

    alone = onnxfiles.without_weights(model)
    inferred = onnx.shape_inference.infer_shapes(alone)
    del model.graph.value_info[:]
    model.graph.value_info.extend(inferred.graph.value_info)
    add_infer_metadata(model)
    return model


def keep_in_fp32(quantized: ModelProto, source: ModelProto, names: Collection[str]) -> ModelProto:
    """A copy of `quantized` (`quantize_int8` of `source`) with the nodes `names` back as `source` has them: each
    takes the place of what computed its outputs in int8, with its float weights, and what nothing reads any more
    is dropped. Dynamic int8 quantizes each node on its own, so this is the graph `quantize_int8` builds with
    `names` excluded, in one edit instead of a new quantization."""
    from onnx import ModelProto as Model

    originals = {node.name: node for node in source.graph.node}
    missing = [name for name in names if name not in originals]
    if missing:
        raise ValueError(f"nodes {missing} are not in the graph that was quantized: name nodes of that graph")
    weights = {tensor.name: tensor for tensor in source.graph.initializer}
    restored = [originals[name] for name in _with_float_producers(list(names), quantized, source, weights)]
    read = list(dict.fromkeys(t for node in restored for t in node.input if t in weights))
    # what the restored nodes compute, and the float weights they read where the quantized graph computes them
    # (a weight shared with a quantized node is stored quantized and dequantized for its other readers)
    replaced = {output for node in restored for output in node.output if output} | set(read)
    model = Model()
    model.CopyFrom(quantized)
    kept = [node for node in model.graph.node if not replaced.intersection(node.output)]
    del model.graph.node[:]
    model.graph.node.extend([*kept, *restored])
    present = {tensor.name for tensor in model.graph.initializer}
    model.graph.initializer.extend(weights[name] for name in read if name not in present)
    topological(model.graph)
    remove_dead(model.graph)
    return model


def _with_float_producers(names: list[str], quantized: ModelProto, source: ModelProto,
                          weights: Collection[str]) -> list[str]:
    """`names` and, for each activation they read that `quantized` computes only in int8 (a Gather of an int8 table
    read by an int8 Transpose: MPNet's relative attention bias), the `source` node that computes it in float, until
    every input is there."""
    present = {o for node in quantized.graph.node for o in node.output} | {i.name for i in quantized.graph.input}
    producers = {output: node for node in source.graph.node for output in node.output}
    chosen = list(dict.fromkeys(names))
    nodes = {node.name: node for node in source.graph.node}
    for name in chosen:  # grows while it is walked
        for tensor in nodes[name].input:
            producer = producers.get(tensor)
            if tensor and tensor not in present and tensor not in weights and producer is not None \
                    and producer.name not in chosen:
                chosen.append(producer.name)
    return chosen


def quantize_int8_blockwise(fp32: Path, dest: Path, per_channel: bool, nodes_to_exclude: list[str],
                            blockwise: list[str], block_size: int, accuracy_level: int) -> Any:
    """Dynamic int8 except `nodes_to_exclude`; of those, the MatMuls in `blockwise` get 8-bit block-quantized weights
    (ONNX Runtime's MatMulNBits; activations stay fp32, `accuracy_level` 4 computes in int8) instead of fp32 ones."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantize_int8(fp32, dest, per_channel, nodes_to_exclude)
    quantizer = MatMulNBitsQuantizer(onnxfiles.load(dest), bits=8, block_size=block_size, is_symmetric=True,
                                     accuracy_level=accuracy_level, nodes_to_include=blockwise)
    quantizer.process()
    onnxfiles.save(quantizer.model.model, dest)
    return quantizer.model.model


def infer_shapes(original: Path, dest: Path) -> tuple[Any, str]:
    """The original graph with symbolic shapes everywhere (what TensorRT and its ORT EP parse best), and how they
    were inferred: ONNX Runtime's symbolic shape inference, or, where it fails on an operator version it does not
    know (e.g. ReduceL2 with axes as an input, opset 18), ONNX's own shape inference, which keeps named dims too.
    Both run on the graph without its external weights (each copies the model it is given, and ONNX's serializes
    it too: over 4x a large model's weights); the weights are copied beside `dest` as a file."""
    import onnx
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    original = original.resolve()
    with chdir(original.parent):  # the few values inference reads (a bias it adds) come from the data file there
        graph = onnxfiles.load(original, load_external_data=False)
        try:
            model = SymbolicShapeInference.infer_shapes(graph, auto_merge=True)
            method = "onnxruntime symbolic shape inference"
        except (TypeError, KeyError, AssertionError) as exc:
            model = onnx.shape_inference.infer_shapes(graph, data_prop=True)
            method = f"onnx shape inference (onnxruntime's symbolic inference failed: {type(exc).__name__}: {exc})"
    onnxfiles.save_beside_weights(model, dest, original)
    return model, method


def smoothing_targets(model: ModelProto) -> list[NodeProto]:
    """The nodes smoothing applies to: every MatMul / Attention with a 2-D weight of its own and an activation
    input. A weight several nodes read (ALBERT's shared layers) is left as it is: one scale cannot suit every
    reader's activations, and a copy per reader would store it that many times."""
    weights = {i.name: i for i in model.graph.initializer}
    readers = Counter(name for n in model.graph.node for name in n.input)
    return [n for n in model.graph.node if n.op_type in ("MatMul", "Attention") and len(n.input) > 1
            and n.input[1] in weights and len(weights[n.input[1]].dims) == 2 and n.input[0] not in weights
            and readers[n.input[1]] == 1]


def activation_ranges(fp32: Path, feeds: list[Feed]) -> Feed:
    """Per smoothing target's input activation, the largest |value| each channel reaches in fp32 on `feeds`
    (measured once, for any strength of smoothing)."""
    return channel_max(fp32, sorted({n.input[0] for n in smoothing_targets(onnxfiles.skeleton(fp32))}), feeds)


def smooth_activations(fp32: Path, dest: Path, ranges: Feed, alpha: float,
                       exclude: Collection[str] = (), external: bool = False) -> list[str]:
    """SmoothQuant-style smoothing for dynamic int8: before each MatMul / Attention with a 2-D weight, a Mul divides
    the activation's channels by s and the weight's rows are multiplied by s (the product is unchanged), with
    s = max|x|^alpha / max|w|^(1 - alpha) per input channel, `max|x|` as `ranges` has it (`activation_ranges`).
    Outlier channels then no longer set the per-tensor activation scale alone. Nodes named in `exclude` are left as
    they are; `external`: the weights saved beside the graph (`onnxfiles.save`). Returns the smoothed nodes' names.

    Hand-written because ONNX Runtime's own SmoothQuant (quantize_static's SmoothQuant option) needs Intel's
    neural-compressor 2.x and applies to static quantization only."""
    import numpy as np
    from onnx import helper, numpy_helper
    from onnx.external_data_helper import load_external_data_for_model

    model = onnxfiles.load(fp32, load_external_data=False)  # each weight read from the file when it is smoothed
    weights = {i.name: i for i in model.graph.initializer}
    targets = [n for n in smoothing_targets(model) if n.name not in exclude]
    nodes, smoothed = list(model.graph.node), []
    for node in targets:
        weight = numpy_helper.to_array(weights[node.input[1]], str(Path(fp32).parent))
        x_max = ranges.get(node.input[0])
        if x_max is None or x_max.shape[0] != weight.shape[0]:
            continue
        smoothed.append(node.name)
        w_max = np.abs(weight).max(axis=1)
        scale = np.where((x_max > 0) & (w_max > 0),
                         np.power(np.maximum(x_max, 1e-5), alpha) / np.power(np.maximum(w_max, 1e-5), 1 - alpha),
                         1.0).astype(np.float32)
        smoothed_weight = numpy_helper.from_array((weight * scale[:, None]).astype(weight.dtype),
                                                  f"{node.input[1]}_smoothed_{len(nodes)}")
        inverse = numpy_helper.from_array((1.0 / scale).astype(np.float32), f"{smoothed_weight.name}_inverse")
        model.graph.initializer.extend([smoothed_weight, inverse])
        smoothed_input = f"{node.input[0]}_smoothed_for_{node.name}"
        nodes.insert(nodes.index(node), helper.make_node("Mul", [node.input[0], inverse.name], [smoothed_input],
                                                         name=f"{node.name}_smooth"))
        node.input[0], node.input[1] = smoothed_input, smoothed_weight.name
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    used = {t for n in model.graph.node for t in n.input}
    kept = [i for i in model.graph.initializer if i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    load_external_data_for_model(model, str(Path(fp32).parent))  # the weights left as they were: the smoothed
    onnxfiles.save(model, dest, external)  # ones' originals are never all in memory beside them
    return smoothed


def down_projections(model: ModelProto) -> list[NodeProto]:
    """The MatMuls with a 2-D weight of more input than output channels (a transformer's feed-forward output)."""
    weights = {i.name: i for i in model.graph.initializer}
    return [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights
            and n.input[0] not in weights and len(weights[n.input[1]].dims) == 2
            and weights[n.input[1]].dims[0] > weights[n.input[1]].dims[1]]


def per_token_scales(fp32: Path, dest: Path) -> list[str]:
    """Per-token activation scales for dynamic int8 on the down projections. Before each, every token's vector is
    divided by its own max |x| (Abs, ReduceMax, Max with a tiny floor, Div); after it, the output is multiplied back
    (Mul): exact in fp32. Dynamic int8's one activation scale per tensor then no longer lets a few tokens' large
    values after the activation function coarsen every other token's, which decides short texts. Returns the
    rescaled nodes' names.

    Hand-written because ONNX Runtime's CPU DynamicQuantizeMatMul has one activation scale per tensor."""
    import numpy as np
    from onnx import helper, numpy_helper

    model = onnxfiles.load(fp32)
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    floor = numpy_helper.from_array(np.array(1e-12, np.float32), "per_token_scale_floor")
    axes = numpy_helper.from_array(np.array([-1], np.int64), "per_token_scale_axes")
    model.graph.initializer.extend([floor, axes] if opset >= 18 else [floor])  # ReduceMax takes axes as an input
    targets, nodes = down_projections(model), list(model.graph.node)
    for node in targets:
        x, name, out = node.input[0], node.name, node.output[0]
        reduce = (helper.make_node("ReduceMax", [f"{name}_abs", axes.name], [f"{name}_token_max"], keepdims=1,
                                   name=f"{name}_token_max") if opset >= 18 else
                  helper.make_node("ReduceMax", [f"{name}_abs"], [f"{name}_token_max"], keepdims=1, axes=[-1],
                                   name=f"{name}_token_max"))
        before = [helper.make_node("Abs", [x], [f"{name}_abs"], name=f"{name}_token_abs"), reduce,
                  helper.make_node("Max", [f"{name}_token_max", floor.name], [f"{name}_token_scale"],
                                   name=f"{name}_token_floor"),
                  helper.make_node("Div", [x, f"{name}_token_scale"], [f"{name}_per_token"], name=f"{name}_token_div")]
        after = helper.make_node("Mul", [f"{out}_per_token", f"{name}_token_scale"], [out], name=f"{name}_token_mul")
        node.input[0], node.output[0] = f"{name}_per_token", f"{out}_per_token"
        index = nodes.index(node)
        nodes[index:index + 1] = [*before, node, after]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    onnxfiles.save(model, dest)
    return [n.name for n in targets]


def channel_max(path: Path, tensors: list[str], feeds: list[Feed]) -> Feed:
    """Per last-dimension channel, the largest |value| each of `tensors` reaches in fp32 on `feeds`, run from the
    graph at `path`."""
    import numpy as np

    found: Feed = {}
    for values in onnxfiles.tensor_values(path, tensors, feeds):
        for name, value in values.items():
            peak = np.abs(value).reshape(-1, value.shape[-1]).max(axis=0)
            found[name] = np.maximum(found[name], peak) if name in found else peak
    return found

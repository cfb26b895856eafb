"""Attention with an additive position bias, fused into ONNX Runtime's contrib attention: the families whose
attention adds a relative position bias to the scores (MPNet) get no Attention fusion from ONNX Runtime's
transformer optimizer, which knows no bias there; its Attention and MultiHeadAttention take one as `attention_bias`.

Per layer the exported graph computes softmax((Q K^T) / c + bias + mask) V with Q, K, V the heads of three
projections (MatMul + Add, Reshape, Transpose); the fusion gives the scale 1/c and bias + mask (one Add per distinct
pair, shared by the layers) to one node whose output replaces the layer's merged heads: Attention with the three
projections' weights packed into one MatMul where they share their input and have constant weights, else
MultiHeadAttention on the three projections. Nodes left without consumers are removed. The int8 quantizer cannot
keep the bias of a packed Attention (`unpack_biased_attention`)."""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from onnx import GraphProto, ModelProto, NodeProto

MS_DOMAIN = "com.microsoft"
ATTENTION_OPS = ("Attention", "MultiHeadAttention", "QAttention")  # a layer's attention, fused


@dataclass(frozen=True)
class Match:
    """One layer's attention: its projections, scale, bias terms and the tensor the fused node replaces."""

    query: str
    key: str
    value: str
    scale: float
    bias: str
    mask: str
    output: str


def fuse_biased_attention(model: ModelProto, num_heads: int) -> int:
    """Replace every matched attention in `model` (changed in place; `num_heads` heads) by Attention (packed
    projections) or MultiHeadAttention with its position bias and mask as `attention_bias`; the number of layers
    fused."""
    from onnx import helper, numpy_helper

    graph = model.graph
    produced: dict[str, NodeProto] = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list[NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    constants = _constants(graph)
    matches = [m for node in graph.node if node.op_type == "Softmax"
               if (m := _match(node, produced, consumers, constants)) is not None]
    biases: dict[tuple[str, str], str] = {}
    for index, match in enumerate(matches):
        key = (match.bias, match.mask)
        if key not in biases:
            biases[key] = f"attention_bias_{len(biases)}"
            graph.node.append(helper.make_node("Add", list(key), [biases[key]], name=f"AttentionBias_{len(biases)}"))
        packed = _packed(match, produced, constants)
        if packed is not None:  # one MatMul for the three projections: ONNX Runtime's Attention
            source, weight, bias = packed
            names = [f"Attention_{index}_qkv_weight", f"Attention_{index}_qkv_bias"]
            graph.initializer.extend([numpy_helper.from_array(weight, names[0]),
                                      numpy_helper.from_array(bias, names[1])])
            graph.node.append(helper.make_node(
                "Attention", [source, *names, "", "", biases[key]], [match.output], name=f"Attention_{index}",
                domain=MS_DOMAIN, num_heads=num_heads, scale=match.scale))
        else:
            graph.node.append(helper.make_node(
                "MultiHeadAttention", [match.query, match.key, match.value, "", "", biases[key]], [match.output],
                name=f"MultiHeadAttention_{index}", domain=MS_DOMAIN, num_heads=num_heads, scale=match.scale))
        producer = produced[match.output]
        producer.output[0] = f"{match.output}_unfused"  # the old merge of heads now feeds nothing
    if matches:
        topological(graph)  # the fused nodes were appended last; dead nodes are found walking back in order
        remove_dead(graph)
        if not any(o.domain == MS_DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return len(matches)


def biased_attention(model: ModelProto, keep: Collection[str] = ()) -> list[NodeProto]:
    """The packed Attention nodes with an `attention_bias` and constant weights (but those named in `keep`): what
    `unpack_biased_attention` unpacks. The graph's structure is enough (`onnxfiles.skeleton`)."""
    initializers = {i.name for i in model.graph.initializer}
    return [node for node in model.graph.node
            if node.op_type == "Attention" and node.domain == MS_DOMAIN and node.name not in keep
            and len(node.input) >= 6 and node.input[5] and node.input[1] in initializers
            and node.input[2] in initializers]


def unpack_biased_attention(model: ModelProto, keep: Collection[str] = ()) -> int:
    """Turn each packed Attention with an `attention_bias` (but those named in `keep`) back into three projections
    (MatMul + Add) feeding MultiHeadAttention, in place: ONNX Runtime's int8 quantizer turns Attention into
    QAttention, which has no bias input and would drop the position bias and the mask; the projections it
    quantizes as MatMuls. The number of nodes unpacked."""
    from onnx import helper, numpy_helper

    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
    unpacked = 0
    for node in biased_attention(model, keep):
        weights = np.split(numpy_helper.to_array(initializers[node.input[1]]), 3, axis=1)
        biases = np.split(numpy_helper.to_array(initializers[node.input[2]]), 3)
        projections = []
        for part, weight, bias in zip("qkv", weights, biases):
            name = f"{node.name}_{part}"
            graph.initializer.extend([numpy_helper.from_array(np.ascontiguousarray(weight), f"{name}_weight"),
                                      numpy_helper.from_array(bias, f"{name}_bias")])
            graph.node.extend([
                helper.make_node("MatMul", [node.input[0], f"{name}_weight"], [f"{name}_matmul"],
                                 name=f"{name}_MatMul"),
                helper.make_node("Add", [f"{name}_matmul", f"{name}_bias"], [f"{name}_projected"],
                                 name=f"{name}_Add")])
            projections.append(f"{name}_projected")
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        graph.node.append(helper.make_node(
            "MultiHeadAttention", [*projections, "", "", node.input[5]], list(node.output),
            name=f"{node.name}_unpacked", domain=MS_DOMAIN, num_heads=attributes["num_heads"],
            scale=attributes.get("scale", 0.0)))
        graph.node.remove(node)
        unpacked += 1
    if unpacked:
        topological(graph)
        remove_dead(graph)
    return unpacked


def _packed(match: Match, produced: dict[str, NodeProto],
            constants: dict[str, np.ndarray]) -> tuple[str, np.ndarray, np.ndarray] | None:
    """The input the three projections share and their weights and biases side by side, when they are MatMul +
    Add of one tensor with constant weights."""
    parts = []
    for name in (match.query, match.key, match.value):
        add = produced[name]
        matmul = next((produced[i] for i in add.input if i in produced and produced[i].op_type == "MatMul"), None)
        bias = next((i for i in add.input if i in constants), None)
        if matmul is None or bias is None or matmul.input[1] not in constants:
            return None
        parts.append((matmul.input[0], constants[matmul.input[1]], constants[bias]))
    sources = {source for source, _, _ in parts}
    if len(sources) != 1 or any(w.ndim != 2 or b.ndim != 1 for _, w, b in parts):
        return None
    return sources.pop(), np.concatenate([w for _, w, _ in parts], axis=1), np.concatenate([b for _, _, b in parts])


def _constants(graph: GraphProto) -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    found = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            found[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return found


def _parent(name: str, produced: dict[str, NodeProto], op: str) -> NodeProto | None:
    node = produced.get(name)
    return node if node is not None and node.op_type == op else None


def _perm(node: NodeProto) -> list[int]:
    from onnx import helper

    return next((list(helper.get_attribute_value(a)) for a in node.attribute if a.name == "perm"), [])


def _heads(transposed: str, produced: dict[str, NodeProto], perm: list[int]) -> str | None:
    """The projection (MatMul + Add) whose heads `transposed` holds, split by Reshape and transposed by `perm`."""
    transpose = _parent(transposed, produced, "Transpose")
    if transpose is None or _perm(transpose) != perm:
        return None
    reshape = _parent(transpose.input[0], produced, "Reshape")
    add = _parent(reshape.input[0], produced, "Add") if reshape is not None else None
    if add is None or not any(_parent(i, produced, "MatMul") for i in add.input):
        return None
    return add.output[0]


def _match(softmax: NodeProto, produced: dict[str, NodeProto], consumers: dict[str, list[NodeProto]],
           constants: dict[str, np.ndarray]) -> Match | None:
    """softmax(MatMul(Q, K^T) / c + bias + mask) then MatMul with V, heads merged by Transpose + Reshape."""
    masked = _parent(softmax.input[0], produced, "Add")
    biased = _parent(masked.input[0], produced, "Add") if masked is not None else None
    scaled = _parent(biased.input[0], produced, "Div") if biased is not None else None
    scores = _parent(scaled.input[0], produced, "MatMul") if scaled is not None else None
    if scores is None or scaled.input[1] not in constants:
        return None
    query = _heads(scores.input[0], produced, [0, 2, 1, 3])
    key = _heads(scores.input[1], produced, [0, 2, 3, 1])
    after = consumers.get(softmax.output[0], [])
    weighted = after[0] if len(after) == 1 and after[0].op_type == "MatMul" else None
    value = _heads(weighted.input[1], produced, [0, 2, 1, 3]) if weighted is not None else None
    merged = consumers.get(weighted.output[0], []) if weighted is not None else []
    transpose = merged[0] if len(merged) == 1 and merged[0].op_type == "Transpose" else None
    reshape = [n for n in consumers.get(transpose.output[0], []) if n.op_type == "Reshape"] if transpose else []
    if query is None or key is None or value is None or transpose is None or _perm(transpose) != [0, 2, 1, 3] \
            or len(reshape) != 1:
        return None
    return Match(query, key, value, float(1.0 / constants[scaled.input[1]].item()), biased.input[1],
                 masked.input[1], reshape[0].output[0])


def remove_dead(graph: GraphProto) -> None:
    """Drop nodes no graph output depends on (what the fused nodes replaced), then unused initializers."""
    needed = {o.name for o in graph.output}
    keep: list[NodeProto] = []
    for node in reversed(list(graph.node)):
        if any(out in needed for out in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
    kept = list(reversed(keep))
    del graph.node[:]
    graph.node.extend(kept)
    used = {i for n in kept for i in n.input}
    initializers = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(initializers)


def topological(graph: GraphProto) -> None:
    """Order the nodes so each comes after the producers of its inputs."""
    available = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        ready = [n for n in pending if all(i in available for i in n.input)]
        if not ready:
            raise ValueError("the graph has a cycle or an input nothing produces")
        for node in ready:
            ordered.append(node)
            available.update(node.output)
        pending = [n for n in pending if n not in ready]
    del graph.node[:]
    graph.node.extend(ordered)

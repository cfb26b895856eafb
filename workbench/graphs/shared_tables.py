"""Stored tables several nodes read (ALBERT's layers share one set of weights; the exporter hands each layer the
table through an Identity node), rewritten into the forms the tools that read the graph handle: NNCF finds a weight
only where a MatMul reads the table itself (`untied`), and OpenVINO's CPU plugin keeps one packed copy of a weight
only where its FullyConnected layers read it as their transposed operand (`transposed_once`)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from workbench.graphs import onnxfiles

if TYPE_CHECKING:
    from onnx import ModelProto, NodeProto


def readers(model: ModelProto) -> dict[str, list[NodeProto]]:
    """Per tensor, the nodes that read it."""
    found: dict[str, list[NodeProto]] = {}
    for node in model.graph.node:
        for tensor in node.input:
            found.setdefault(tensor, []).append(node)
    return found


def untied(path: Path) -> ModelProto:
    """The graph at `path` with no stored table behind an Identity node. A table that only MatMuls read, as their
    weight, is read by them directly: NNCF quantizes it once, skips smoothing it (its rule for a shared weight) and
    the int8 graph stores it once. Any other shared table is copied per Identity, under the Identity's output name."""
    from onnx import TensorProto

    model = onnxfiles.load(path)
    stored = {tensor.name: tensor for tensor in model.graph.initializer}
    read_by = readers(model)
    shares: dict[str, list[NodeProto]] = {}
    for node in model.graph.node:
        if node.op_type == "Identity" and node.input[0] in stored:
            shares.setdefault(node.input[0], []).append(node)
    for table, identities in shares.items():
        names = {table, *(node.output[0] for node in identities)}
        users = [user for name in names for user in read_by.get(name, []) if user not in identities]
        as_weight = all(user.op_type == "MatMul" and user.input[1] in names and user.input[0] not in names
                        for user in users)
        for node in identities:
            if as_weight:
                for user in read_by.get(node.output[0], []):
                    user.input[:] = [table if tensor == node.output[0] else tensor for tensor in user.input]
            else:
                copy = TensorProto()
                copy.CopyFrom(stored[table])
                copy.name = node.output[0]
                model.graph.initializer.append(copy)
            model.graph.node.remove(node)
    return model


def transposed_once(model: ModelProto) -> None:
    """Each 2-D table that several MatMuls read as their weight stored transposed, once, each reader given a
    Transpose of it, in place. OpenVINO folds a Transpose into its FullyConnected layer's transposed operand and
    packs such a weight once for all its readers, where it packs a plain MatMul weight once per reader: ALBERT-base
    compiled at bf16 held 475 MB instead of 161 MB and ran 1.34x OpenVINO's own IR's time at b1 s16 (0.99x with one
    table; 2 threads, AMD EPYC with avx512_bf16)."""
    from onnx import NodeProto, helper, numpy_helper

    stored = {tensor.name: tensor for tensor in model.graph.initializer}
    shared = {name: users for name, users in readers(model).items()
              if name in stored and len(stored[name].dims) == 2 and len(users) > 1
              and all(user.op_type == "MatMul" and list(user.input).index(name) == 1 for user in users)}
    if not shared:
        return
    views: dict[str, NodeProto] = {}  # by the output of the reader it goes before
    for name, users in shared.items():
        table = stored[name]
        table.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(table).T), f"{name}.T"))
        for number, user in enumerate(users):
            view = f"{name}.T.{number}"
            views[user.output[0]] = helper.make_node("Transpose", [f"{name}.T"], [view], name=view, perm=[1, 0])
            user.input[1] = view
    ordered = []
    for node in model.graph.node:
        copy = NodeProto()
        copy.CopyFrom(node)
        ordered.extend([views[node.output[0]], copy] if node.output and node.output[0] in views else [copy])
    model.graph.ClearField("node")
    model.graph.node.extend(ordered)

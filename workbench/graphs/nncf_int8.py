"""OpenVINO's int8: NNCF's post-training quantization (its ONNX backend, the transformer model type) of the exported
graph, calibrated on real text. The result is a QDQ ONNX graph marked for OpenVINO (`onnxfiles.RUNTIME_KEY`), whose
CPU plugin runs its MatMuls with int8 kernels; ONNX Runtime would run the same file with other kernels and other
rounding, so it is never given it.

A repair undoes chosen activation quantizers (`keep_in_float`): the nodes that read them get back the original
graph's inputs, float weights and biases; one graph edit, no new calibration."""
from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from workbench.core.atomic import temporary_dir
from workbench.graphs import onnxfiles, shared_tables
from workbench.graphs.variants import activation_ranges, smooth_activations
from workbench.models.batches import Feed
from workbench.models.footprint import release_memory

if TYPE_CHECKING:
    from onnx import ModelProto, NodeProto, TensorProto

# Corpus texts NNCF collects activation statistics on. Measured on all-MiniLM-L6-v2 against its fp32 graph, 304
# corpus texts: 32 texts, min cosine 0.851 (19 texts below 0.99); 64, 0.904 (8); 128, 0.926 (4); the build's time
# grows with them (11 s, 14 s, 20 s on 2 cores).
CALIBRATION_TEXTS = 128
# How much of an outlier channel's range the smoothing before NNCF moves into the weights. Measured against the
# library, 321 lab texts, min cosine of sentence_embedding (ranges from the 128 calibration texts): all-MiniLM-L6-v2
# 0.940 at 0.85 (NNCF's own SmoothQuant 0.926); all-mpnet-base-v2 0.956 (0.898 at 0.95, 0.492 at 0.5, NNCF's own 0.902).
SMOOTHING_ALPHA = 0.85



def nncf_problem() -> str | None:
    """Why NNCF cannot quantize here, or None."""
    try:
        import nncf  # noqa: F401
    except ImportError as exc:
        return f"NNCF is not installed ({exc})"
    return None


def quantizer() -> str:
    """The quantizer and its settings, as the record names them."""
    import nncf

    return f"NNCF {nncf.__version__}, model type transformer, {CALIBRATION_TEXTS} calibration texts at most"


@dataclass(frozen=True)
class Quantizer:
    """What NNCF quantized at one place: an activation (`source`: the unquantized tensor its QuantizeLinear reads)
    or a stored table, e.g. an embedding (`source` None: its readers get the original graph's float table back);
    the DequantizeLinear nodes whose values the graph reads instead."""

    source: str | None
    dequantizes: tuple[NodeProto, ...]


def quantizers(model: ModelProto) -> dict[str, Quantizer]:
    """The graph's quantizers by node name: each QuantizeLinear with the DequantizeLinear nodes that read it, and
    each DequantizeLinear of a stored table that only Gathers read (MatMul weights are stored quantized too, and
    come back with the MatMul a repair restores)."""
    stored = {tensor.name for tensor in model.graph.initializer}
    readers = shared_tables.readers(model)
    found = {}
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear":
            found[node.name] = Quantizer(node.input[0], tuple(
                r for r in readers.get(node.output[0], []) if r.op_type == "DequantizeLinear"))
        elif node.op_type == "DequantizeLinear" and node.input[0] in stored and readers.get(node.output[0]) and all(
                r.op_type == "Gather" for r in readers[node.output[0]]):
            found[node.name] = Quantizer(None, (node,))
    return found


def keep_in_float(quantized: Path, original: Path, dest: Path, names: Sequence[str]) -> None:
    """`quantized` with the quantizers `names` (of `quantizers`) undone, written to `dest`: each node that read
    their dequantized values is restored as `original` has it (its unquantized inputs, its float weights, and the
    bias NNCF's bias correction changed in the node that adds it), or, without a counterpart there, reads the
    unquantized activation; the nodes nothing reads any more are dropped."""
    model, source = onnxfiles.load(quantized), shared_tables.untied(original)
    found = quantizers(model)
    undone = {dequantize.output[0]: found[name].source for name in names for dequantize in found[name].dequantizes}
    counterparts = {node.name: node for node in source.graph.node}
    weights = {tensor.name: tensor for tensor in source.graph.initializer}
    produced = {o for node in model.graph.node for o in node.output} | {i.name for i in model.graph.input}
    readers = [node for node in model.graph.node if any(tensor in undone for tensor in node.input)]
    for node in readers:
        counterpart = counterparts.get(node.name)
        if counterpart is None or counterpart.op_type != node.op_type or not all(
                tensor in produced or tensor in weights for tensor in counterpart.input):
            node.input[:] = [undone.get(tensor) or tensor for tensor in node.input]
            continue
        _restore(model, node, counterpart, weights)
        for consumer in model.graph.node:  # the bias add after a MatMul
            twin = counterparts.get(consumer.name)
            if node.output[0] in consumer.input and twin is not None and twin.op_type == consumer.op_type:
                _restore(model, consumer, twin, weights, constants_only=True)
    del source, weights, counterparts  # the copies it needs are in `model`: one graph in memory while it is saved
    _drop_unread(model)
    onnxfiles.save(model, dest, external=True)  # written tensor by tensor, not serialized whole first


def _restore(model: ModelProto, node: NodeProto, counterpart: NodeProto, weights: dict[str, TensorProto],
             constants_only: bool = False) -> None:
    """`node`'s inputs as `counterpart` (the original graph's node) has them, its initializers copied in under new
    names (`constants_only`: only the inputs that are initializers there)."""
    present = {tensor.name for tensor in model.graph.initializer}
    for position, tensor in enumerate(counterpart.input):
        if tensor in weights:
            copy = f"{tensor}.float"
            if copy not in present:
                model.graph.initializer.append(weights[tensor])
                model.graph.initializer[-1].name = copy
                present.add(copy)
            node.input[position] = copy
        elif not constants_only:
            node.input[position] = tensor


def quantizer_costs(quantized: Path, costs: dict[str, float]) -> dict[str, float]:
    """Per quantizer, the compute it feeds: the summed `costs` (by node name) of the nodes that read its dequantized
    values."""
    model = onnxfiles.load(quantized, load_external_data=False)
    readers = shared_tables.readers(model)
    return {name: sum(costs.get(reader.name, 0.0) for dequantize in found.dequantizes
                      for reader in readers.get(dequantize.output[0], []))
            for name, found in quantizers(model).items()}


def _drop_unread(model: ModelProto) -> None:
    """Remove nodes none of whose outputs is read (by a node or as a graph output), until none is left."""
    while True:
        read = {name for node in model.graph.node for name in node.input} | {o.name for o in model.graph.output}
        unread = [node for node in model.graph.node if not any(output in read for output in node.output)]
        if not unread:
            return
        for node in unread:
            model.graph.node.remove(node)


def noise_order(quantized: Path, original: Path, feeds: Sequence[Feed]) -> dict[str, float]:
    """Per quantizer, the signal-to-quantization-noise ratio (dB): of an activation on `feeds` (its input against
    its dequantized output, run by ONNX Runtime), of a table against `original`'s; noisiest first."""
    from onnx import numpy_helper

    model = onnxfiles.load(quantized)
    found = quantizers(model)
    exact_tables = {name: numpy_helper.to_array(table).astype(np.float64)
                    for name, table in _original_tables(model, shared_tables.untied(original), found).items()}
    pairs = {name: (q.source, q.dequantizes[0].output[0])
             for name, q in found.items() if q.dequantizes and (q.source or name in exact_tables)}
    del model, found  # the session reads the file again: one graph in memory at a time
    marked = sorted({t for pair in pairs.values() for t in pair if t})
    signal, noise = dict.fromkeys(pairs, 0.0), dict.fromkeys(pairs, 0.0)
    for values in onnxfiles.tensor_values(quantized, marked, list(feeds)):
        for name, (before, after) in pairs.items():
            exact = exact_tables[name] if before is None else values[before].astype(np.float64)
            signal[name] += float(np.sum(exact ** 2))
            noise[name] += float(np.sum((values[after] - exact) ** 2))
    sqnr = {name: 10 * np.log10(max(signal[name], 1e-30) / max(noise[name], 1e-30)) for name in pairs}
    return {name: round(float(db), 3) for name, db in sorted(sqnr.items(), key=lambda item: item[1])}


def _original_tables(model: ModelProto, source: ModelProto, found: dict[str, Quantizer]) -> dict[str, TensorProto]:
    """Per stored-table quantizer, the float table its first reader reads in the original graph."""
    counterparts = {node.name: node for node in source.graph.node}
    weights = {tensor.name: tensor for tensor in source.graph.initializer}
    readers = shared_tables.readers(model)
    tables = {}
    for name, quantizer in found.items():
        first = readers.get(quantizer.dequantizes[0].output[0]) if quantizer.source is None else None
        twin = counterparts.get(first[0].name) if first else None
        if twin is not None and twin.input[0] in weights:
            tables[name] = weights[twin.input[0]]
    return tables


def quantize_openvino_int8(original: Path, dest: Path, feeds: Sequence[Feed]) -> None:
    """NNCF's int8 of `original` calibrated on `feeds` (one text each), written to `dest` with the OpenVINO runtime
    in its metadata (the optimize step tries it only where `nncf_problem` finds none).

    The activations are smoothed first by the workbench (`variants.smooth_activations`, alpha SMOOTHING_ALPHA,
    ranges measured on `feeds`) instead of NNCF's own SmoothQuant, whose ONNX backend writes the smoothed weights
    into the graph and then copies the whole graph at every shape inference: 4.9 GB for a 110M model. Without it NNCF
    (its min-max quantizers and bias correction) works on the graph with the weights left on disk (its
    EXTERNAL_DATA_DIR): 2.0 GB at the most, 42 s instead of 67 s, for all-mpnet-base-v2."""
    import io
    import logging
    from contextlib import redirect_stdout

    import nncf
    from nncf.onnx.quantization.backend_parameters import BackendParameters
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, AdvancedSmoothQuantParameters
    from onnx import helper

    nncf.set_log_level(logging.ERROR)
    workdir = temporary_dir(dest)  # the graphs on the way; removed however the build ends
    try:
        untied, smoothed = workdir / "untied.onnx", workdir / "smoothed.onnx"
        onnxfiles.save(shared_tables.untied(original), untied, external=True)
        release_memory()
        smooth_activations(untied, smoothed, activation_ranges(untied, list(feeds)), SMOOTHING_ALPHA, external=True)
        release_memory()
        without = AdvancedSmoothQuantParameters(matmul=-1, convolution=-1)
        settings = AdvancedQuantizationParameters(smooth_quant_alphas=without, backend_params={
            BackendParameters.EXTERNAL_DATA_DIR: str(workdir), BackendParameters.COMPRESS_WEIGHTS: False})
        with redirect_stdout(io.StringIO()), rich_as_text(), weights_read_once():  # NNCF's bars; the step has its own
            quantized = nncf.quantize(onnxfiles.load(smoothed, load_external_data=False),
                                      nncf.Dataset(list(feeds)), model_type=nncf.ModelType.TRANSFORMER,
                                      subset_size=len(feeds), advanced_parameters=settings)
        stored_int8(quantized)
        unsigned_activations(quantized)
        helper.set_model_props(quantized, {onnxfiles.RUNTIME_KEY: "openvino"})
        onnxfiles.save(quantized, dest)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@contextmanager
def rich_as_text() -> Iterator[None]:
    """rich's consoles (NNCF's progress bars) write text while active, as outside a notebook: in a notebook kernel
    rich shows each bar as a Jupyter widget, a blank space in a saved notebook and an error once it is reopened."""
    import rich.console

    detect = rich.console._is_jupyter  # rich's own test, by the IPython shell's class; no setting reaches it
    rich.console._is_jupyter = lambda: False
    try:
        yield
    finally:
        rich.console._is_jupyter = detect


CHUNK_VALUES = 2**24  # a weight's values quantized at a time by `stored_int8` (64 MB of fp32)


def stored_int8(model: ModelProto) -> None:
    """Each weight a QuantizeLinear reads, stored quantized in its place and the QuantizeLinear removed, in place:
    NNCF's own weight compression (its ONNX backend's last pass), a slice of rows at a time. NNCF's runs ONNX's
    reference QuantizeLinear on each whole weight, whose temporaries held 4 GB for a 1 GB embedding table; the
    operation is elementwise, so the same operation on row slices gives the same values (tested)."""
    from onnx import numpy_helper
    from onnx.reference.ops._op_list import load_op

    quantize = load_op("", "QuantizeLinear", max(model.opset_import[0].version, 19))
    stored = {tensor.name: tensor for tensor in model.graph.initializer}
    for node in [n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] in stored]:
        weight = numpy_helper.to_array(stored[node.input[0]])
        scale, zero = (numpy_helper.to_array(stored[name]) if name in stored else None
                       for name in (node.input[1], node.input[2] if len(node.input) > 2 else ""))
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        if weight.size <= CHUNK_VALUES:
            values = quantize.eval(weight, scale, zero, axis=axis)
        else:  # row slices, each with its rows' scales where there is one scale per row
            rows, per_row = max(1, CHUNK_VALUES // weight[0].size), axis % weight.ndim == 0 and scale.ndim > 0
            values = np.concatenate([quantize.eval(
                weight[start:start + rows], scale[start:start + rows] if per_row else scale,
                zero[start:start + rows] if per_row and zero is not None else zero, axis=axis)
                for start in range(0, len(weight), rows)])
        model.graph.initializer.remove(stored.pop(node.input[0]))
        del weight
        model.graph.initializer.append(numpy_helper.from_array(values, node.output[0]))
        model.graph.node.remove(node)


@contextmanager
def weights_read_once() -> Iterator[None]:
    """For the call only: NNCF's ONNX statistics read each weight its quantizers need (tables, MatMul weights) once,
    from the file, instead of as an output of the graph on every calibration text.

    NNCF 3.4 adds every such weight to the graph's outputs, so ONNX Runtime copies all of them out on each text and
    NNCF reduces every copy, though a weight's collector keeps its first only (one sample): 2.3 GB a text for a 568M
    model, most of a 6.5-minute calibration and 3.6 GB of its peak. Registered once from the file instead, each weight
    gives the same statistics (tested: the same quantized graph as NNCF's own)."""
    from nncf.common.graph.transformations.commands import TargetType
    from nncf.common.tensor_statistics.statistic_point import StatisticPointsContainer
    from nncf.onnx.graph.onnx_helper import get_array_from_tensor, get_tensor
    from nncf.onnx.statistics.aggregator import ONNXStatisticsAggregator
    from nncf.tensor import Tensor

    def split(points: StatisticPointsContainer, weights: bool) -> StatisticPointsContainer:
        kept = StatisticPointsContainer()
        for node, found in points.items():
            chosen = [p for p in found if (p.target_point.type == TargetType.OPERATION_WITH_WEIGHTS) == weights]
            if chosen:
                kept[node] = chosen
        return kept

    collect, outputs, register = (ONNXStatisticsAggregator.collect_statistics,
                                  ONNXStatisticsAggregator._get_transformation_layout_extra_outputs,
                                  ONNXStatisticsAggregator._register_statistics)

    def collect_from(self: ONNXStatisticsAggregator, model: ModelProto, graph: object) -> None:
        self._weights_from = model  # read in the first registration
        collect(self, model, graph)

    def register_once(self: ONNXStatisticsAggregator, values: dict[str, Tensor],
                      points: StatisticPointsContainer) -> None:
        register(self, values, split(points, weights=False))
        model, self._weights_from = self._weights_from, None
        for _, point, collector in split(points, weights=True).get_tensor_collectors() if model else ():
            node = self.node_mapping[point.target_point.target_node_name]
            value = Tensor(get_array_from_tensor(model, get_tensor(model, node.input[point.target_point.port_id])))
            collector.register_inputs({hash(reducer): [value] for reducer in collector.reducers})

    ONNXStatisticsAggregator.collect_statistics = collect_from
    ONNXStatisticsAggregator._get_transformation_layout_extra_outputs = lambda self, points: outputs(
        self, split(points, weights=False))
    ONNXStatisticsAggregator._register_statistics = register_once
    try:
        yield
    finally:
        ONNXStatisticsAggregator.collect_statistics = collect
        ONNXStatisticsAggregator._get_transformation_layout_extra_outputs = outputs
        ONNXStatisticsAggregator._register_statistics = register


def unsigned_activations(model: ModelProto) -> None:
    """Each activation quantizer with a nonzero int8 zero point moved to uint8, on the same grid (values and zero
    point + 128), in place. OpenVINO's CPU plugin multiplies uint8 activations by int8 weights directly (VNNI's
    u8 x s8), but gives an int8 activation with a zero point a subtraction first; symmetric quantizers stay int8,
    which its int8 attention needs. Measured on a BERT-base export, 2 threads: 34.8 -> 30.5 ms at b1 s128, the time
    of NNCF's own OpenVINO-backend int8."""
    from onnx import TensorProto, numpy_helper

    stored = {tensor.name: tensor for tensor in model.graph.initializer}
    readers = shared_tables.readers(model)
    declared = {info.name: info for info in model.graph.value_info}
    replaced = set()
    for node in model.graph.node:
        zero = stored.get(node.input[2]) if node.op_type == "QuantizeLinear" and len(node.input) > 2 else None
        values = numpy_helper.to_array(zero) if zero is not None else None
        if values is None or values.dtype != np.int8 or not values.any():
            continue
        shifted = numpy_helper.from_array((values.astype(np.int16) + 128).astype(np.uint8), f"{zero.name}.u8")
        if shifted.name not in stored:
            model.graph.initializer.append(shifted)
            stored[shifted.name] = shifted
        for user in [node, *(r for r in readers.get(node.output[0], []) if r.op_type == "DequantizeLinear")]:
            replaced.add(user.input[2])
            user.input[2] = shifted.name
        if node.output[0] in declared:
            declared[node.output[0]].type.tensor_type.elem_type = TensorProto.UINT8
    read = {tensor for node in model.graph.node for tensor in node.input}
    for name in replaced - read:
        model.graph.initializer.remove(stored[name])

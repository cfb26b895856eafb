"""Borrowed fusion rules for a family without its own (MPNet): attention with its position bias fused, and the graph
kept only when its outputs match the basic graph's and, with optimize.borrowed_rules=auto, it is measured faster."""
from __future__ import annotations

from dataclasses import replace

import pytest
from onnx import numpy_helper

from workbench.core.config import RunConfig
from workbench.core.record import RunRecord
from workbench.graphs import onnxfiles
from workbench.graphs.attention import fuse_biased_attention, unpack_biased_attention
from workbench.graphs.tables import ExportMetrics
from workbench.graphs.variants import borrowed_fp32, keep_in_fp32, optimize_fp32, quantize_int8
from workbench.measure import forms
from workbench.measure.forms import RaceBench
from workbench.models.families import BORROWED_RULES
from workbench.models.tiny import build_encoder
from workbench.steps import export

from .conftest import run_race_bench

SMALL = {"batch": {"min": 1, "opt": 4, "max": 8}, "sequence": {"min": 1, "opt": 32, "max": 64}}


@pytest.fixture(scope="module")
def mpnet_graphs(tmp_path_factory):
    """A tiny MPNet exported, then its basic graph and the one fused with borrowed rules, and real-text feeds."""
    root = tmp_path_factory.mktemp("mpnet")
    config = RunConfig.model_validate({"model": str(build_encoder(root / "model", "mpnet")), **SMALL})
    record = RunRecord.create(root / "run", config)
    export.run(config, record)
    info = record.needed(ExportMetrics)
    files = {"basic": root / "basic.onnx", "borrowed": root / "borrowed.onnx"}
    optimize_fp32(record.artifact("onnx.original"), files["basic"], info)
    _, biased = borrowed_fp32(record.artifact("onnx.original"), files["borrowed"], info)
    return files, biased, replace(run_race_bench(config, record), threads=1)


def difference(files, bench: RaceBench):
    with bench.open(files) as runners:
        return forms.largest_difference(*runners.values(), bench.feeds)


def test_attention_with_its_position_bias_fuses_in_every_layer(mpnet_graphs):
    files, biased, bench = mpnet_graphs
    assert biased == 2
    graph = onnxfiles.load(files["borrowed"]).graph
    assert [n.op_type for n in graph.node].count("Softmax") == 0, "no unfused attention left"
    largest, matches = difference(files, bench)
    assert matches and largest < 1e-5


def test_int8_quantizes_the_projections_and_keeps_the_position_bias(mpnet_graphs, tmp_path):
    """ONNX Runtime's quantizer would turn Attention into QAttention, which has no bias input: the position bias and
    the mask would be dropped. The projections are unpacked and quantized; attention keeps its bias."""
    files, _, bench = mpnet_graphs
    model = onnxfiles.load(files["borrowed"])
    assert unpack_biased_attention(model) == 2
    unpacked = onnxfiles.save(model, tmp_path / "unpacked.onnx")
    largest, matches = difference({"packed": files["borrowed"], "unpacked": unpacked}, bench)
    assert matches and largest < 1e-5
    quantize_int8(files["borrowed"], tmp_path / "int8.onnx", True, [])
    ops = [(n.op_type, n) for n in onnxfiles.load(tmp_path / "int8.onnx").graph.node]
    assert not [n for op, n in ops if op == "QAttention"]
    attention = [n for op, n in ops if op == "MultiHeadAttention"]
    assert len(attention) == 2 and all(n.input[5] for n in attention)
    assert sum(op in ("MatMulInteger", "DynamicQuantizeMatMul") for op, _ in ops) >= 6, "q, k, v of both layers"
    quantize_int8(files["borrowed"], tmp_path / "kept.onnx", True, ["Attention_0"])
    kept = [n.name for n in onnxfiles.load(tmp_path / "kept.onnx").graph.node if n.op_type == "Attention"]
    assert kept == ["Attention_0"], "a node the repair keeps in fp32 stays packed"


def test_a_node_kept_in_fp32_by_splicing_is_what_requantizing_without_it_builds(mpnet_graphs, tmp_path):
    """The int8 repair's candidates splice nodes' fp32 form into one quantized graph (`keep_in_fp32`) instead of
    quantizing again without them: the outputs are the same to the bit, a packed attention with its position bias
    included (the quantized graph has it unpacked)."""
    files, _, bench = mpnet_graphs
    quantize_int8(files["borrowed"], tmp_path / "int8.onnx", True, [])
    quantized, source = onnxfiles.load(tmp_path / "int8.onnx"), onnxfiles.load(files["borrowed"])
    ops = {n.name: n.op_type for n in source.graph.node}
    matmuls, gather = [n for n, op in ops.items() if op == "MatMul"], next(n for n, op in ops.items() if op == "Gather")
    for blocked in (["Attention_0"], matmuls[:2], [gather, matmuls[-1], "Attention_1"]):
        spliced = onnxfiles.save(keep_in_fp32(quantized, source, blocked), tmp_path / "spliced.onnx")
        quantize_int8(files["borrowed"], tmp_path / "rebuilt.onnx", True, blocked)
        kept = {n.name: n.op_type for n in onnxfiles.load(spliced).graph.node}
        assert all(kept.get(name) == ops[name] for name in blocked), "each is back as the source has it"
        assert difference({"rebuilt": tmp_path / "rebuilt.onnx", "spliced": spliced}, bench) == (0.0, True)
    assert len(keep_in_fp32(quantized, source, []).graph.node) == len(quantized.graph.node), "nothing to undo"
    with pytest.raises(ValueError, match=r"nodes \['nope'\] are not in the graph that was quantized"):
        keep_in_fp32(quantized, source, ["nope"])


def test_a_node_whose_float_input_the_int8_graph_lacks_is_kept_with_its_producer(mpnet_graphs, tmp_path):
    """The basic graph's relative position bias: ONNX Runtime quantizes its Gather and the Transpose after it, so the
    Gather's float output exists nowhere in the int8 graph; keeping the Transpose in fp32 keeps that Gather too.
    Every quantized node alone splices into a graph that runs, close to the int8 graph's answers."""
    from onnxruntime.quantization.registry import IntegerOpsRegistry

    files, _, bench = mpnet_graphs
    quantize_int8(files["basic"], tmp_path / "int8.onnx", True, [])
    quantized, source = onnxfiles.load(tmp_path / "int8.onnx"), onnxfiles.load(files["basic"])
    present = {o for n in quantized.graph.node for o in n.output}
    transpose = next(n for n in source.graph.node if n.op_type == "Transpose" and n.input[0] not in present)
    spliced = {n.name: n.op_type for n in keep_in_fp32(quantized, source, [transpose.name]).graph.node}
    gather = next(n for n in source.graph.node if transpose.input[0] in n.output)
    assert spliced.get(transpose.name) == "Transpose" and spliced.get(gather.name) == "Gather"
    for node in [n for n in source.graph.node if n.op_type in IntegerOpsRegistry]:
        onnxfiles.save(keep_in_fp32(quantized, source, [node.name]), tmp_path / "one.onnx")
        largest, _ = difference({"int8": tmp_path / "int8.onnx", "one": tmp_path / "one.onnx"}, bench)
        assert largest < 0.5, node.name


def test_a_graph_whose_outputs_differ_is_not_kept(mpnet_graphs, tmp_path):
    files, _, bench = mpnet_graphs
    model = onnxfiles.load(files["borrowed"])
    weight = next(i for i in model.graph.initializer if i.name.endswith("qkv_weight"))
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * 1.5, weight.name))
    broken = onnxfiles.save(model, tmp_path / "broken.onnx")
    choice = forms.choose_borrowed({"basic": files["basic"], "borrowed": broken}, bench, {}, "", BORROWED_RULES,
                                   untimed="set by optimize.borrowed_rules=always")
    assert not choice.kept and not choice.matches and choice.max_abs > 1e-3 and not choice.ms
    assert "beyond the fp32 gate" in choice.reason


def test_auto_keeps_the_borrowed_graph_only_when_measured_clearly_faster(mpnet_graphs):
    files, _, bench = mpnet_graphs
    choice = forms.choose_borrowed(files, bench, {"Attention": 2}, "fused", BORROWED_RULES)
    ms = choice.ms
    assert choice.matches and set(ms) == {"basic", "borrowed"} and set(ms["basic"]) == set(bench.feeds)
    assert choice.kept == forms.clearly_faster(ms, "basic", "borrowed")[0]
    assert choice.reason.startswith("clearly faster") if choice.kept else \
        choice.reason.startswith(("not clearly faster", "faster than the basic graph at one cell, slower at another"))
    assert choice.recorded()["matches"] and choice.recorded()["ms"] == ms


def test_clearly_faster_needs_a_gain_at_one_cell_and_no_loss_at_the_other():
    basic = {"b1 s16": 3.0, "b8 s128": 80.0}
    assert forms.clearly_faster({"basic": basic, "borrowed": {"b1 s16": 2.5, "b8 s128": 80.5}}, "basic",
                                "borrowed")[0]
    assert not forms.clearly_faster({"basic": basic, "borrowed": {"b1 s16": 2.95, "b8 s128": 79.5}}, "basic",
                                    "borrowed")[0]
    assert not forms.clearly_faster({"basic": basic, "borrowed": {"b1 s16": 2.0, "b8 s128": 84.0}}, "basic",
                                    "borrowed")[0]


def test_attention_without_a_position_bias_is_left_alone(tiny_bert, tmp_path):
    """BERT's attention adds only the mask: not this fusion's pattern (BERT's own rules fuse it)."""
    config = RunConfig.model_validate({"model": str(tiny_bert), **SMALL})
    record = RunRecord.create(tmp_path / "run", config)
    export.run(config, record)
    model = onnxfiles.load(record.artifact("onnx.original"))
    before = [n.SerializeToString() for n in model.graph.node]
    assert fuse_biased_attention(model, 4) == 0
    assert [n.SerializeToString() for n in model.graph.node] == before

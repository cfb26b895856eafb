from __future__ import annotations

import numpy as np
import pytest

from workbench.core.config import RunConfig
from workbench.core.data import load_corpus
from workbench.core.record import RunRecord
from workbench.graphs import onnxfiles
from workbench.graphs.errors import OnnxModelError
from workbench.graphs.variants import SEPARATE_FORM_DISABLED
from workbench.measure import forms
from workbench.models.batches import Batch
from workbench.models.text import encode
from workbench.runners.onnxruntime import OrtRunner
from workbench.steps import export, optimize


@pytest.fixture(scope="module")
def optimized_bert(tiny_models, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("opt-bert")
    config = RunConfig(model=str(tiny_models["bert"]), precisions=["fp32", "fp16", "int8"])
    record = RunRecord.create(run_dir, config)
    export.run(config, record)
    fusions = optimize.run(config, record).metrics["variants"]
    return record, fusions


def test_bert_fuses_every_layer(optimized_bert):
    record, fusions = optimized_bert
    layers = 2
    assert fusions["fp32"]["fused"] == fused_ops(fusions["fp32"]["form"]["chosen"], layers)
    assert fusions["fp32"]["attention_fused"] and not {"warning", "unavailable"} & set(fusions["fp32"])
    assert fusions["fp32"]["nodes"] < fusions["original"]["nodes"] / 3
    assert fusions["int8"]["fused"]["QAttention"] == layers
    assert fusions["int8"]["fused"]["MatMulInteger"] > 0
    assert record.metric("optimize.variants") == fusions
    assert record.data["environment"]["onnxruntime"]["providers_used"] == ["CPUExecutionProvider"]


def fused_ops(form: str, layers: int) -> dict[str, int]:
    """The contrib operators a BERT encoder of `layers` layers fuses into, by layer-norm form."""
    if form == "fused":
        return {"EmbedLayerNormalization": 1, "Attention": layers, "BiasGelu": layers,
                "SkipLayerNormalization": 2 * layers}
    return {"Attention": layers, "BiasGelu": layers, "LayerNormalization": 2 * layers + 1}


def test_the_layer_norm_form_is_measured_and_recorded(optimized_bert):
    """Both forms timed at the bench's smallest and largest cell; the file is the chosen form, and a separate-form
    file names the fusions its sessions leave out."""
    record, fusions = optimized_bert
    form = fusions["fp32"]["form"]
    assert set(form["ms"]) == {"fused", "separate"}
    assert all(set(cells) == {"b1 s16", "b8 s128"} and min(cells.values()) > 0 for cells in form["ms"].values())
    assert form["chosen"] == forms.decide(form["ms"])[0] and form["reason"]
    disabled = onnxfiles.disabled_optimizers(record.artifact("onnx.fp32"))
    assert disabled == (list(SEPARATE_FORM_DISABLED) if form["chosen"] == "separate" else [])
    assert onnxfiles.disabled_optimizers(record.artifact("onnx.int8")) == disabled  # int8 is built from fp32


def test_form_decision():
    fused = {"b1 s16": 3.0, "b8 s128": 80.0}
    assert forms.decide({"fused": fused, "separate": {"b1 s16": 2.5, "b8 s128": 79.0}})[0] == "separate"
    assert forms.decide({"fused": fused, "separate": {"b1 s16": 2.95, "b8 s128": 79.5}})[0] == "fused"  # in noise
    assert forms.decide({"fused": fused, "separate": {"b1 s16": 2.5, "b8 s128": 84.0}})[0] == "fused"  # slower


@pytest.mark.parametrize("form", ["fused", "separate"])
def test_a_pinned_form_is_built_and_kept_by_its_sessions(tiny_models, tmp_path, form):
    """graph_form pins the form; a separate-form int8 file stays separate in the session the workbench creates
    (ONNX Runtime would fuse Add + LayerNormalization into SkipLayerNormalization again at load)."""
    import onnx
    import onnxruntime

    config = RunConfig(model=str(tiny_models["bert"]), optimize={"graph_form": form}, precisions=["fp32", "int8"])
    record = RunRecord.create(tmp_path / "run", config)
    export.run(config, record)
    fusions = optimize.run(config, record).metrics["variants"]
    assert fusions["fp32"]["form"] == {"chosen": form, "reason": f"set by optimize.graph_form={form}", "ms": {}}
    assert fusions["fp32"]["fused"] == fused_ops(form, 2)
    int8 = record.artifact("onnx.int8")

    def loaded_ops(disabled: list[str]) -> set[str]:
        options = onnxruntime.SessionOptions()
        options.optimized_model_filepath = str(tmp_path / f"loaded-{len(disabled)}.onnx")
        onnxruntime.InferenceSession(str(int8), options, providers=["CPUExecutionProvider"],
                                     disabled_optimizers=disabled)
        return {node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node}

    assert ("SkipLayerNormalization" in loaded_ops(onnxfiles.disabled_optimizers(int8))) == (form == "fused")
    if form == "separate":
        assert "SkipLayerNormalization" in loaded_ops([])  # what the metadata entry prevents


def test_variants_are_recorded_with_hashes(optimized_bert):
    record, _ = optimized_bert
    artifacts = record.data["artifacts"]
    for variant in ("original", "fp32", "fp16", "int8", "tensorrt"):
        entry = artifacts[f"onnx.{variant}"]
        assert entry["sha256"] == onnxfiles_sha(record, variant) and entry["bytes"] > 0
    assert artifacts["onnx.fp16"]["bytes"] < 0.6 * artifacts["onnx.fp32"]["bytes"]
    assert not list(record.run_dir.glob("onnx/.*partial*"))


def onnxfiles_sha(record, variant):
    from workbench.core.atomic import sha256_file

    return sha256_file(record.artifact(f"onnx.{variant}"))


def test_fp16_keeps_fp32_io_and_stays_close(optimized_bert):
    record, _ = optimized_bert
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(record.artifact("tokenizer"))
    with (OrtRunner("fp32", record.artifact("onnx.fp32"), ["CPUExecutionProvider"]) as fp32,
          OrtRunner("fp16", record.artifact("onnx.fp16"), ["CPUExecutionProvider"]) as fp16):
        batch = Batch("texts", list(range(8)), encode(tokenizer, list(load_corpus()[:8]), fp32.input_names))
        want, got = fp32.infer(batch), fp16.infer(batch)
    assert got["sentence_embedding"].dtype == np.float32
    assert 0 < np.abs(got["sentence_embedding"] - want["sentence_embedding"]).max() < 0.05


def test_symbolic_shapes_fill_every_intermediate(optimized_bert):
    record, _ = optimized_bert
    model = onnxfiles.load(record.artifact("onnx.tensorrt"))
    inferred = {v.name for v in model.graph.value_info}
    produced = {out for node in model.graph.node for out in node.output} - {o.name for o in model.graph.output}
    assert produced <= inferred


def test_sdpa_export_is_flagged_as_unfused(tiny_bert, tmp_path):
    config = RunConfig(model=str(tiny_bert), attn_implementation="sdpa", precisions=["fp32"])
    record = RunRecord.create(tmp_path, config)
    export.run(config, record)
    with pytest.warns(UserWarning, match="Attention fused in 0 of 2 layers"):
        fusions = optimize.run(config, record).metrics["variants"]
    assert fusions["fp32"]["attention_fused"] is False
    assert set(fusions) == {"original", "fp32", "tensorrt"}


def test_corrupt_onnx_is_a_typed_error_and_writes_nothing(tiny_bert, tmp_path):
    config = RunConfig(model=str(tiny_bert))
    record = RunRecord.create(tmp_path, config)
    export.run(config, record)
    original = record.artifact("onnx.original")
    original.write_bytes(original.read_bytes()[: original.stat().st_size // 3])
    with pytest.raises(OnnxModelError, match="not a readable ONNX model"):
        optimize.run(config, record)
    assert sorted(p.name for p in (tmp_path / "onnx").iterdir()) == ["original.onnx"]
    assert record.data["steps"]["optimize"]["status"] == "failed"
    with pytest.raises(OnnxModelError, match="does not exist"):
        onnxfiles.load(tmp_path / "missing.onnx")


def test_large_models_are_saved_with_external_data(optimized_bert, tmp_path, monkeypatch):
    """Over protobuf's 2 GB limit the weights go to `<name>.data` beside the graph (threshold lowered here)."""
    record, _ = optimized_bert
    model = onnxfiles.load(record.artifact("onnx.fp32"))
    monkeypatch.setattr(onnxfiles, "EXTERNAL_DATA_THRESHOLD", 1024)
    dest = onnxfiles.save(model, tmp_path / "big.onnx")
    assert (tmp_path / "big.onnx.data").stat().st_size > dest.stat().st_size
    with (OrtRunner("big", dest, ["CPUExecutionProvider"]) as runner,
          OrtRunner("fp32", record.artifact("onnx.fp32"), ["CPUExecutionProvider"]) as fp32):
        batch = Batch("ones", [0], {name: np.ones((1, 4), dtype=np.int64) for name in runner.input_names})
        assert np.array_equal(runner.infer(batch)["sentence_embedding"], fp32.infer(batch)["sentence_embedding"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "big.onnx.data"]


def test_a_graph_is_saved_weight_by_weight_and_reads_back_as_it_was(optimized_bert, tmp_path):
    """The inline save writes each initializer on its own (no serialized copy of the whole model in memory); the
    file parses to the same model and ONNX Runtime runs it. Its skeleton is read without the weights' bytes."""
    record, _ = optimized_bert
    model = onnxfiles.load(record.artifact("onnx.fp32"))
    dest = onnxfiles.save(model, tmp_path / "streamed.onnx")
    assert onnxfiles.load(dest) == model and sorted(p.name for p in tmp_path.iterdir()) == ["streamed.onnx"]
    assert dest.stat().st_size == len(model.SerializeToString())
    onnxfiles.verify(dest)
    skeleton = onnxfiles.skeleton(dest)  # the structure, the weights' bytes skipped in the file
    assert list(skeleton.graph.node) == list(model.graph.node) and skeleton.metadata_props == model.metadata_props
    assert [(t.name, list(t.dims)) for t in skeleton.graph.initializer] == \
        [(t.name, list(t.dims)) for t in model.graph.initializer]
    assert not any(t.raw_data or t.float_data for t in skeleton.graph.initializer)
    dest.write_bytes(dest.read_bytes()[: dest.stat().st_size // 2])
    with pytest.raises(OnnxModelError, match="is not a readable ONNX model"):
        onnxfiles.skeleton(dest)


def test_weights_in_a_file_each_are_gathered_into_one_data_file(optimized_bert, tmp_path):
    """torch.onnx's layout over 2 GB (one file per tensor, Constant nodes' values too; simulated here with onnx's
    own writer) becomes one `.onnx` and one `.onnx.data`, answering as before; the symbolic-shapes graph built from
    it without loading its weights is such a pair too."""
    import onnx

    from workbench.graphs.variants import infer_shapes

    record, _ = optimized_bert
    exported = record.artifact("onnx.original")
    model = onnxfiles.load(exported)
    assert any(node.op_type == "Constant" for node in model.graph.node)
    onnx.save_model(model, str(tmp_path / "loose.onnx"), save_as_external_data=True, all_tensors_to_one_file=False,
                    size_threshold=0, convert_attribute=True)
    assert len(list(tmp_path.iterdir())) > 10
    onnxfiles.one_data_file(tmp_path / "loose.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loose.onnx", "loose.onnx.data"]
    shaped, _ = infer_shapes(tmp_path / "loose.onnx", tmp_path / "shaped.onnx")
    assert shaped.graph.value_info, "shapes inferred"
    assert not any(t.raw_data for t in shaped.graph.initializer if np.prod(t.dims) >= 256), "weights left on disk"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loose.onnx", "loose.onnx.data", "shaped.onnx",
                                                          "shaped.onnx.data"]
    with (OrtRunner("exported", exported, ["CPUExecutionProvider"]) as whole,
          OrtRunner("loose", tmp_path / "loose.onnx", ["CPUExecutionProvider"]) as gathered,
          OrtRunner("shaped", tmp_path / "shaped.onnx", ["CPUExecutionProvider"]) as inferred):
        batch = Batch("ones", [0], {name: np.ones((2, 5), dtype=np.int64) for name in whole.input_names})
        want = whole.infer(batch)["sentence_embedding"]
        assert np.array_equal(gathered.infer(batch)["sentence_embedding"], want)
        np.testing.assert_allclose(inferred.infer(batch)["sentence_embedding"], want, atol=1e-5)  # shapes: fusions


def test_symbolic_shapes_fall_back_to_onnx_where_onnxruntime_cannot(tmp_path):
    """ONNX Runtime 1.31's symbolic inference fails on ReduceL2 with axes as an input (opset 18, the Normalize of a
    sentence-transformers model); ONNX's own inference keeps the named dims."""
    import onnx
    from onnx import TensorProto, helper

    from workbench.graphs.variants import infer_shapes

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    nodes = [helper.make_node("ReduceL2", ["x", "axes"], ["norm"], keepdims=1),
             helper.make_node("Div", ["x", "norm"], ["y"])]
    graph = helper.make_graph(nodes, "normalize", [x], [y], initializer=[axes])
    source = tmp_path / "normalize.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), source)
    model, method = infer_shapes(source, tmp_path / "shaped.onnx")
    assert method.startswith("onnx shape inference (onnxruntime's symbolic inference failed: TypeError"), method
    norm = next(v for v in model.graph.value_info if v.name == "norm")
    assert [d.dim_param or d.dim_value for d in norm.type.tensor_type.shape.dim] == ["batch", 1]


def test_an_interrupt_after_the_builds_leaves_no_variant_the_record_lacks(tiny_bert, tmp_path, monkeypatch):
    """Stopped while it checks what it built (before recording it), the step leaves only the export's graph: the
    record drops what it recorded, and the built files go with it."""
    config = RunConfig.model_validate({"model": str(tiny_bert), "precisions": ["fp32", "int8"], "threads": 1,
                                       "optimize": {"openvino": "never"}})
    record = RunRecord.create(tmp_path / "run", config)
    export.run(config, record)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(optimize, "smoke_test", interrupted)
    with pytest.raises(KeyboardInterrupt):
        optimize.run(config, record)
    assert sorted(p.name for p in (record.run_dir / "onnx").iterdir()) == ["original.onnx"]
    assert record.step_entry("optimize").status == "failed" and record.variant_names("onnx") == ["original"]


def test_int8_is_the_graph_onnxruntimes_quantizer_writes_with_one_copy_of_the_weights(optimized_bert, tmp_path):
    """`quantize_int8` refreshes shapes on the graph alone where ONNX Runtime's dynamic quantizer deep-copies, saves
    and reloads the model: the quantized graph is the same, node for node and weight for weight."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from workbench.graphs.variants import quantize_int8

    record, _ = optimized_bert
    fp32 = record.artifact("onnx.fp32")
    quantize_int8(fp32, tmp_path / "ours.onnx", per_channel=True, nodes_to_exclude=[])
    quantize_dynamic(fp32, tmp_path / "plain.onnx", weight_type=QuantType.QInt8, per_channel=True,
                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    ours, plain = onnxfiles.load(tmp_path / "ours.onnx"), onnxfiles.load(tmp_path / "plain.onnx")
    assert [(n.op_type, list(n.input), list(n.output)) for n in ours.graph.node] == [
        (n.op_type, list(n.input), list(n.output)) for n in plain.graph.node]
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in plain.graph.initializer}
    assert {t.name for t in ours.graph.initializer} == set(weights)
    for tensor in ours.graph.initializer:  # ONNX Runtime's round trip through a file marks where data lies
        value = onnx.numpy_helper.to_array(tensor)
        assert value.dtype == weights[tensor.name].dtype and np.array_equal(value, weights[tensor.name])
    assert any(n.op_type == "DynamicQuantizeMatMul" or n.op_type == "MatMulInteger" for n in ours.graph.node)

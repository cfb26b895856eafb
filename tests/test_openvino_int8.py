"""OpenVINO's int8: NNCF's quantization of the exported graph, kept by the optimize step where it runs faster than the
fastest graph kept before it, checked by the parity lab, repaired by undoing activation quantizers, served first."""
from __future__ import annotations

import os
from collections import Counter

import numpy as np
import onnx
import pytest

from workbench.core.config import RunConfig
from workbench.core.data import load_corpus
from workbench.core.record import RunRecord
from workbench.core.results import Verdict
from workbench.graphs import nncf_int8, onnxfiles
from workbench.graphs.nncf_int8 import CALIBRATION_TEXTS, keep_in_float, noise_order, quantizer_costs, quantizers
from workbench.graphs.tables import ExportMetrics, PrecisionDecision
from workbench.measure.forms import RaceBench
from workbench.measure.precisions import Target, target_for
from workbench.models.batches import Batch
from workbench.models.text import encode
from workbench.precision.search import matmul_costs
from workbench.precision.tables import RepairCandidate
from workbench.runners.openvino import OpenVinoRunner, bf16_problem
from workbench.runners.timing import OthersBusy
from workbench.serving.backend import ort_batches
from workbench.serving.flavor import Flavor
from workbench.serving.plan import CPU_FP32_FIRST, CPU_INT8_FIRST, preference
from workbench.steps import export, optimize, parity
from workbench.steps.optimize import openvino_variants
from workbench.steps.parity import repairs

from .conftest import run_race_bench

pytest.importorskip("nncf")


NO_BF16 = "this CPU has no bf16 instructions (OpenVINO's CPU plugin lists no BF16 capability)"


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, tiny_models):
    """A tiny BERT with fp32 and int8, its OpenVINO int8 kept untimed (optimize.openvino=always); the embedding's
    gate is tightened to 0.999995 so that int8 (min cosine about 0.99998 on a tiny random model) fails it and is
    repaired."""
    root = tmp_path_factory.mktemp("openvino_int8")
    config = RunConfig.model_validate({"model": str(tiny_models["bert"]), "precisions": ["fp32", "int8"],
                                       "threads": 1, "optimize": {"openvino": "always"},
                                       "parity": {"repair": {"budget_s": 3600}},  # never the limit, on any host
                                       "tolerances": {"sentence_embedding": {"min_cosine": 0.999995}}})
    record = RunRecord.create(root / "run", config)
    export.run(config, record)
    with pytest.MonkeyPatch.context() as patch:  # an AVX2-only host: f32 on every CPU, so the repair's gate holds
        patch.setattr(openvino_variants, "bf16_problem", lambda: NO_BF16)
        optimize.run(config, record)
    return config, record


def bench(config: RunConfig, record: RunRecord) -> RaceBench:
    return run_race_bench(config, record)


def outputs(path, record: RunRecord, count: int = 16) -> dict[str, np.ndarray]:
    with OpenVinoRunner("check", path, 1) as runner:
        texts = list(load_corpus()[:count])
        return runner.infer(Batch("corpus", list(range(count)), encode(record.tokenizer(), texts,
                                                                         runner.input_names, max_length=64)))


def test_the_optimize_step_keeps_nncf_int8_run_by_openvino(quantized):
    _, record = quantized
    tried = record.metric("optimize.openvino_int8")
    assert tried["kept"] and tried["reason"] == "set by optimize.openvino=always" and tried["ms"] == {}
    assert tried["against"] == "int8" and tried["engine"].startswith("OpenVINO ")
    assert tried["calibration_texts"] == min(CALIBRATION_TEXTS, len(load_corpus()))
    built = record.variant("openvino_int8")
    path, precision = built.path, built.precision
    assert precision == "int8" and onnxfiles.runtime(path) == "openvino"
    found = quantizers(onnxfiles.load(path))
    activations = [name for name, quantizer in found.items() if quantizer.source is not None]
    assert onnxfiles.op_counts(onnxfiles.load(path))["QuantizeLinear"] == len(activations) > 0
    assert len(found) - len(activations) == 3, "the word, position and token type tables, stored int8"
    model = onnxfiles.load(path)
    stored = {tensor.name: tensor for tensor in model.graph.initializer}
    zero_types = {stored[node.input[2]].data_type for node in model.graph.node if node.op_type == "QuantizeLinear"}
    assert onnx.TensorProto.UINT8 in zero_types, "asymmetric activations are stored on OpenVINO's uint8 grid"
    lines = optimize.lines(record)
    assert any(line.startswith("OpenVINO int8 (NNCF) kept as the openvino_int8 variant") for line in lines)


def test_nncf_with_weights_read_once_and_stored_a_slice_at_a_time_gives_its_own_graph(quantized, tmp_path,
                                                                                     monkeypatch):
    """NNCF's statistics copy every weight out of the graph on each calibration text, and its last pass quantizes
    each weight whole; read once from the file and stored int8 a few rows at a time here, they give NNCF's own graph,
    node for node and value for value, and the graph NNCF runs no longer outputs the tables."""
    from contextlib import nullcontext

    from nncf.onnx import engine
    from nncf.onnx.graph.passes import compress_quantize_weights_transformation

    _, record = quantized
    original = record.artifact("onnx.original")
    feeds = [encode(record.tokenizer(), [text], ("input_ids", "attention_mask", "token_type_ids"), max_length=64)
             for text in load_corpus()[:6]]
    run = engine.ONNXEngine.infer
    largest: list[int] = []
    monkeypatch.setattr(engine.ONNXEngine, "infer", lambda self, data: (
        lambda out: largest.append(max(v.size for v in out.values())) or out)(run(self, data)))
    monkeypatch.setattr(nncf_int8, "CHUNK_VALUES", 100)
    nncf_int8.quantize_openvino_int8(original, tmp_path / "ours.onnx", feeds)
    ours_largest = max(largest)
    monkeypatch.setattr(nncf_int8, "weights_read_once", nullcontext)
    monkeypatch.setattr(nncf_int8, "stored_int8", compress_quantize_weights_transformation)
    largest.clear()
    nncf_int8.quantize_openvino_int8(original, tmp_path / "theirs.onnx", feeds)
    table = next(t for t in onnxfiles.load(original).graph.initializer if "word_embeddings" in t.name)
    assert max(largest) == int(np.prod(table.dims)) > ours_largest, "NNCF's own copies the word table out"
    ours, theirs = onnxfiles.load(tmp_path / "ours.onnx"), onnxfiles.load(tmp_path / "theirs.onnx")
    assert ours.graph.node == theirs.graph.node
    assert sum(n.op_type == "DequantizeLinear" for n in ours.graph.node) > 10
    values = [{t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer} for m in (ours, theirs)]
    assert values[0].keys() == values[1].keys() and all(
        values[0][name].dtype == values[1][name].dtype and np.array_equal(values[0][name], values[1][name])
        for name in values[0])


def test_unsigned_activations_keep_the_grid_and_leave_symmetric_quantizers_signed():
    from onnx import TensorProto, helper, numpy_helper

    def pair(name, zero):
        return [helper.make_node("QuantizeLinear", ["x", "scale", zero], [f"{name}_q"], name=name),
                helper.make_node("DequantizeLinear", [f"{name}_q", "scale", zero], [name])]
    graph = helper.make_graph(
        pair("asymmetric", "zero_a") + pair("symmetric", "zero_s"), "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, [64]) for name in ("asymmetric", "symmetric")],
        [numpy_helper.from_array(np.array(0.05, np.float32), "scale"),
         numpy_helper.from_array(np.array(-37, np.int8), "zero_a"),
         numpy_helper.from_array(np.array(0, np.int8), "zero_s")],
        value_info=[helper.make_tensor_value_info("asymmetric_q", TensorProto.INT8, [64])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = {"x": np.linspace(-9.0, 9.0, 64, dtype=np.float32)}
    before = next(onnxfiles.tensor_values(model, ["asymmetric", "symmetric"], [x]))
    nncf_int8.unsigned_activations(model)
    onnx.checker.check_model(model, full_check=True)
    stored = {tensor.name: numpy_helper.to_array(tensor) for tensor in model.graph.initializer}
    assert stored["zero_a.u8"].dtype == np.uint8 and int(stored["zero_a.u8"]) == 91 and "zero_a" not in stored
    assert stored["zero_s"].dtype == np.int8, "a symmetric quantizer stays int8"
    after = next(onnxfiles.tensor_values(model, ["asymmetric", "symmetric"], [x]))
    assert all(np.array_equal(before[name], after[name]) for name in before), "the same values, clipped alike"


def test_undoing_every_quantizer_gives_the_exported_graph_back(quantized, tmp_path):
    _, record = quantized
    path, original = record.variant("openvino_int8").path, record.artifact("onnx.original")
    found = quantizers(onnxfiles.load(path))
    names = list(found)
    keep_in_float(path, original, tmp_path / "float.onnx", names)
    keep_in_float(path, original, tmp_path / "half.onnx", names[: len(names) // 2])
    counts = {name: onnxfiles.op_counts(onnxfiles.load(tmp_path / f"{name}.onnx")) for name in ("float", "half")}
    assert "QuantizeLinear" not in counts["float"] and "DequantizeLinear" not in counts["float"]
    assert counts["half"]["QuantizeLinear"] == sum(found[name].source is not None for name in names[len(names) // 2:])
    assert onnxfiles.runtime(tmp_path / "float.onnx") == "openvino", "the metadata stays with the file"
    want, got = outputs(original, record), outputs(tmp_path / "float.onnx", record)
    cosine = np.sum(want["sentence_embedding"] * got["sentence_embedding"], axis=1)
    assert cosine.min() > 0.99999, "float tables, weights, biases and activations: the exported graph's answers"
    assert len(quantizers(onnxfiles.load(path))) == len(names), "the quantized file is left as it was"


def test_quantizers_are_ordered_noisiest_first_and_cost_what_they_feed(quantized):
    _, record = quantized
    path, original = record.variant("openvino_int8").path, record.artifact("onnx.original")
    feeds = [encode(record.tokenizer(), list(load_corpus()[:8]), ("input_ids", "attention_mask", "token_type_ids"),
                    max_length=64)]
    noise = noise_order(path, original, feeds)
    assert set(noise) == set(quantizers(onnxfiles.load(path)))
    assert list(noise.values()) == sorted(noise.values()) and all(np.isfinite(list(noise.values())))
    graph = onnxfiles.load(original, load_external_data=False)
    matmuls = [n.name for n in graph.graph.node if n.op_type == "MatMul"]
    costs = quantizer_costs(path, matmul_costs(graph, matmuls))
    assert set(costs) == set(noise) and sum(costs.values()) > 0
    assert sum(costs.values()) <= sum(matmul_costs(graph, matmuls).values())


def test_parity_fails_it_at_the_gate_and_repairs_it_by_undoing_quantizers(quantized):
    """The lab judges it as int8; the repair undoes some of its quantizers (not all), the repaired file passes, is
    run by OpenVINO, and is kept with the race's say (optimize.openvino=always here: kept untimed)."""
    config, record = quantized
    results = parity.run(config, record).metrics
    assert results["variants"]["openvino_int8"]["precision"] == "int8"
    assert not results["variants"]["openvino_int8"]["passed"]
    repair = results["repair"]["openvino_int8"]
    assert repair["outcome"] == "repaired" and repair["ordering"].startswith("noisiest quantizer first")
    assert 0 < len(repair["chosen"]["blocked"]) < repair["units"]
    verdicts = {name: Verdict.model_validate(verdict) for name, verdict in results["variants"].items()}
    against = repairs.raced_against(verdicts, record)  # ONNX Runtime's int8 as this host repaired it, or not
    assert repair["race"] == {"against": against, "ms": {}, "kept": True, "reason": "set by optimize.openvino=always"}
    assert results["variants"]["openvino_int8_repaired"]["passed"]
    built = record.variant("openvino_int8_repaired")
    path, precision = built.path, built.precision
    assert precision == "int8" and onnxfiles.runtime(path) == "openvino"
    assert record.artifact_details("onnx.openvino_int8_repaired")["blocked"] == repair["chosen"]["blocked"]


def test_a_lost_race_is_recorded_as_not_kept(quantized, tmp_path, monkeypatch):
    config, record = quantized
    config = config.model_copy(deep=True)
    config.optimize.openvino = "auto"
    monkeypatch.setattr(repairs, "race", lambda *args: ({}, False, "not clearly faster than the int8 graph"))
    dest = tmp_path / "openvino_int8_repaired.onnx"
    onnxfiles.save(onnx.load(record.variant("openvino_int8").path), dest)
    raced = repairs.race_repaired("openvino_int8_repaired", dest, config, record, "int8")
    assert raced.recorded() == {"against": "int8", "ms": {}, "kept": False,
                                "reason": "not kept (its file removed): not clearly faster than the int8 graph"}


def test_an_interrupted_race_leaves_no_openvino_int8_file(quantized, tmp_path, monkeypatch):
    import shutil

    config, shared = quantized
    record = RunRecord.load(shutil.copytree(shared.run_dir, tmp_path / "run"))
    config = config.model_copy(deep=True)
    config.optimize.openvino = "auto"

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(openvino_variants, "race", interrupted)
    with pytest.raises(KeyboardInterrupt):
        openvino_variants.build_openvino_int8(config, record, record.needed(ExportMetrics), bench(config, record),
        target_for("host", False),
                                     optimize.decide_precisions(config, record)[1]["int8"])
    path = record.run_dir / "onnx" / "openvino_int8.onnx"
    assert not path.exists() and not list(path.parent.glob(".openvino_int8.onnx*"))


def test_where_it_is_not_tried_the_record_says_why(quantized, monkeypatch):
    config, record = quantized
    host = Target("host", frozenset({"avx2"}))
    decision = optimize.decide_precisions(config, record)[1]["int8"]
    assert openvino_variants.build_openvino_int8(config, record, record.needed(ExportMetrics), bench(config, record),
        host, None).recorded() == {
        "kept": False, "reason": "not tried: int8 is not among the run's precisions"}
    fp32_only = config.model_copy(update={"precisions": ["fp32"]})  # int8 decided: not in the precisions
    assert openvino_variants.build_openvino_int8(fp32_only, record, record.needed(ExportMetrics), bench(config, record),
        host, decision).recorded() == {
        "kept": False, "reason": "not tried: int8 is not among the run's precisions"}
    never = config.model_copy(deep=True)
    never.optimize.openvino = "never"
    assert openvino_variants.build_openvino_int8(never, record, record.needed(ExportMetrics), bench(config, record),
        host, decision).reason == \
        "not tried (optimize.openvino=never)"
    monkeypatch.setattr(openvino_variants, "nncf_problem", lambda: "NNCF is not installed (No module named 'nncf')")
    reason = openvino_variants.build_openvino_int8(config, record, record.needed(ExportMetrics), bench(config, record),
        host, decision).reason
    assert reason.startswith("not tried: NNCF is not installed") and "[openvino]" in reason


def copied_int8(record: RunRecord, dest) -> object:
    return onnxfiles.save(onnx.load(record.variant("openvino_int8").path), dest)


def test_on_a_cpu_without_bf16_it_computes_its_float_ops_in_f32(quantized):
    """An AVX2-only host (OpenVINO lists no BF16 capability there; faked by the fixture): f32, the reason recorded,
    the file says f32 and OpenVINO compiles it at f32."""
    _, record = quantized
    assert record.metric("optimize.openvino_int8")["inference_precision"] == {
        "chosen": "f32", "reason": f"bf16 not tried: {NO_BF16}"}
    path = record.variant("openvino_int8").path
    assert onnxfiles.openvino_precision(path) == "f32"
    with OpenVinoRunner("openvino_int8", path, 1, "int8") as runner:
        assert runner.inference_precision == "f32" and "(f32 inference precision)" in runner.providers[0]
    assert any("its float ops in f32 (bf16 not tried: this CPU has no bf16" in line for line in optimize.lines(record))


def test_where_the_cpu_has_bf16_the_faster_precision_is_written_into_the_file(quantized, tmp_path, monkeypatch):
    """Told the CPU has bf16 (true on some hosts, faked on others): the file compiled at f32 is raced against it at
    bf16 (OpenVINO's default there), and what the record says is what the file names and what OpenVINO compiles it
    at, in process and served. On a CPU without bf16 OpenVINO compiles it at f32, and the record says so instead."""
    config, record = quantized
    auto = config.model_copy(deep=True)
    auto.optimize.openvino = "auto"
    dest = copied_int8(record, tmp_path / "openvino_int8.onnx")
    monkeypatch.setattr(openvino_variants, "bf16_problem", lambda: None)
    chosen = openvino_variants.choose_openvino_precision(auto, bench(auto, record), dest)
    assert onnxfiles.openvino_precision(dest) == chosen.chosen and onnxfiles.runtime(dest) == "openvino"
    if chosen.ms:
        assert set(chosen.ms) == {"f32", "bf16"}
        # bf16 kept: by the race, or because the host was busy or f32 lost a cell; each reason says which
        assert chosen.reason.startswith("f32 " if chosen.chosen == "f32" else "OpenVINO's default on this CPU")
    else:
        assert chosen.recorded() == {"chosen": "f32", "reason": "bf16 not tried: OpenVINO compiled it at f32"}
    with OpenVinoRunner("openvino_int8", dest, 1, "int8") as runner:
        assert runner.inference_precision == chosen.chosen
        batch = Batch("corpus", [0, 1, 2, 3], encode(record.tokenizer(), list(load_corpus()[:4]),
                                                     runner.input_names, max_length=64))
        want = runner.infer(batch)["sentence_embedding"]
    served = ort_batches.session(dest, {"runtime": "openvino", "openvino_precision": chosen.chosen}, 1)
    assert served.compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name() == chosen.chosen
    np.testing.assert_allclose(served.run(["sentence_embedding"], batch.feed)[0], want, atol=1e-6)


class Compiled:
    """Stands in for an OpenVINO compile that honours the precision asked for (what a CPU with bf16 does)."""

    def __init__(self, _name: str, _path: object, _threads: int | None, _precision: str, inference: str = "f32"):
        self.inference_precision = inference

    def __enter__(self) -> Compiled:
        return self

    def __exit__(self, *_: object) -> None:
        return None


@pytest.mark.parametrize("others", [0.0, 64.0])
def test_f32_that_wins_the_race_is_kept_only_where_the_host_was_quiet(quantized, tmp_path, monkeypatch, others):
    """A race f32 wins clearly, at no cell slower, decides only where other work left the host mostly idle while it
    ran; on a busy host, or where f32 ran slower at a cell, the file keeps OpenVINO's default, bf16, and the record
    says why. The race's outcome and the host's load are
    both faked: no timing here can be made to come out one way on every host."""
    config, record = quantized
    dest = copied_int8(record, tmp_path / "openvino_int8.onnx")
    won = {"bf16": {"b1_s16": 2.0, "b8_s128": 20.0}, "f32": {"b1_s16": 1.0, "b8_s128": 10.0}}

    class Load(OthersBusy):
        def __exit__(self, *_: object) -> None:
            self.cores = others

    monkeypatch.setattr(openvino_variants, "bf16_problem", lambda: None)
    monkeypatch.setattr(openvino_variants, "OpenVinoRunner", Compiled)
    monkeypatch.setattr(openvino_variants, "OthersBusy", Load)
    monkeypatch.setattr(openvino_variants, "race",
                        lambda *_, **__: (won, True, "clearly faster than the bf16 graph: 2.00x"))
    chosen = openvino_variants.choose_openvino_precision(config, bench(config, record), dest)
    assert chosen.ms == won
    if others:
        assert chosen.chosen == "bf16" and onnxfiles.openvino_precision(dest) == "bf16"
        assert f"but other work kept 64.0 of {os.cpu_count()} cores busy during the race" in chosen.reason
        assert "re-run the optimize step on a quiet host" in chosen.reason
    else:
        assert chosen.chosen == "f32" and onnxfiles.openvino_precision(dest) == "f32"
        assert chosen.reason == "f32 clearly faster than the bf16 graph: 2.00x"
    # a race f32 wins at one cell while it runs 1% slower at the other keeps the default, quiet host or not
    mixed = {"bf16": {"b1_s16": 1.08, "b8_s128": 244.0}, "f32": {"b1_s16": 1.0, "b8_s128": 247.0}}
    monkeypatch.setattr(openvino_variants, "race",
                        lambda *_, **__: (mixed, True, "clearly faster than the bf16 graph: 1.08x"))
    chosen = openvino_variants.choose_openvino_precision(config, bench(config, record), dest)
    assert chosen.chosen == "bf16" and onnxfiles.openvino_precision(dest) == "bf16"
    assert ("during the race" in chosen.reason) if others else ("but slower at b8_s128" in chosen.reason)


def test_a_bf16_file_is_compiled_at_bf16_where_the_cpu_has_it(quantized, tmp_path):
    _, record = quantized
    dest = copied_int8(record, tmp_path / "openvino_int8.onnx")
    onnxfiles.set_metadata(dest, {onnxfiles.OPENVINO_PRECISION_KEY: "bf16"})
    assert onnxfiles.openvino_precision(dest) == "bf16" and onnxfiles.runtime(dest) == "openvino"
    with OpenVinoRunner("openvino_int8", dest, 1, "int8") as runner:
        assert runner.inference_precision == ("f32" if bf16_problem() else "bf16")


def test_the_python_model_serves_it_first_and_the_onnxruntime_backend_never():
    for order in (CPU_INT8_FIRST, CPU_FP32_FIRST):
        assert order[:2] == ("openvino_int8_repaired", "openvino_int8")
    decided = PrecisionDecision(built=True, pays=True, reason="pays")
    assert preference(Flavor.PYTHON_ORT, decided)[0][0] == "openvino_int8_repaired"
    assert not {"openvino_int8", "openvino_int8_repaired"} & set(preference(Flavor.ONNXRUNTIME, decided)[0])


class CountingChecker:
    """A checker whose candidate passes when it keeps `needed` in float and runs 1 ms plus 1 ms per unit kept."""

    def __init__(self, needed: set[str]) -> None:
        self.needed = needed

    def assess(self, path):
        blocked = set(path.read_text().split())
        passed = self.needed <= blocked
        return Verdict(passed=passed, violation=0.0 if passed else 1.0), 1.0 + len(blocked)

    def summarize(self, result):
        return RepairCandidate(passed=result.passed, violation=result.violation)


def search_for(tmp_path, ceiling):
    from workbench.precision.search import RepairProblem, RepairSearch
    from workbench.runners.timing import Budget

    units = list("abcdefgh")
    problem = RepairProblem("int8", units, lambda blocked, dest: dest.write_text(" ".join(blocked)), ceiling=ceiling)
    return RepairSearch(problem, CountingChecker({"a", "f", "g"}), tmp_path / "repair", 40, Budget(600.0))


def test_a_repair_that_cannot_beat_what_is_served_stops_before_pruning(tmp_path):
    """The shortest passing prefix keeps 7 of 8 units (8 ms here): over 1.15x the 4 ms of the variant it must beat,
    the search stops without pruning, writes nothing and says why; without a ceiling it prunes to the 3 needed."""
    from workbench.precision.search import run_search

    stopped = run_search(search_for(tmp_path / "a", ("int8_repaired", 4.0)))
    assert stopped.chosen is None and stopped.stopped == stopped.outcome
    assert stopped.outcome == ("the shortest passing set (7 units) ran 8.0 ms on the latency batch, over 1.15x "
                                  "int8_repaired's 4.0 ms: no pruned repair would be served ahead of it")
    assert not list((tmp_path / "a").rglob("candidate-*"))
    closest = search_for(tmp_path / "c", None)
    for blocked in (list("abcdefgh"), list("abcdefg")):
        closest.try_blocked(blocked)
    assert closest.closest().blocked == tuple("abcdefg"), "passing alike: the one keeping fewer units in fp32"
    everything = search_for(tmp_path / "d", None)
    everything.try_blocked(list("abcdefgh"))
    assert everything.closest() is None, "keeping every unit in fp32 is no repair, however close it comes"
    pruned = run_search(search_for(tmp_path / "b", None))
    assert pruned.outcome == "repaired" and pruned.chosen is not None and pruned.chosen.blocked == ["a", "f", "g"]


def test_a_graph_nncf_refuses_is_recorded_not_a_failed_step(quantized, tmp_path, monkeypatch):
    """A graph NNCF refuses: the step records why and goes on."""
    import shutil

    config, shared = quantized
    record = RunRecord.load(shutil.copytree(shared.run_dir, tmp_path / "run"))

    def refused(original, dest, feeds):
        raise AttributeError("'NoneType' object has no attribute 'shape'")

    monkeypatch.setattr(openvino_variants, "quantize_openvino_int8", refused)
    decision = optimize.decide_precisions(config, record)[1]["int8"]
    built = openvino_variants.build_openvino_int8(config, record, record.needed(ExportMetrics), bench(config, record),
        target_for("host", False), decision)
    assert built.recorded() == {"kept": False, "reason": "not built: NNCF could not quantize this graph "
                                                         "(AttributeError: 'NoneType' object has no attribute 'shape')"}


def test_shared_layer_weights_are_quantized_once_and_restored(tmp_path):
    """ALBERT's layers share their weights: the export hands each reader the stored table through an Identity node,
    where NNCF finds no weight (AttributeError before `nncf_int8.untied`). It quantizes now, stores each shared
    weight once (one int8 table for the three layers' MatMuls), and undoing every quantizer gives the exported
    graph's answers back."""
    from workbench.models.tiny import build_encoder

    config = RunConfig.model_validate({"model": str(build_encoder(tmp_path / "albert", "albert", layers=3)),
                                       "precisions": ["fp32"], "threads": 1})
    record = RunRecord.create(tmp_path / "run", config)
    export.run(config, record)
    original = record.artifact("onnx.original")
    graph = onnxfiles.load(original)
    stored = {tensor.name for tensor in graph.graph.initializer}
    assert sum(n.op_type == "Identity" and n.input[0] in stored for n in graph.graph.node) > 0, "shared via Identity"
    names = [i.name for i in graph.graph.input]
    feeds = [encode(record.tokenizer(), [text], names, max_length=64) for text in load_corpus()[:16]]
    nncf_int8.quantize_openvino_int8(original, tmp_path / "int8.onnx", feeds)
    quantized = onnxfiles.load(tmp_path / "int8.onnx")
    found = quantizers(quantized)
    assert sum(q.source is not None for q in found.values()) > 0
    int8_tables = {t.name for t in quantized.graph.initializer if t.data_type == onnx.TensorProto.INT8 and t.dims}
    dequantized = {n.output[0]: n.input[0] for n in quantized.graph.node
                   if n.op_type == "DequantizeLinear" and n.input[0] in int8_tables}
    weights = [dequantized[n.input[1]] for n in quantized.graph.node
               if n.op_type == "MatMul" and n.input[1] in dequantized]
    assert sorted(Counter(weights).values()) == [1] + [3] * 6, "the embedding projection; six weights, 3 layers each"
    keep_in_float(tmp_path / "int8.onnx", original, tmp_path / "float.onnx", list(found))
    want, got = outputs(original, record), outputs(tmp_path / "float.onnx", record)
    cosine = np.sum(want["sentence_embedding"] * got["sentence_embedding"], axis=1)
    assert cosine.min() > 0.99999


def test_optimize_run_again_reads_no_file_a_later_step_wrote(quantized, tmp_path, monkeypatch):
    """Optimize run again into a folder where parity had repaired a variant: it picks the graph to race by name, so
    the repaired file is not among its inputs (reading it made optimize stale after every parity run, and each
    re-run of one step made the other stale; fresh-clone trial)."""
    import shutil

    config, shared = quantized
    record = RunRecord.load(shutil.copytree(shared.run_dir, tmp_path / "run"))
    with record.step("parity"):  # entered first: it drops what an earlier parity run on the shared run wrote
        repaired = record.run_dir / "onnx" / "int8_repaired.onnx"
        onnxfiles.save(onnx.load(record.variant("int8").path), repaired)
        record.add_artifact("onnx.int8_repaired", repaired, kind="onnx", variant="int8_repaired", precision="int8")
    monkeypatch.setattr(openvino_variants, "bf16_problem", lambda: NO_BF16)
    assert optimize.run(config, record).status == "ok"
    inputs = record.data["steps"]["optimize"]["inputs"]
    assert "onnx.original" in inputs and not [key for key in inputs if key.startswith("onnx.int8_repaired")]
    assert record.status("optimize") == "ok"


def test_nncf_bars_are_text_inside_a_notebook_kernel(monkeypatch):
    import builtins

    from rich.console import Console

    class ZMQInteractiveShell:  # what get_ipython() returns in a Jupyter kernel
        pass

    monkeypatch.setattr(builtins, "get_ipython", ZMQInteractiveShell, raising=False)
    assert Console().is_jupyter, "rich takes a kernel for Jupyter and would draw widgets"
    with nncf_int8.rich_as_text():
        assert not Console().is_jupyter
    assert Console().is_jupyter

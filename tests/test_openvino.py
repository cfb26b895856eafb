"""The OpenVINO variant: the exported graph run by OpenVINO's CPU plugin, tried against the fp32 graph by the optimize
step, checked by the parity lab like every variant, and served by the Python model the triton step writes."""
from __future__ import annotations

import numpy as np
import pytest

from workbench.core.config import RunConfig
from workbench.core.data import load_corpus
from workbench.core.errors import DependencyMissingError
from workbench.core.record import RunRecord
from workbench.graphs import onnxfiles
from workbench.graphs.tables import PrecisionDecision, Trial
from workbench.measure.precisions import Target, target_for
from workbench.models.batches import Batch
from workbench.models.text import encode
from workbench.precision.compare import DEFAULT_TOLERANCES
from workbench.runners.onnxruntime import OrtRunner
from workbench.runners.openvino import OPENVINO_CONFIG, OpenVinoRunner, bf16_problem
from workbench.runners.registry import open_variant
from workbench.serving.backend import ort_batches
from workbench.serving.flavor import Flavor
from workbench.serving.plan import preference
from workbench.serving.repository import parse_pbtxt
from workbench.steps import deploy, export, optimize, parity, triton
from workbench.steps.optimize import openvino_variants
from workbench.steps.optimize.openvino_variants import OPENVINO_BUILDS

from .conftest import run_race_bench

pytest.importorskip("openvino")


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    """The embedded model with fp32 and bf16, the OpenVINO variants kept untimed (optimize.openvino=always; bf16 where
    the CPU has it) and the fp32 one served."""
    root = tmp_path_factory.mktemp("openvino")
    config = RunConfig.model_validate({"precisions": ["fp32", "bf16"], "threads": 1,
                                       "optimize": {"openvino": "always"},
                                       "triton": {"repository_dir": str(root / "repos"), "variant": "openvino"}})
    record = RunRecord.create(root / "run", config)
    export.run(config, record)
    optimize.run(config, record)
    return root, config, record


def corpus_batch(record: RunRecord, names: tuple[str, ...], count: int = 32) -> Batch:
    texts = list(load_corpus()[:count])
    return Batch("corpus", list(range(count)), encode(record.tokenizer(), texts, names, max_length=128))


def test_the_variant_matches_onnxruntime_fp32_on_the_embedded_model(minilm):
    _, _, record = minilm
    tried = record.metric("optimize.openvino")
    assert tried["kept"] and tried["matches"] and not tried["ms"]
    assert tried["reason"] == "set by optimize.openvino=always"
    assert tried["engine"].startswith("OpenVINO ") and tried["max_abs"] < 1e-5
    built = record.variant("openvino")
    path, precision = built.path, built.precision
    assert onnxfiles.runtime(path) == "openvino" and precision == "fp32"
    assert onnxfiles.runtime(record.artifact("onnx.fp32")) == "onnxruntime"
    gate = DEFAULT_TOLERANCES["fp32"]["hidden"]
    with open_variant(built, "cpu", 1) as openvino, \
            OrtRunner("fp32", record.artifact("onnx.fp32"), ["CPUExecutionProvider"], 1) as fp32:
        assert isinstance(openvino, OpenVinoRunner) and openvino.providers[0].startswith("OpenVINO")
        batch = corpus_batch(record, fp32.input_names)
        got, want = openvino.infer(batch), fp32.infer(batch)
    assert set(got) == set(want) == {"token_embeddings", "sentence_embedding"}
    for name, value in want.items():
        assert got[name].shape == value.shape
        assert np.all(np.abs(got[name] - value) <= gate.atol + gate.rtol * np.abs(value)), name


def test_parity_checks_it_like_every_variant(minilm):
    """openvino at fp32's gate; openvino_bf16, where this CPU has bf16, at fp16's."""
    _, config, record = minilm
    results = parity.run(config, record).metrics["variants"]
    result = results["openvino"]
    assert result["passed"] and result["precision"] == "fp32"
    assert result["outputs"]["sentence_embedding"]["min_cosine"] > 0.9999
    tried = record.metric("optimize.openvino_bf16")
    assert tried["kept"] == ("openvino_bf16" in results) == (bf16_problem() is None)
    if tried["kept"]:
        bf16 = results["openvino_bf16"]
        assert bf16["passed"] and bf16["precision"] == "bf16"
        assert bf16["outputs"]["sentence_embedding"]["tolerance"]["min_cosine"] == 0.999
        error = bf16["outputs"]["token_embeddings"]["max_abs"]
        assert 1e-4 < error < 5e-2, "computed in bf16: beyond fp32's gate, within fp16's"
    else:
        assert tried == {"kept": False, "reason": f"not tried: {bf16_problem()}"}


def test_bf16_is_tried_only_where_the_cpu_has_it_and_the_run_asks(minilm, tmp_path, monkeypatch):
    """An AVX2-only host (faked): not tried, and why. bf16 not among the precisions: not tried. A CPU said to have
    bf16 races it against the openvino variant (auto) and keeps it only where clearly faster; where OpenVINO still
    compiles f32 (the CPU has no bf16 after all) it is not kept, and the record says so."""
    import shutil

    _, config, shared = minilm
    record = RunRecord.load(shutil.copytree(shared.run_dir, tmp_path / "run"))
    host, bench = target_for("host", False), run_race_bench(config, record)
    monkeypatch.setattr(openvino_variants, "bf16_problem", lambda: "this CPU has no bf16 instructions (faked)")
    assert openvino_variants.build_openvino_bf16(config, record, bench, host).recorded() == {
        "kept": False, "reason": "not tried: this CPU has no bf16 instructions (faked)"}
    fp32_only = config.model_copy(update={"precisions": ["fp32"]})
    assert openvino_variants.build_openvino_bf16(fp32_only, record, bench, host).reason == \
        "not tried: bf16 is not among the run's precisions"
    not_asked = Trial(kept=False, reason="not tried: bf16 is not among the run's precisions")
    assert openvino_variants.openvino_bf16_line(not_asked, record.run_dir) == \
        "OpenVINO bf16 not tried: bf16 is not among the run's precisions"
    monkeypatch.setattr(openvino_variants, "bf16_problem", lambda: None)
    auto = config.model_copy(update={"precisions": "auto"}, deep=True)
    auto.optimize.openvino = "auto"
    tried = openvino_variants.build_openvino_bf16(auto, record, bench, host)
    dest = record.run_dir / "onnx" / "openvino_bf16.onnx"
    assert tried.against == "openvino" and dest.exists() == tried.kept
    if bf16_problem():
        assert tried.reason == "not kept: OpenVINO compiled it at f32" and not tried.kept
    else:
        assert set(tried.ms) == {"openvino", "openvino_bf16"} and "than the openvino graph" in tried.reason
    if tried.kept:
        assert onnxfiles.openvino_precision(dest) == "bf16" and record.variant("openvino_bf16").precision == "bf16"
    else:
        assert not list(dest.parent.glob("*openvino_bf16*"))


def test_served_bf16_comes_before_fp32_and_after_int8():
    pays = PrecisionDecision(built=True, pays=True, reason="pays")
    pays_not = PrecisionDecision(built=True, pays=False, reason="does not pay")
    int8_first, fp32_first = preference(Flavor.PYTHON_ORT, pays)[0], preference(Flavor.PYTHON_ORT, pays_not)[0]
    assert int8_first.index("int8") < int8_first.index("openvino_bf16") < int8_first.index("openvino")
    assert fp32_first.index("openvino_bf16") < fp32_first.index("openvino") < fp32_first.index("int8")
    assert "openvino_bf16" not in preference(Flavor.ONNXRUNTIME, pays)[0], "ONNX Runtime would run it in fp32"
    assert DEFAULT_TOLERANCES["bf16"] == DEFAULT_TOLERANCES["fp16"]


def test_a_served_request_through_it_matches_encode(minilm):
    """The triton step serves it (checked against SentenceTransformer.encode() over HTTP and gRPC); the Python
    model's config tells it to run OpenVINO, and its session there is OpenVINO's."""
    root, config, record = minilm
    deployment = triton.run(config, record).metrics
    assert deployment["variant"] == "openvino" and deployment["verified"]
    for protocol, result in deployment["served_parity"].items():
        output = result["outputs"]["sentence_embedding"]
        assert result["passed"] and output["max_abs"] < 1e-5 and output["min_cosine"] > 0.9999, protocol
    name = deployment["name"]
    model_config = parse_pbtxt((root / "repos" / name / name / "config.pbtxt").read_text())
    params = {key: value.string_value for key, value in model_config.parameters.items()}
    assert params["runtime"] == "openvino" and params["openvino_precision"] == "f32", "fp32: never bf16"
    served = ort_batches.session(root / "repos" / name / name / "1" / "model.onnx", params)
    assert isinstance(served, ort_batches.OpenVinoSession)
    assert served.compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name() == "f32"
    assert ort_batches.OPENVINO_CONFIG == OPENVINO_CONFIG, "served and in process, OpenVINO compiles alike"
    batch = corpus_batch(record, tuple(i.name for i in served.get_inputs()), 4)
    with OpenVinoRunner("openvino", record.variant("openvino").path, 1) as runner:
        want = runner.infer(batch)["sentence_embedding"]
    np.testing.assert_allclose(served.run(["sentence_embedding"], batch.feed)[0], want, atol=1e-6)


def test_its_deploy_image_installs_openvino(minilm):
    """The image's Python model imports OpenVINO for this variant: the Dockerfile installs it, pinned."""
    import shlex

    from dockerfile_parse import DockerfileParser

    from workbench.models.pins import pin

    _, config, record = minilm
    if record.metric("triton.variant") != "openvino":
        triton.run(config, record)
    deploy.run(config, record)
    dockerfile = DockerfileParser(fileobj=record.artifact("deploy.dockerfile").open("rb"))
    run = next(s["value"] for s in dockerfile.structure if s["instruction"] == "RUN" and "pip install" in s["value"])
    assert pin("openvino") in shlex.split(run) and pin("onnxruntime-gpu") in shlex.split(run)


def test_an_interrupted_trial_leaves_no_openvino_file(tiny_bert, tmp_path, monkeypatch):
    config = RunConfig.model_validate({"model": str(tiny_bert), "precisions": ["fp32"],
                                       "optimize": {"openvino": "never"}})
    record = RunRecord.create(tmp_path / "run", config)
    export.run(config, record)
    optimize.run(config, record)
    config = config.model_copy(deep=True)
    config.optimize.openvino = "auto"

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(openvino_variants, "trial", interrupted)
    with pytest.raises(KeyboardInterrupt):
        openvino_variants.build_openvino(config, record, run_race_bench(config, record),
                                         target_for("host", False))
    path = record.run_dir / "onnx" / "openvino.onnx"
    assert not path.exists() and not list(path.parent.glob(".openvino.onnx*"))


def test_openvino_always_without_openvino_is_refused_before_the_run(monkeypatch):
    missing = "OpenVINO is not installed (No module named 'x')"
    monkeypatch.setattr(openvino_variants, "openvino_problem", lambda: missing)
    with pytest.raises(DependencyMissingError) as refused:
        optimize.check(RunConfig(optimize={"openvino": "always"}))
    assert "optimize.openvino=always needs OpenVINO" in refused.value.problem and "[openvino]" in refused.value.fix
    optimize.check(RunConfig())  # auto: tried where installed, recorded where not
    assert "not installed" in openvino_variants.openvino_skipped(RunConfig(), target_for("host", False))


def test_where_it_is_not_tried_the_record_says_why():
    host = Target("host", frozenset({"avx2"}))
    never = RunConfig(optimize={"openvino": "never"})
    assert openvino_variants.openvino_skipped(never, host) == "not tried (optimize.openvino=never)"
    assert "runs on a GPU" in openvino_variants.openvino_skipped(RunConfig(), Target("gpu", name="the GPU"))
    named = target_for("avx2", False)
    assert "is not this host" in openvino_variants.openvino_skipped(RunConfig(), named)
    assert openvino_variants.openvino_skipped(RunConfig(optimize={"openvino": "always"}), named) is None
    assert openvino_variants.openvino_skipped(RunConfig(), host) is None


def test_the_python_model_serves_it_before_fp32_and_the_onnxruntime_backend_never():
    decided = PrecisionDecision(built=False, pays=False, reason="does not pay")
    order, _ = preference(Flavor.PYTHON_ORT, decided)
    assert order.index("openvino") == order.index("fp32") - 1
    assert "openvino" not in preference(Flavor.ONNXRUNTIME, decided)[0]


def test_shared_layer_weights_reach_openvino_once(tmp_path):
    """ALBERT's layers share one set of weights. OpenVINO packs a plain MatMul weight once per reader (ALBERT-base at
    bf16: 475 MB and 1.34x its own IR's time at b1 s16); the OpenVINO file stores each shared table transposed, once,
    and OpenVINO's compiled FullyConnected layers then read one weight per table, with the export's answers."""
    from workbench.models.tiny import build_encoder

    config = RunConfig.model_validate({"model": str(build_encoder(tmp_path / "albert", "albert", layers=3)),
                                       "precisions": ["fp32"], "threads": 1})
    record = RunRecord.create(tmp_path / "run", config)
    export.run(config, record)
    dest = record.run_dir / "onnx" / "openvino.onnx"
    openvino_variants.openvino_file(record, dest, "f32")
    graph = onnxfiles.load(dest).graph
    stored = {tensor.name: tensor for tensor in graph.initializer}
    views = [node for node in graph.node if node.op_type == "Transpose" and node.input[0].endswith(".T")]
    assert len(views) == 6 * 3 and len({node.input[0] for node in views}) == 6
    assert all(node.input[0] in stored for node in views)
    with OpenVinoRunner("openvino", dest, 1) as openvino, \
            OrtRunner("original", record.artifact("onnx.original"), ["CPUExecutionProvider"], 1) as original:
        layers = [op for op in openvino.compiled.get_runtime_model().get_ops()
                  if op.get_rt_info()["layerType"].astype(str) == "FullyConnected"]
        weights = {op.input_value(1).get_node().get_friendly_name() for op in layers}
        assert (len(layers), len(weights)) == (1 + 6 * 3, 1 + 6), "the embedding projection; six tables, 3 layers each"
        batch = corpus_batch(record, original.input_names)
        got, want = openvino.infer(batch), original.infer(batch)
    gate = DEFAULT_TOLERANCES["fp32"]["hidden"]
    for name, value in want.items():
        assert np.all(np.abs(got[name] - value) <= gate.atol + gate.rtol * np.abs(value)), name


def test_the_optimize_line_lists_the_openvino_variants_it_kept(minilm):
    """The line named only ONNX Runtime's graphs (fresh-clone trial: "variants built: fp32 90 MB, int8 23 MB,
    tensorrt 90 MB" for a run that kept openvino_bf16), and tiny files as 0 MB."""
    _, _, record = minilm
    prefix = "variants in this run (as in the table): "
    built = next(line for line in optimize.lines(record) if line.startswith(prefix))
    sizes = dict(item.rsplit(" ", 2)[:2] for item in built.removeprefix(prefix).split(", "))
    kept = [name for name in OPENVINO_BUILDS if name in record.variant_names()]
    assert list(sizes) == list(record.variant_megabytes()), "the table's variants, in its order"
    assert "openvino" in kept and set(kept) <= set(sizes)
    assert float(sizes["openvino"]) == pytest.approx(record.variant("openvino").path.stat().st_size / 1e6, rel=1e-2)

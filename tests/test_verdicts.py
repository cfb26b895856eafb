"""Verdicts: nothing reads ok unless it was checked in this run; re-runs and failures make consumers stale."""
from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from workbench.core.config import RunConfig
from workbench.core.errors import ConfigError, MissingArtifactError, OutputDirError, ShapeError
from workbench.core.record import RunRecord
from workbench.graphs.errors import OnnxModelError, OpsetError
from workbench.graphs.tables import ExportMetrics
from workbench.models.loading import load_model
from workbench.pipeline import prepare_run_dir, run_pipeline
from workbench.precision.errors import UnverifiedError
from workbench.precision.lab import ParityLab, lab_texts
from workbench.report.page import build_report
from workbench.runners.registry import open_variant
from workbench.serving.errors import PortInUseError
from workbench.serving.flavor import Flavor
from workbench.serving.settings import lab_settings
from workbench.steps import export, optimize, parity, specs, triton

from .conftest import export_metrics

SMALL = {"batch": {"min": 1, "opt": 4, "max": 8}, "sequence": {"min": 1, "opt": 32, "max": 64}}


def _produce(record: RunRecord, content: str, fail: bool = False) -> None:
    with record.step("export"):
        path = record.run_dir / "onnx" / "original.onnx"
        path.parent.mkdir(exist_ok=True)
        path.write_text(content)
        record.add_artifact("onnx.original", path, kind="onnx", variant="original", precision="fp32")
        record.set_metric("export", export_metrics(nodes=len(content)))
        if fail:
            raise RuntimeError("export broke half-way")


def _consume(record: RunRecord) -> None:
    with record.step("optimize"):
        record.artifact("onnx.original")
        record.set_metric("optimize.variants.original", {"nodes": record.metric("export.nodes")})


def test_a_rerun_drops_its_old_outputs_and_makes_consumers_stale(tmp_path):
    record = RunRecord.create(tmp_path, RunConfig())
    _produce(record, "first")
    _consume(record)
    assert record.status("optimize") == "ok"
    inputs = record.data["steps"]["optimize"]["inputs"]
    assert set(inputs) == {"onnx.original", "metrics:export.nodes"}
    _produce(record, "second")
    assert record.status("export") == "ok"
    stale = RunRecord.load(tmp_path).data["steps"]["optimize"]
    assert stale["status"] == "stale"
    assert stale["reason"] == "inputs changed since it ran: export ran again (onnx.original, metrics.export.nodes)"
    _consume(record)
    assert record.status("optimize") == "ok"


def test_a_failed_rerun_leaves_no_old_result_and_consumers_stale(tmp_path):
    record = RunRecord.create(tmp_path, RunConfig())
    _produce(record, "first")
    _consume(record)
    with pytest.raises(RuntimeError):
        _produce(record, "second", fail=True)
    saved = RunRecord.load(tmp_path)
    assert saved.status("export") == "failed" and saved.status("optimize") == "stale"
    assert "onnx.original" not in saved.data["artifacts"] and not (tmp_path / "onnx" / "original.onnx").exists()
    assert saved.data["metrics"]["export"]["nodes"] == 6, "kept in run.json for diagnosis"
    assert saved.metric("export.nodes", "absent") == "absent", "but no step reads a failed step's results"


def test_a_step_after_a_failed_one_reads_none_of_its_results_and_stays_ok(tmp_path):
    record = RunRecord.create(tmp_path, RunConfig())
    with pytest.raises(RuntimeError):
        _produce(record, "half", fail=True)
    with record.step("optimize"):
        with pytest.raises(MissingArtifactError):
            record.artifact("onnx.original")
        assert record.metric("export.nodes") is None
        with pytest.raises(MissingArtifactError, match="no export metrics"):
            record.needed(ExportMetrics)
    saved = RunRecord.load(tmp_path)
    assert saved.status("optimize") == "ok" and saved.data["steps"]["optimize"]["inputs"] == {}


def test_reading_a_stale_result_is_not_news_until_it_changes_again(tmp_path):
    record = RunRecord.create(tmp_path, RunConfig())
    _produce(record, "first")
    _consume(record)
    _produce(record, "second")  # optimize is stale now
    with record.step("parity"):
        record.metric("optimize.variants.original")
    assert record.status("parity") == "ok", "it read a result that was already stale: nothing changed since"
    _consume(record)  # optimize runs again: now parity's input did change
    assert record.status("parity") == "stale"
    assert "optimize ran again (" in record.data["steps"]["parity"]["reason"]
    assert "metrics.optimize.variants.original" in record.data["steps"]["parity"]["reason"]


def test_a_step_marked_skipped_keeps_nothing_from_before(tmp_path):
    record = RunRecord.create(tmp_path, RunConfig())
    _produce(record, "first")
    _consume(record)
    record.mark("export", "skipped", "not run: an earlier step failed")
    saved = RunRecord.load(tmp_path)
    assert "export" not in saved.data["metrics"] and "onnx.original" not in saved.data["artifacts"]
    assert not (tmp_path / "onnx" / "original.onnx").exists()
    assert saved.status("optimize") == "stale"


def test_a_file_changed_behind_the_record_makes_its_consumers_stale(tmp_path):
    record = RunRecord.create(tmp_path, RunConfig())
    _produce(record, "first")
    _consume(record)
    (tmp_path / "onnx" / "original.onnx").write_text("truncated by someone else")
    record.mark("parity", "skipped", "not requested")  # any later change to the record re-checks its inputs
    assert record.status("export") == "ok"
    step = RunRecord.load(tmp_path).data["steps"]["optimize"]
    assert step["status"] == "stale" and "the file export wrote changed (onnx.original)" in step["reason"]


def test_a_truncated_run_record_is_a_typed_error(tmp_path):
    RunRecord.create(tmp_path, RunConfig())
    text = (tmp_path / "run.json").read_text()
    (tmp_path / "run.json").write_text(text[: len(text) // 2])
    with pytest.raises(OutputDirError, match="run.json is not a readable run record"):
        RunRecord.load(tmp_path)


def test_parity_with_nothing_to_compare_is_refused_before_loading_the_model(tmp_path):
    config = RunConfig(model=str(tmp_path / "no-such-model"))  # loading it would fail differently
    record = RunRecord.create(tmp_path / "run", config)
    with pytest.raises(MissingArtifactError, match="no ONNX variant to compare"):
        parity.run(config, record)
    assert record.status("parity") == "failed"


# An impossible gate on the token states, which the deployment does not serve: no variant may fail on them.
NO_TOKEN_ERROR = {"token_embeddings": {"atol": 0.0, "rtol": 0.0}}


@pytest.fixture(scope="module")
def checked_run(tiny_models, tmp_path_factory) -> tuple[RunConfig, RunRecord]:
    config = RunConfig.model_validate({"model": str(tiny_models["bert"]), **SMALL, "precisions": ["fp32"]})
    record = RunRecord.create(tmp_path_factory.mktemp("checked"), config)
    export.run(config, record)
    optimize.run(config, record)
    parity.run(config, record)
    return config, record


def test_a_verdict_is_decided_on_the_outputs_the_deployment_serves(checked_run):
    """The token states are measured and shown; only the served outputs gate, here and in the triton step, which
    checks again a pass recorded before triton.outputs named more."""
    config, record = checked_run
    settings = config.model_dump(exclude_unset=True)
    strict = RunConfig.model_validate({**settings, "tolerances": NO_TOKEN_ERROR})
    served_tokens = RunConfig.model_validate({**settings, "tolerances": NO_TOKEN_ERROR,
                                              "triton": {"outputs": ["token_embeddings", "sentence_embedding"]}})
    assert (lab_settings(strict).gated, lab_settings(served_tokens).gated) == (("sentence_embedding",),
                                                            ("token_embeddings", "sentence_embedding"))
    loaded = load_model(strict)
    texts = lab_texts(lab_settings(strict), loaded)
    with open_variant(record.variant("fp32"), "cpu", 1) as runner:
        served = ParityLab.build(lab_settings(strict), loaded, texts).compare(runner, "fp32")
        both = ParityLab.build(lab_settings(served_tokens), loaded, texts).compare(runner, "fp32")
    tokens = served.outputs["token_embeddings"]
    assert tokens.max_abs > 0 and not tokens.passed and not tokens.gated, "measured past its gate"
    assert served.passed and served.gated_on == ["sentence_embedding"] and served.failures == []
    assert served.ungated[0].startswith("token_embeddings: ") and served.violation == 0.0
    assert not both.passed and both.failures[0].startswith("token_embeddings: ")
    record.set_metric("parity.variants.fp32", served.recorded())
    assert triton.recorded_verdict(strict, record, "fp32").passed
    assert triton.recorded_verdict(served_tokens, record, "fp32") is None, "gated on less than is served"
    with pytest.raises(UnverifiedError, match="fp32.*token_embeddings: "):
        triton.verified_variant(served_tokens, record, Flavor.PYTHON_ORT,
                                triton.candidate_variants(served_tokens, record, Flavor.PYTHON_ORT), loaded)
    line = next(line for line in parity.lines(record) if line.startswith("  fp32: "))
    assert "gated on sentence_embedding (served); not gated: token_embeddings: " in line


def _optimized(model: Path, root: Path, **settings) -> tuple[RunConfig, RunRecord]:
    config = RunConfig.model_validate({"model": str(model), **SMALL, "threads": 1, **settings,
                                       "triton": {"repository_dir": str(root / "repos"),
                                                  **settings.get("triton", {})}})
    record = RunRecord.create(root / "run", config)
    export.run(config, record)
    optimize.run(config, record)
    return config, record


def test_a_deleted_variant_file_is_a_typed_error_naming_its_step(checked_run, tmp_path):
    config, record = checked_run
    copy = RunRecord(tmp_path, record.data)
    with pytest.raises(MissingArtifactError, match=r"original.onnx is gone\n.*--steps export"):
        copy.variants()


def test_optimize_failing_on_a_corrupt_export_makes_parity_stale(checked_run):
    config, record = checked_run
    assert record.status("parity") == "ok"
    original = record.artifact("onnx.original")
    original.write_bytes(original.read_bytes()[:1000])
    with pytest.raises(OnnxModelError):
        optimize.run(config, record)
    saved = RunRecord.load(record.run_dir)
    assert saved.status("optimize") == "failed"
    assert saved.status("parity") == "stale"
    assert re.search(r"optimize ran again \([^)]*onnx\.fp32", saved.data["steps"]["parity"]["reason"])
    assert not saved.metric("optimize.variants")
    assert not (record.run_dir / "onnx" / "fp32.onnx").exists()


# int8 first in the serving order on any host: the target is named (not measured), with int8 dot-product instructions
STRICT = {"tolerances": {"sentence_embedding": {"min_cosine": 0.999995}, **NO_TOKEN_ERROR},
          "precisions": ["fp32", "int8"], "target": {"cpu": "avx512_vnni"}}


@pytest.mark.slow
def test_the_triton_step_serves_only_what_passed_parity(tiny_models, tmp_path):
    config, record = _optimized(tiny_models["bert"], tmp_path, **STRICT)
    metrics = triton.run(config, record).metrics  # no parity step ran: the triton step checks the candidates itself
    assert metrics["variant"] == "fp32" and metrics["verified"] is True
    assert metrics["verification"]["by"] == "triton step"
    checked = metrics["verification"]["checked_here"]
    assert checked["int8"]["passed"] is False and checked["fp32"]["passed"] is True
    assert checked["fp32"]["ungated"][0].startswith("token_embeddings: "), "served though past the unserved gate"
    order = next(line for line in triton.lines(record) if line.startswith("serving order: "))
    assert "; passed over: int8 (sentence_embedding: min cosine " in order, "the summary says why fp32 is served"
    assert "verified" not in record.data["steps"]["triton"]
    assert all(metrics["served_parity"][p]["passed"] for p in ("http", "grpc"))


@pytest.mark.slow
def test_a_failing_variant_is_refused_unless_the_user_allows_it(tiny_models, tmp_path):
    config, record = _optimized(tiny_models["bert"], tmp_path, **STRICT, triton={"variant": "int8"})
    with pytest.raises(UnverifiedError, match="no variant to serve passed parity"):
        triton.run(config, record)
    assert record.status("triton") == "failed"
    assert not (tmp_path / "repos").exists() or not any((tmp_path / "repos").iterdir())
    allowed = config.model_copy(update={"triton": config.triton.model_copy(update={"allow_unverified": True})})
    metrics = triton.run(allowed, record).metrics
    step = record.data["steps"]["triton"]
    assert step["status"] == "ok" and step["verified"] is False and metrics["verified"] is False
    assert metrics["served_parity"]["http"]["passed"] is False


@pytest.mark.slow
def test_a_served_parity_failure_publishes_nothing_and_keeps_the_earlier_deployment(tiny_models, tmp_path):
    lax, record = _optimized(tiny_models["bert"], tmp_path, precisions=["fp32", "int8"], parity={"repair": False},
                             triton={"variant": "int8"})
    assert parity.run(lax, record).metrics["variants"]["int8"]["passed"]
    first = triton.run(lax, record).metrics
    published = Path(first["repository"])
    assert first["published"] and first["verified"] and published.is_dir()
    marker = (published / ".workbench.json").read_text()
    strict = lax.model_copy(update={"tolerances": RunConfig.model_validate(STRICT).tolerances})
    with pytest.raises(UnverifiedError, match="served by Triton fails parity over http, grpc.*nothing was published"):
        triton.run(strict, record)
    assert (published / ".workbench.json").read_text() == marker, "the earlier verified deployment is untouched"
    assert not (tmp_path / "run" / "model_repository" / first["name"]).exists()
    assert "triton.repository" not in record.data["artifacts"]
    assert record.status("triton") == "failed" and record.data["metrics"]["triton"]["published"] is False


@pytest.mark.slow
def test_a_variant_failing_served_parity_gives_way_to_the_next(tiny_models, tmp_path):
    """Dynamic int8 answers depend on the batch a text lands in: served batches are not the lab's, so a variant may
    pass in process and fail served. The next candidate is served instead, and the record says why."""
    lax, record = _optimized(tiny_models["bert"], tmp_path, precisions=["fp32", "int8"], parity={"repair": False},
                             target={"cpu": "avx512_vnni"})  # int8 first, on any host
    assert parity.run(lax, record).metrics["variants"]["int8"]["passed"]
    strict = lax.model_copy(update={"tolerances": RunConfig.model_validate(STRICT).tolerances})
    metrics = triton.run(strict, record).metrics
    assert metrics["variant"] == "fp32" and metrics["verified"] and metrics["published"]
    assert metrics["verification"]["passed_over"]["int8"][0].startswith("served over http, grpc")
    assert record.status("triton") == "ok"


def _refused(config: RunConfig, run_dir: Path, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        run_pipeline(config, run_dir)
    assert not run_dir.exists(), "refused before anything was written or any kernel started"


def test_settings_are_checked_before_the_first_kernel(tiny_bert, tmp_path):
    base = {"model": str(tiny_bert), **SMALL}
    run_dir = tmp_path / "run"
    _refused(RunConfig.model_validate({**base, "sequence": {"min": 1, "opt": 64, "max": 256}}), run_dir,
             ShapeError, "sequence.max=256 exceeds the model's limit of 128")
    _refused(RunConfig.model_validate({**base, "opset": 5}), run_dir, OpsetError, "opset 5 is outside")
    for content, match in ((None, "cannot read corpus"), (b"\n \n", "holds no text"),
                           (b"\xff\xfe\xfa", "line 1 is not UTF-8")):
        corpus = tmp_path / "corpus.txt"
        corpus.unlink(missing_ok=True)
        if content is not None:
            corpus.write_bytes(content)
        _refused(RunConfig.model_validate({**base, "corpus": str(corpus)}), run_dir, ConfigError, match)
    same = {"http_port": 18000, "grpc_port": 18000}
    _refused(RunConfig.model_validate({**base, "triton": same}), run_dir, ConfigError, "ports must differ")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = {"http_port": taken.getsockname()[1]}
        _refused(RunConfig.model_validate({**base, "triton": busy}), run_dir, PortInUseError, "already in use")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    _refused(RunConfig.model_validate({**base, "triton": {"repository_dir": str(blocker / "repos")}}), run_dir,
             OutputDirError, "triton.repository_dir")


def test_overwrite_removes_what_the_earlier_run_wrote_and_nothing_else(tmp_path):
    record = RunRecord.create(tmp_path, RunConfig())
    _produce(record, "earlier")
    (tmp_path / "report.html").write_text("<html>")
    record.add_artifact("report", tmp_path / "report.html", kind="report")
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "01_export.ipynb").write_text("{}")
    (tmp_path / "repair" / "int8").mkdir(parents=True)
    (tmp_path / "notes.txt").write_text("the user's")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "data.csv").write_text("1,2")
    with pytest.raises(OutputDirError, match="already holds files"):
        prepare_run_dir(tmp_path, overwrite=False)
    prepare_run_dir(tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "notes.txt"]
    assert (tmp_path / "mine" / "data.csv").read_text() == "1,2"


def test_the_report_shows_stale_and_unverified_steps(tmp_path):
    record = RunRecord.create(tmp_path, RunConfig())
    _produce(record, "first")
    _consume(record)
    _produce(record, "second")
    with record.step("triton"):
        record.unverified("int8 did not pass parity")
    page = build_report(record, tmp_path / "report.html", specs()).read_text()
    assert '<td class="stale">stale</td>' in page and "export ran again (onnx.original" in page
    assert '<td class="ok">ok, verified: false</td>' in page and "int8 did not pass parity" in page

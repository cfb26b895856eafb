"""The results contract: steps' metrics are written through their models, and a run.json written before typed
results (schema 1, the demo's record from the main branch before them) is migrated and still renders."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from workbench.cli import main
from workbench.core.config import RunConfig
from workbench.core.errors import OutputDirError
from workbench.core.record import RunRecord
from workbench.core.results import SCHEMA_VERSION, migrate
from workbench.graphs.tables import ExportMetrics
from workbench.precision.tables import ParityMetrics
from workbench.serving.flavor import Flavor
from workbench.serving.tables import TritonMetrics

from .conftest import export_metrics

V1_DEMO = Path(__file__).parent / "data" / "run-v1-demo.json.gz"  # `make demo` on main before typed results


def _v1_run(folder: Path) -> Path:
    folder.mkdir()
    (folder / "run.json").write_bytes(gzip.decompress(V1_DEMO.read_bytes()))
    return folder


def test_an_old_record_reads_into_the_models(tmp_path):
    record = RunRecord.load(_v1_run(tmp_path / "v1"))
    assert record.data["schema"] == SCHEMA_VERSION == 4
    for step in record.data["metrics"]:  # every table as its model declares it: nothing undeclared is left
        assert record.results(step) is not None
    parity = ParityMetrics.model_validate(record.metric("parity"))
    repair = parity.repair["int8"]
    assert (repair.outcome, repair.units, repair.base) == ("repaired", 25, "per-channel weights, smoothed (alpha 0.7)")
    assert repair.chosen is not None and repair.chosen.blocked == [
        "/model/encoder/layer.0/output/dense/MatMul", "/model/encoder/layer.2/output/dense/MatMul",
        "EmbedLayerNormalization_0"]
    assert not parity.variants["int8"].passed and parity.variants["int8_repaired"].passed
    assert parity.variants["int8_repaired"].retrieval["recall_at_10"] > 0.9
    deployment = record.current(TritonMetrics)
    assert deployment is not None
    assert deployment.flavor is Flavor.PYTHON_ORT and deployment.variant == "int8_repaired"
    assert record.needed(ExportMetrics).io.inputs["input_ids"] == ["batch", "sequence"]
    resolved = record.needed(ExportMetrics).sequence_range  # recorded by the migration from the run's own settings
    assert (resolved.min, resolved.opt, resolved.max) == (1, 128, 256)


def test_the_bench_peak_moves_to_its_place_and_a_newer_record_is_refused(tmp_path):
    old = {"schema": 1, "metrics": {"bench": {"latency": {"peak_gflops": 120.0, "cells": {}}}}}
    assert migrate(old, {})["metrics"]["bench"]["latency"] == {"peaks": {"fp32": 120.0}, "cells": {}}
    assert old["schema"] == SCHEMA_VERSION
    folder = tmp_path / "future"
    folder.mkdir()
    (folder / "run.json").write_text(json.dumps({"schema": 5, "config": {}, "steps": {}, "artifacts": {},
                                                 "metrics": {}}))
    with pytest.raises(OutputDirError, match="written by a newer workbench .schema 5, this one reads up to 4"):
        RunRecord.load(folder)


def test_a_step_whose_metrics_break_its_model_fails_naming_the_field(tmp_path):
    record = RunRecord.create(tmp_path, RunConfig())
    with pytest.raises(ValueError, match="num_layers\n  Input should be a valid integer"), record.step("export"):
        record.set_metric("export", export_metrics(num_layers="six"))
    assert record.status("export") == "failed"
    with pytest.raises(ValueError, match="nodez\n  Extra inputs are not permitted"), record.step("export"):
        record.set_metric("export", export_metrics(nodez=7))  # a misspelt key is refused, not kept
    with record.step("export"):
        record.set_metric("export", export_metrics(nodes=7))
    assert record.status("export") == "ok" and record.needed(ExportMetrics).nodes == 7


@pytest.mark.slow
def test_an_old_run_still_renders_with_steps_report(tmp_path, capsys):
    run = _v1_run(tmp_path / "v1")
    assert main(["run", "--resume", "--output-dir", str(run), "--steps", "report", "--quiet"]) == 0
    html = (run / "report.html").read_text(encoding="utf-8")
    assert "Could not be drawn" not in html
    assert "int8 precision repair</h2>\n<p>Outcome: repaired; units kept in fp32: 3 of 25" in html
    assert "Quantized as: per-channel weights, smoothed (alpha 0.7)." in html
    assert json.loads((run / "run.json").read_text())["schema"] == SCHEMA_VERSION

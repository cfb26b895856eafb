from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from workbench.core.atomic import atomic_dir, atomic_path
from workbench.core.config import RunConfig
from workbench.core.errors import ConfigError, GpuRequiredError, MissingArtifactError, OutputDirError
from workbench.core.record import RunRecord, StepEntry


def test_step_statuses_and_seconds(tmp_path):
    record = RunRecord.create(tmp_path, RunConfig())
    with record.step("export"):
        pass
    with record.step("tensorrt"):
        raise GpuRequiredError("building an engine needs an NVIDIA GPU", "run on a GPU host")
    with pytest.raises(ValueError), record.step("optimize"):
        raise ValueError("boom")
    steps = json.loads((tmp_path / "run.json").read_text())["steps"]
    assert steps["export"]["status"] == "ok" and steps["export"]["seconds"] >= 0
    assert steps["tensorrt"]["status"] == "skipped"
    assert "needs an NVIDIA GPU" in steps["tensorrt"]["reason"]
    assert RunRecord.load(tmp_path).step_entry("tensorrt").detail == (
        "building an engine needs an NVIDIA GPU; `workbench doctor` shows what this machine can run")
    assert steps["optimize"]["status"] == "failed" and steps["optimize"]["error"] == "ValueError: boom"


def test_a_step_records_the_memory_its_process_tree_held_at_its_peak(tmp_path):
    """Peak memory counts the processes a step starts (a server, its stubs), however the step ends."""
    record = RunRecord.create(tmp_path, RunConfig())
    with record.step("export"):
        pass
    alone = record.step_entry("export").peak_mb
    held = "import time; block = bytearray(300 * 2**20); block[::4096] = b'x' * len(block[::4096]); time.sleep(1.5)"
    with pytest.raises(subprocess.CalledProcessError), record.step("triton"):
        subprocess.run([sys.executable, "-c", held + "; raise SystemExit(3)"], check=True)
    assert 0 < alone < record.step_entry("triton").peak_mb - 250, "the child's 300 MB are counted"
    assert json.loads((tmp_path / "run.json").read_text())["steps"]["triton"]["peak_mb"] > 300


def test_artifacts_carry_size_and_sha256(tmp_path):
    record = RunRecord.create(tmp_path, RunConfig())
    blob = tmp_path / "onnx" / "x.onnx"
    blob.parent.mkdir()
    blob.write_bytes(b"0123456789")
    record.add_artifact("onnx.x", blob, kind="onnx", variant="x")
    entry = RunRecord.load(tmp_path).data["artifacts"]["onnx.x"]
    assert entry == {"path": "onnx/x.onnx", "kind": "onnx", "bytes": 10,
                     "sha256": hashlib.sha256(b"0123456789").hexdigest(), "variant": "x", "step": None,
                     "mtime_ns": blob.stat().st_mtime_ns}
    assert record.artifact("onnx.x") == blob
    with pytest.raises(MissingArtifactError, match="no artifact 'onnx.fp16'"):
        record.artifact("onnx.fp16")
    blob.unlink()
    with pytest.raises(MissingArtifactError, match="is gone"):
        record.artifact("onnx.x")


def test_metrics_are_nested_by_dots_under_the_step_that_writes_them(tmp_path):
    record = RunRecord.create(tmp_path, RunConfig())
    with record.step("optimize"):
        record.set_metric("optimize.variants.fp32.nodes", 46)
        with pytest.raises(ValueError, match="optimize.*not 'parity.variants.fp32'"):
            record.set_metric("parity.variants.fp32", {"passed": True})
    assert RunRecord.load(tmp_path).data["metrics"] == {"optimize": {"variants": {"fp32": {"nodes": 46}}}}
    assert record.metric("optimize.variants.fp32.nodes") == 46
    assert record.metric("optimize.variants.int8.nodes", "absent") == "absent"
    entry = record.step_entry("optimize")
    assert (entry.status, entry.metrics) == ("ok", {"variants": {"fp32": {"nodes": 46}}})
    assert record.step_entry("parity") == StepEntry("parity", None, "", None, None, {})


def test_open_refuses_a_folder_holding_another_models_run(tmp_path):
    record = RunRecord.create(tmp_path, RunConfig())
    with record.step("export"):
        pass
    with pytest.raises(ConfigError, match="different model"):
        RunRecord.open(tmp_path, RunConfig(model="/elsewhere/model"))
    assert RunRecord.open(tmp_path, RunConfig(threads=2)).config.threads == 2


def test_unwritable_output_dir_is_a_typed_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(OutputDirError, match="cannot write to "):
        RunRecord.create(blocker / "run", RunConfig())


def test_atomic_path_leaves_nothing_on_failure(tmp_path):
    dest = tmp_path / "out.bin"
    with pytest.raises(RuntimeError), atomic_path(dest) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_atomic_dir_replaces_only_when_complete(tmp_path):
    dest = tmp_path / "model"
    with atomic_dir(dest) as tmp:
        (tmp / "a.txt").write_text("first")
    with pytest.raises(RuntimeError), atomic_dir(dest) as tmp:
        (tmp / "a.txt").write_text("second")
        raise RuntimeError("interrupted")
    assert (dest / "a.txt").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_step_run_again_names_the_later_steps_it_made_stale_and_the_notebook_to_open_next(tmp_path):
    from workbench.steps import whats_next

    record = RunRecord.create(tmp_path, RunConfig())
    graph = tmp_path / "onnx" / "fp32.onnx"
    graph.parent.mkdir()
    graph.write_bytes(b"first")
    with record.step("optimize"):
        record.add_artifact("onnx.fp32", graph, kind="onnx", variant="fp32", precision="fp32")
    with record.step("parity"):
        record.artifact("onnx.fp32")
    assert whats_next("optimize", record) == ["next: open 03_parity.ipynb (parity: every variant vs PyTorch on real "
                                              "text; fp16/int8 precision repair)"]
    with record.step("optimize"):  # run again: what parity read changed
        graph.parent.mkdir(exist_ok=True)
        graph.write_bytes(b"second")
        record.add_artifact("onnx.fp32", graph, kind="onnx", variant="fp32", precision="fp32")
    said = whats_next("optimize", record)
    assert said[0] == "now stale (what they read changed): parity: run 03_parity.ipynb", said
    assert whats_next("report", record) == ["this was the last step of the run"]


def test_resume_says_first_which_settings_changed_and_which_steps_that_made_stale(tmp_path):
    """`--resume` with another step setting: before any step runs, the changed settings, the steps now stale (those
    this run leaves out stay stale, with the command that redoes them) and the steps it runs."""
    from workbench.pipeline import resume_note

    config = RunConfig(steps=["export", "bench", "report"])
    record = RunRecord.create(tmp_path, config)
    for step in ("export", "bench", "report"):
        with record.step(step):
            pass
    before = record.data["config"]
    changed = RunConfig.load(None, ["bench.rounds=10"], base=before, values={"steps": ["report"]})
    resumed = RunRecord.open(tmp_path, changed, must_exist=True)
    note = resume_note(resumed, changed.steps).splitlines()
    assert note[0] == f"resuming {tmp_path}: settings changed since it last ran: bench.rounds 20 -> 10"
    assert note[1].startswith("  stale now: bench (bench not in this run: it stays stale; ")
    assert "--steps bench" in note[1] and note[2] == "  runs: report"
    again = RunRecord.open(tmp_path, changed, must_exist=True)
    assert resume_note(again, ["bench"]).splitlines()[0] == (
        f"resuming {tmp_path}: no setting changed since it last ran")
    older = json.loads(json.dumps(again.data["config"]))  # as a run recorded it before deploy had a section
    older["triton"].update({key: older["deploy"].pop(key) for key in ("target_rps", "image_registry")})
    again.data["config"] = older
    again.save()
    assert resume_note(RunRecord.open(tmp_path, changed, must_exist=True), ["bench"]).splitlines()[0] == (
        f"resuming {tmp_path}: no setting changed since it last ran")

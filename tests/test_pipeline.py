"""`workbench run` end to end: papermill executes the step notebooks on a tiny model."""
from __future__ import annotations

import json
import math
import shutil

import pytest

from workbench.cli import main
from workbench.core.atomic import sha256_file
from workbench.core.config import RunConfig
from workbench.core.machine import gpu_name
from workbench.core.record import RunRecord
from workbench.steps import step_names

TRT_STATUS = "skipped" if gpu_name() is None else "ok"  # TensorRT builds only where a GPU is


@pytest.mark.slow
def test_cli_runs_the_step_notebooks(tiny_bert, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(["run", "--model", str(tiny_bert), "--output-dir", str(run_dir), "-p", "precisions=[fp32,int8]",
                 "-p", "sequence={min: 1, opt: 32, max: 64}", "-p", "batch.max=8", "--quiet",
                 "-p", f"triton.repository_dir={tmp_path / 'repositories'}", "-p", "threads=1",
                 "-p", "bench={rounds: 3, batches: [1], sequences: [8], concurrency: [2], requests_per_level: 16, "
                       "search_queue_delays_us: [0], search_instances: [1]}",
                 "-p", "generation={texts: 4, max_new_tokens: 8, concurrency: [2], requests_per_level: 8}"])
    assert code == 0
    assert f"run.json: {run_dir / 'run.json'}" in capsys.readouterr().out
    record = json.loads((run_dir / "run.json").read_text())
    assert [(n, s["status"]) for n, s in record["steps"].items()] == [
        ("export", "ok"), ("optimize", "ok"), ("parity", "ok"), ("tensorrt", TRT_STATUS), ("triton", "ok"),
        ("generation", "ok"), ("bench", "ok"), ("deploy", "ok"), ("report", "ok")]
    # One word per step: each step's metrics live under metrics.<step>, and only there.
    assert set(record["metrics"]) <= set(record["steps"])
    for name, step in record["steps"].items():
        assert all(key == name or key.startswith(f"{name}.") for key in step.get("metrics", [])), name
    assert record["metrics"]["parity"]["variants"]["fp32"]["passed"]
    assert record["metrics"]["triton"]["served_parity"]["http"]["passed"]
    assert record["config"]["precisions"] == ["fp32", "int8"]
    assert record["metrics"]["optimize"]["variants"]["fp32"]["fused"]["Attention"] == 2
    for name, artifact in record["artifacts"].items():
        path = run_dir / artifact["path"]
        if path.is_file():
            assert artifact["sha256"] == sha256_file(path), name
    assert {"notebook.export", "notebook.optimize", "notebook.parity", "onnx.int8"} <= set(record["artifacts"])
    assert (run_dir / "report.html").stat().st_size > 1_000_000  # plotly embedded
    assert record["metrics"]["generation"]["translation"]["in_process"]["identical"] == 4
    for notebook in ("02_optimize.ipynb", "03_parity.ipynb", "05_triton.ipynb", "06_generation.ipynb",
                     "07_bench.ipynb"):
        executed = json.loads((run_dir / "notebooks" / notebook).read_text())
        assert any("plotly" in json.dumps(cell.get("outputs")) for cell in executed["cells"]), notebook
    assert record["environment"]["packages"]["onnxruntime"]
    verdict_lines = {notebook.name: "".join(json.loads(notebook.read_text())["cells"][-1]["outputs"][0]["text"])
                     for notebook in sorted((run_dir / "notebooks").glob("*.ipynb"))}
    assert "Attention fused in 2 of 2 layers" in verdict_lines["02_optimize.ipynb"]
    assert "fp32: pass, min cosine" in verdict_lines["03_parity.ipynb"]
    served = "served parity against SentenceTransformer.encode() on texts up to 64 tokens: HTTP pass and gRPC pass"
    assert served in verdict_lines["05_triton.ipynb"]
    bench = [line for line in verdict_lines["07_bench.ipynb"].splitlines()  # a word on the host's load comes first
             if not line.startswith(("the host was busy", "timings disturbed by other work"))]
    assert bench[0].startswith("latency: "), verdict_lines["07_bench.ipynb"]
    memory = record["metrics"]["bench"]["served"]["memory"]  # each served instance's PSS beside its weights
    assert memory and all(m["instance"].startswith(record["metrics"]["triton"]["name"]) and
                          m["pss_mib"] > 10 for m in memory), memory
    assert "served memory (PSS after the load): " in verdict_lines["07_bench.ipynb"]
    # The deploy step sized the deployment from the bench's real served sweep (one level: concurrency 2).
    level = record["metrics"]["bench"]["served"]["batching_on"]["text"]["2"]
    capacity = record["metrics"]["deploy"]["capacity"]
    within = level["p99"] <= 500 and not level["errors"]
    assert capacity["per_replica_rps"] == (level["throughput"] if within else None)
    assert record["metrics"]["deploy"]["scaling"]["min_replicas"] == (math.ceil(100 / level["throughput"])
                                                                     if within else 1)
    assert {f"deploy.{k}" for k in ("dockerfile", "docker", "kubernetes", "adapter", "kserve", "readme")} <= \
        set(record["artifacts"])
    assert verdict_lines["08_deploy.ipynb"].startswith(f"image {record['metrics']['deploy']['image']}: ")
    assert "Triton at scale: capacity and autoscaling" in (run_dir / "report.html").read_text()

    # Resume the same run with the TensorRT step only: the stored configuration is reused, nothing is lost.
    assert main(["run", "--resume", "--output-dir", str(run_dir), "--steps", "tensorrt", "--quiet"]) == 0
    resumed = json.loads((run_dir / "run.json").read_text())
    assert resumed["config"]["sequence"] == record["config"]["sequence"]
    assert resumed["steps"]["tensorrt"]["status"] == TRT_STATUS
    assert resumed["steps"]["parity"]["status"] == "ok"
    assert set(record["artifacts"]) <= set(resumed["artifacts"])
    assert (run_dir / "engines" / "build_engines.sh").is_file()


@pytest.mark.slow
def test_failed_step_is_recorded_and_later_steps_skipped(tiny_bert, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["run", "--model", str(tiny_bert), "--output-dir", str(run_dir), "-p", "opset=99", "--quiet"]) == 2
    assert "error (OpsetError): opset 99 is outside" in capsys.readouterr().err
    assert not run_dir.exists(), "refused before the first kernel"
    broken = tmp_path / "broken-weights"
    shutil.copytree(tiny_bert, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code = main(["run", "--model", str(broken), "--output-dir", str(run_dir), "-p", "sequence.max=128", "--quiet"])
    assert code == 2
    assert "step 'export' failed:" in capsys.readouterr().err
    record = json.loads((run_dir / "run.json").read_text())
    assert record["steps"]["export"]["status"] == "failed"
    assert "model.safetensors" in record["steps"]["export"]["error"]
    for later in step_names()[1:]:
        assert record["steps"][later] == {"status": "skipped", "reason": "not run: step 'export' failed"}
    assert not (run_dir / "onnx").exists()
    assert (run_dir / "notebooks" / "01_export.ipynb").is_file()
    assert not list(run_dir.rglob("*.partial*"))


def test_existing_output_dir_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("user data")
    assert main(["run", "--output-dir", str(tmp_path), "--quiet"]) == 2
    assert "already holds files" in capsys.readouterr().err
    assert (tmp_path / "mine.txt").read_text() == "user data"
    assert not (tmp_path / "run.json").exists()


def test_unwritable_output_dir(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["run", "--output-dir", str(tmp_path / "file" / "run"), "--quiet"]) == 2
    assert "OutputDirError" in capsys.readouterr().err


def test_config_and_steps_commands(tmp_path, capsys):
    assert main(["config", "--model", "/m", "-p", "batch.max=64"]) == 0
    out = capsys.readouterr().out
    assert "model: /m" in out and "max: 64" in out
    assert main(["steps"]) == 0
    assert "notebooks/01_export.ipynb" in capsys.readouterr().out
    assert main(["config", "-p", "opest=3"]) == 2
    assert "did you mean 'opset'" in capsys.readouterr().err


@pytest.mark.parametrize(("reason", "said"), [("interrupted (SIGINT)", "was interrupted"),
                                              ("RuntimeError: boom", "failed")])
def test_the_steps_after_a_stop_say_how_it_ended(tmp_path, reason, said):
    from workbench.pipeline import _stop_at

    RunRecord.create(tmp_path / "run", RunConfig())
    _stop_at("optimize", ["parity", "triton"], tmp_path / "run", reason)
    record = RunRecord.load(tmp_path / "run")
    assert record.data["steps"]["optimize"]["error"] == reason
    for step in ("parity", "triton"):
        assert record.data["steps"][step] == {"status": "skipped", "reason": f"not run: step 'optimize' {said}"}

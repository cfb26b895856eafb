"""`workbench sweep` and `workbench compare`: the embedded model and two tiny ones from one file, interrupted and
resumed; one page whose picks are the recorded numbers' best; the Indexed Job against the Kubernetes schema."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_validate
import nbformat
import pytest
import yaml

from workbench.core.config import DEFAULT_MODEL, RunConfig
from workbench.core.errors import ConfigError
from workbench.core.record import RunRecord
from workbench.pipeline import NOTEBOOKS_DIR, run_pipeline
from workbench.sweep import finished, job_manifest, load_sweep

KUBERNETES = "1.37.0"
QUICK = {"steps": ["export", "optimize", "parity", "bench"], "precisions": ["fp32"], "parity": {"repair": False},
         "corpus_max_texts": 48,
         "batch": {"min": 1, "opt": 2, "max": 4}, "sequence": {"min": 1, "opt": 16, "max": 64},
         "bench": {"served": False, "batches": [1, 4], "sequences": [16, 64], "rounds": 3, "warmup": 1,
                   "tune_sessions": False, "seconds_per_cell": 5}}


def _sweep_file(folder: Path, tiny_models: dict[str, Path], **extra: object) -> Path:
    spec = {"output_root": "runs", "settings": QUICK,
            "runs": [{"name": "minilm", "model": DEFAULT_MODEL},
                     {"name": "tiny-bert", "model": str(tiny_models["bert"])},
                     {"name": "tiny-roberta", "model": str(tiny_models["roberta"]), "settings": {"opset": 18}}],
            **extra}
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _workbench(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "workbench"), *args]


@pytest.fixture(scope="module")
def swept(tiny_models, tmp_path_factory) -> Path:
    """The sweep, interrupted in its second run and run again: its folder."""
    tmp_path = tmp_path_factory.mktemp("sweep")
    sweep = _sweep_file(tmp_path, tiny_models)
    first = subprocess.Popen(_workbench("sweep", str(sweep)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    second = tmp_path / "runs" / "tiny-bert" / "run.json"
    deadline = time.monotonic() + 900
    while not second.is_file():  # the first run finished, the second began
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0]
        time.sleep(0.5)
    first.send_signal(signal.SIGINT)
    output = first.communicate(timeout=120)[0]
    assert first.returncode == 130, output
    assert f"workbench sweep {sweep} resumes it: finished runs are kept" in output
    assert RunRecord.load(tmp_path / "runs" / "minilm").status("bench") == "ok"

    again = subprocess.run(_workbench("sweep", str(sweep)), capture_output=True, text=True, timeout=1200)
    lines = again.stdout.splitlines()
    assert again.returncode == 0, again.stdout + again.stderr
    assert lines[0] == f"[1/3] minilm: done ({tmp_path / 'runs' / 'minilm'})", "a finished run is not run again"
    assert lines[1].startswith("[2/3] tiny-bert: resuming ") or lines[1].startswith("[2/3] tiny-bert: running")
    assert lines[-1].startswith("[3/3] tiny-roberta: finished in ") and "bench ok" in lines[-1]
    for run in ("minilm", "tiny-bert", "tiny-roberta"):
        statuses = {e.name: e.status for e in RunRecord.load(tmp_path / "runs" / run).step_entries()}
        assert statuses == dict.fromkeys(QUICK["steps"], "ok"), (run, statuses)
    return tmp_path


@pytest.mark.slow
def test_compare_picks_the_recorded_best_per_goal(swept):
    tmp_path = swept
    exported = RunRecord.create(tmp_path / "more" / "export-only", RunConfig())
    with exported.step("export"):
        pass
    shown = subprocess.run(_workbench("compare", str(tmp_path / "runs"), str(exported.run_dir), "--output",
                                      str(tmp_path / "page")), capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "export-only: no row: no variant with a parity verdict: its parity step never ran" in shown.stdout
    assert "4 runs given, 3 compared" in shown.stdout
    compared = json.loads((tmp_path / "page" / "compare.json").read_text())
    assert compared["runs"] == ["minilm", "tiny-bert", "tiny-roberta", "export-only"]
    assert "--steps optimize,parity,bench" in compared["left_out"]["export-only"]
    (group,) = compared["groups"]
    assert group["latency_cell"] == "b1_s16" and group["throughput_cell"] == "b4_s64"
    recorded = {}  # (run, variant) -> (passed, p50 at b1_s16, sequences/s at b4_s64), straight from run.json
    for run in ("minilm", "tiny-bert", "tiny-roberta"):
        record = RunRecord.load(tmp_path / "runs" / run)
        cells = record.metric("bench.latency.cells")
        for variant, verdict in record.verdicts().items():
            recorded[run, variant] = (verdict.passed, cells["b1_s16"][variant]["p50"],
                                      cells["b4_s64"][variant]["sequences_per_s"])
    assert {(r["run"], r["variant"]) for r in group["rows"]} == set(recorded)
    picks = {p["goal"]: p for p in group["picks"]}
    fastest = min((k for k, v in recorded.items() if v[0]), key=lambda k: recorded[k][1])
    busiest = max((k for k, v in recorded.items() if v[0]), key=lambda k: recorded[k][2])
    assert (picks["latency"]["run"], picks["latency"]["variant"]) == fastest
    assert (picks["throughput"]["run"], picks["throughput"]["variant"]) == busiest
    assert picks["latency"]["rule"] == "lowest median ms at b1 s16, among variants that pass parity in their run"
    page = (tmp_path / "page" / "compare.html").read_text()
    assert page.count("plotly.js v") <= 1 and "What to deploy" in page and "tiny-roberta" in page
    assert "4 runs compared" in page and "<li>export-only: no variant with a parity verdict" in page
    header = (tmp_path / "page" / "compare.csv").read_text().splitlines()[0]
    assert header.startswith("run,model,variant,precision,passed,gate,value,margin")


def test_the_indexed_job_passes_the_kubernetes_schema(tiny_models, tmp_path):
    sweep = load_sweep(_sweep_file(tmp_path, tiny_models, kubernetes={
        "image": "localhost:5000/transformer-workbench:0.1.0", "claim": "workbench-runs", "parallelism": 2}))
    config_map, job = yaml.safe_load_all(job_manifest(sweep))
    for document in (config_map, job):
        assert kubernetes_validate.validate(document, KUBERNETES, strict=True) == "1.37", document["kind"]
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 3
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][-2:] == ["--index", "$(WORKBENCH_SWEEP_INDEX)"]
    assert yaml.safe_load(config_map["data"]["sweep.yaml"])["runs"][0]["name"] == "minilm"
    wrong = {**job, "spec": {**job["spec"], "completionMod": "Indexed"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, KUBERNETES, strict=True)


def test_a_bad_sweep_file_is_a_typed_error_naming_the_run(tiny_models, tmp_path):
    path = _sweep_file(tmp_path, tiny_models)
    spec = yaml.safe_load(path.read_text())
    spec["runs"][1]["settings"] = {"opest": 18}
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match=r"run 1 \(tiny-bert\): .*opest") as info:
        load_sweep(path)
    assert "opset" in str(info.value)
    path.write_text(yaml.safe_dump({**spec, "runz": []}))
    with pytest.raises(ConfigError, match=r"runz: unknown key \(its section takes output_root, settings, runs, grid, "
                                          r"kubernetes, ray\)"):
        load_sweep(path)
    spec["runs"][1] = {"name": "minilm", "model": DEFAULT_MODEL}
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match="two runs are named 'minilm'"):
        load_sweep(path)
    path.write_text(yaml.safe_dump({**spec, "runs": [], "settings": {"reapir": False}, "grid": {"opset": [17]}}))
    with pytest.raises(ConfigError, match="sweep.yaml, settings: .*unknown setting 'reapir'"):
        load_sweep(path)


def test_dotted_and_partial_settings_keep_the_other_defaults(tiny_models, tmp_path):
    path = _sweep_file(tmp_path, tiny_models, grid={"model": ["/m/e5-small"], "sequence.max": [128, 256]})
    spec = yaml.safe_load(path.read_text())
    spec["runs"][1]["settings"] = {"sequence": {"max": 32}, "bench.rounds": 5}
    path.write_text(yaml.safe_dump(spec))
    sweep = load_sweep(path)
    assert [r.name for r in sweep.runs] == ["minilm", "tiny-bert", "tiny-roberta", "e5-small-max128",
                                            "e5-small-max256"]
    bert = sweep.runs[1].config
    assert (bert.sequence.max, bert.sequence.min, bert.bench.rounds, bert.bench.served) == (32, 1, 5, False)
    assert [r.config.sequence.max for r in sweep.runs[3:]] == [128, 256] and sweep.runs[3].config.opset == 17


@pytest.mark.slow
def test_the_compare_notebook_shows_the_same_picks(swept, tmp_path):
    import papermill

    out = tmp_path / "compare.ipynb"
    papermill.execute_notebook(str(NOTEBOOKS_DIR / "tools" / "compare.ipynb"), str(out), kernel_name="python3",
                               parameters={"runs": [str(swept / "runs")], "output": str(tmp_path / "page")},
                               progress_bar=False)
    (group,) = json.loads((tmp_path / "page" / "compare.json").read_text())["groups"]
    printed = nbformat.read(out, as_version=4).cells[-1].outputs[0]["text"]
    for pick in group["picks"]:
        assert f"{pick['goal']}: {pick['run']}/{pick['variant']} ({pick['value']})" in printed


def test_a_step_killed_before_its_notebook_landed_is_run_again_and_its_partial_goes(tmp_path):
    record = RunRecord.create(tmp_path / "run", RunConfig())
    with record.step("export"):
        pass  # recorded ok in the kernel; the process was killed before the notebook landed
    partial = tmp_path / "run" / "notebooks" / ".01_export.partial.ipynb"
    partial.parent.mkdir()
    partial.write_bytes(b"")
    assert not finished(record, "export")
    notebook = partial.with_name("01_export.ipynb")
    notebook.write_text("{}")
    record.add_artifact("notebook.export", notebook, kind="notebook")
    assert finished(record, "export")

    run_pipeline(RunConfig(steps=["report"]), tmp_path / "run", progress=False, resume=True)
    assert not partial.exists(), "a resume removes what a killed process half-wrote"

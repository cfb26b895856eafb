"""Progress of long loops: bars where they run, throttled lines for `workbench run` to print, no file left behind."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from workbench.core import progress
from workbench.core.config import RunConfig
from workbench.core.errors import StepFailedError
from workbench.core.progress import INDENT, PROGRESS_FILE_VAR, Progress, track
from workbench.core.record import RunRecord
from workbench.pipeline import ProgressTail, run_pipeline
from workbench.steps import spec

ROOT = Path(__file__).resolve().parent.parent
# A stand-in for a step's kernel: another process, which reports progress through the environment it inherited.
CHILD = """
from workbench.core.progress import Progress
with Progress("demo", total=3, unit="steps", interval=0) as bar:
    for note in "abc":
        bar.update(1, note=note)
"""
CHILD_LINES = [f"{INDENT}demo: {n}/3 steps" + (f" ({'abc'[n - 1]})" if n else "") for n in range(4)]


@pytest.fixture
def progress_file(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "progress.txt"
    path.touch()
    monkeypatch.setenv(PROGRESS_FILE_VAR, str(path))
    return path


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_lines_are_throttled_to_the_first_and_the_last(progress_file):
    with Progress("repair int8", total=10, unit="candidates", interval=3600) as bar:
        for index in range(10):
            bar.update(1, note=f"best so far: {index}")
    assert _lines(progress_file) == ["repair int8: 0/10 candidates", "repair int8: 10/10 candidates (best so far: 9)"]


def test_without_throttling_every_update_is_a_line(progress_file):
    with Progress("parity", total=3, unit="variants", interval=0) as bar:
        for name in ("original", "fp32", "int8"):
            bar.update(1, note=name)
    assert _lines(progress_file) == ["parity: 0/3 variants", "parity: 1/3 variants (original)",
                                     "parity: 2/3 variants (fp32)", "parity: 3/3 variants (int8)"]


def test_a_loop_that_stops_early_writes_where_it_stopped(progress_file):
    with pytest.raises(KeyboardInterrupt), Progress("served", total=5, unit="levels", interval=3600) as bar:
        bar.update(2, note="concurrency 2")
        raise KeyboardInterrupt
    assert _lines(progress_file)[-1] == "served: 2/5 levels (concurrency 2)"


def test_track_counts_each_item_after_it_is_done(progress_file):
    assert list(track([1, 4], "load", "levels", note=lambda c: f"c{c}")) == [1, 4]
    lines = _lines(progress_file)
    assert lines[0] == "load: 0/2 levels" and lines[-1] == "load: 2/2 levels (c4)"


def test_outside_the_pipeline_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(PROGRESS_FILE_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    with Progress("parity", total=2, unit="variants", interval=0) as bar:
        bar.update(2, note="fp32")
    assert bar.line() == "parity: 2/2 variants (fp32)"
    assert not list(tmp_path.iterdir())


def test_a_removed_file_is_not_created_again(tmp_path, monkeypatch):
    gone = tmp_path / "ended-step.txt"
    monkeypatch.setenv(PROGRESS_FILE_VAR, str(gone))
    with Progress("parity", total=1, unit="variants", interval=0) as bar:
        bar.update(1)
    assert not gone.exists()


def test_tail_prints_what_a_child_process_writes_and_removes_its_file(capsys, monkeypatch):
    monkeypatch.setenv(PROGRESS_FILE_VAR, "the caller's")
    with ProgressTail(poll=0.05) as tail:
        assert os.environ[PROGRESS_FILE_VAR] == str(tail.path) and tail.path.is_file()
        subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, check=True, capture_output=True, timeout=120)
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith(INDENT)] == CHILD_LINES
    assert not tail.path.exists()
    assert os.environ[PROGRESS_FILE_VAR] == "the caller's"


def test_tail_removes_its_file_when_the_step_is_interrupted(monkeypatch):
    monkeypatch.delenv(PROGRESS_FILE_VAR, raising=False)
    with pytest.raises(KeyboardInterrupt), ProgressTail() as tail:
        raise KeyboardInterrupt
    assert not tail.path.exists() and PROGRESS_FILE_VAR not in os.environ


@pytest.mark.parametrize("progress", [True, False])
@pytest.mark.parametrize("fails", [False, True])
def test_run_prints_the_kernel_lines_unless_quiet(progress, fails, tmp_path, monkeypatch, capsys):
    """The pipeline names the file before the step's kernel starts and prints its lines (none with --quiet)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.delenv(PROGRESS_FILE_VAR, raising=False)

    def kernel_stand_in(step: str, config: RunConfig, run_dir: Path, progress: bool, notebooks: Path) -> Path:
        subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, check=True, capture_output=True, timeout=120)
        if fails:
            raise RuntimeError("the step failed")
        dest = run_dir / "notebooks" / spec(step).notebook
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text("{}")
        return dest

    monkeypatch.setattr("workbench.pipeline.run_notebook", kernel_stand_in)
    config = RunConfig.model_validate({"steps": ["report"]})
    if fails:
        with pytest.raises(StepFailedError, match="the step failed") as failed:
            run_pipeline(config, tmp_path / "run", progress=progress)
        assert failed.value.fix.endswith(f"--resume --output-dir {tmp_path / 'run'} --steps report"), failed.value.fix
    else:
        run_pipeline(config, tmp_path / "run", progress=progress)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith(INDENT)]
    assert printed == (CHILD_LINES if progress else [])
    assert not list(scratch.iterdir()), "the progress file is removed after the step"
    assert PROGRESS_FILE_VAR not in os.environ


def test_a_bar_whose_work_ends_early_finishes_saying_where_and_a_step_says_what_it_did(progress_file, tmp_path):
    with Progress("repair int8", total=80, unit="candidates", interval=0) as bar:
        bar.update(1, note="found")
    assert bar.total == 1 and _lines(progress_file)[-1] == "repair int8: 1/1 candidates (found; done at 1 of 80)"

    record = RunRecord.create(tmp_path / "run", RunConfig())
    with record.step("deploy"):
        (tmp_path / "run" / "report.html").write_bytes(b"x" * 2_000_000)
        record.add_artifact("report", tmp_path / "run" / "report.html", kind="html")
        record.set_metric("deploy.image", "workbench/tiny:1")
    assert _lines(progress_file)[-3:] == ["deploy 0:00 started", "deploy 0:00 wrote report.html (2.0 MB)",
                                          "deploy 0:00 recorded deploy.image"]

    record.data["steps"]["deploy"]["seconds"] = 600.0  # as if it had taken ten minutes
    record.save()
    beside = RunRecord.create(tmp_path / "beside", RunConfig())
    with beside.step("deploy"):  # a run beside it, same model, settings and host: that time is the estimate
        beside.set_metric("deploy.image", "workbench/tiny:1")
    started, recorded = _lines(progress_file)[-2:]
    assert started == "deploy 0:00 started (it took 10:00 in run)"
    assert re.fullmatch(r"deploy 0:0\d recorded deploy\.image \(about 9:5\d left\)", recorded)
    beside.data["steps"]["deploy"]["seconds"] = 0.0
    with beside.step("deploy"):  # its own earlier time comes first; once past it, the line says so
        beside.set_metric("deploy.image", "workbench/tiny:1")
    assert _lines(progress_file)[-1].endswith("recorded deploy.image (past the 0:00 it took in beside)")

    other = RunRecord.create(tmp_path / "other", RunConfig.from_dict({"sequence": {"max": 64}}))
    with other.step("deploy"):  # other settings: no earlier time is theirs
        other.set_metric("deploy.image", "workbench/tiny:1")
    assert _lines(progress_file)[-2:] == ["deploy 0:00 started", "deploy 0:00 recorded deploy.image"]


def test_a_step_quiet_for_long_says_what_it_is_still_doing(tmp_path, monkeypatch, capsys):
    """A library call that prints nothing (NNCF quantizing, a model loading): the step says it is still at it."""
    monkeypatch.setattr(progress, "QUIET_S", 0.2)
    record = RunRecord.create(tmp_path, RunConfig())
    printed = ""
    with record.step("optimize"):
        record.phase("building openvino_int8 of tiny:bert: NNCF calibrates on 300 texts (the longest build)")
        deadline = time.monotonic() + 120  # a bound, not a speed: the line comes after 0.2 s of quiet
        while "still" not in printed and time.monotonic() < deadline:
            time.sleep(0.1)
            printed += capsys.readouterr().out
        with Progress("repair int8", total=80, unit="builds"):  # a build that takes long: the bar is named
            deadline = time.monotonic() + 120
            while "still on" not in printed and time.monotonic() < deadline:
                time.sleep(0.1)
                printed += capsys.readouterr().out
        # the bar closed: the phase it belonged to is over, and the heartbeat says what was done last
        deadline = time.monotonic() + 120
        while "after: repair int8" not in printed and time.monotonic() < deadline:
            time.sleep(0.1)
            printed += capsys.readouterr().out
        record.found("tritonserver ready in 3 s")
        deadline = time.monotonic() + 120
        while "after: tritonserver" not in printed and time.monotonic() < deadline:
            time.sleep(0.1)
            printed += capsys.readouterr().out
    printed += capsys.readouterr().out
    printed = printed.replace("\r", "\n")  # a text bar (notebooks) redraws itself after a carriage return
    assert re.search(r"^optimize \d+:\d\d still on repair int8, 0/80 builds$", printed, re.MULTILINE), printed
    assert re.search(r"^optimize \d+:\d\d still at work after: repair int8$", printed, re.MULTILINE), printed
    assert re.search(r"^optimize \d+:\d\d still at work after: tritonserver ready in 3 s$", printed, re.MULTILINE)
    lines = printed.splitlines()
    assert lines[0].startswith("optimize 0:00 started")
    assert lines[1].startswith("optimize ")
    assert lines[1].endswith(" building openvino_int8 of tiny:bert: NNCF calibrates on 300 texts (the longest build)")
    assert re.fullmatch(r"optimize \d+:\d\d still building openvino_int8 of tiny:bert", lines[2]), lines
    assert record.status("optimize") == "ok" and record._heartbeat is None  # the step's end stops it

"""Signals: a run stopped by SIGTERM / SIGINT leaves no process, no partial file and no `running` or stale `ok`."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from workbench.core.advice import command as workbench_command
from workbench.core.record import RunRecord, StepStatus
from workbench.pipeline import KERNEL_FOLDER_PREFIX, kernel_folder

pytestmark = pytest.mark.slow
SMALL = ["-p", "batch.opt=4", "-p", "batch.max=8", "-p", "sequence.opt=32", "-p", "sequence.max=64", "--quiet"]


def _start(model: Path, run_dir: Path, steps: str, *params: str, temp: Path | None = None) -> subprocess.Popen:
    """`workbench run` on `model`; with `temp`, its temporary files (its kernels' socket folders) go there."""
    command = [str(Path(sys.executable).parent / "workbench"), "run", "--model", str(model), "--steps", steps,
               "--output-dir", str(run_dir), *SMALL, *params]
    env = {**os.environ, "TMPDIR": str(temp)} if temp else None
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _wait_for(condition, what: str, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.2)


def _step_status(run_dir: Path, step: str) -> str | None:
    try:
        return json.loads((run_dir / "run.json").read_text())["steps"].get(step, {}).get("status")
    except (OSError, ValueError):
        return None


def _processes_of(run_dir: Path) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(str(run_dir) in part for part in process.info["cmdline"] or []):
            found.append(process)
    return found


def _stop(run: subprocess.Popen, signum: int) -> tuple[int, str]:
    """Signal the run; once it exits, every process it had started (kernel, server, stubs) must be gone too."""
    started = psutil.Process(run.pid).children(recursive=True)
    assert started, "the run has a kernel"
    run.send_signal(signum)
    try:
        output, _ = run.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        run.kill()
        raise
    _wait_for(lambda: not [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE],
              "every process the run started gone", seconds=10)
    return run.returncode, output


def _wait_for_server(run_dir: Path) -> None:
    _wait_for(lambda: any("tritonserver" in " ".join(p.info["cmdline"] or []) for p in _processes_of(run_dir)),
              "the step's tritonserver")


def test_sigterm_during_the_triton_step_stops_the_server_and_records_it(tiny_bert, tmp_path):
    run_dir = tmp_path / "run"
    run = _start(tiny_bert, run_dir, "export,optimize,triton", "-p", "precisions=[fp32]",
                 "-p", f"triton.repository_dir={tmp_path / 'repos'}")
    try:
        _wait_for_server(run_dir)
        code, output = _stop(run, signal.SIGTERM)
    finally:
        run.kill()
    assert code == 128 + signal.SIGTERM, output
    assert "interrupted (SIGTERM) during step 'triton'" in output
    _wait_for(lambda: not _processes_of(run_dir), "every server process gone", seconds=10)
    step = json.loads((run_dir / "run.json").read_text())["steps"]["triton"]
    assert step["status"] == "failed" and step["error"] == "interrupted (SIGTERM)"
    assert not list(run_dir.rglob("*partial*"))
    assert not (tmp_path / "repos").exists() or not any((tmp_path / "repos").iterdir()), "nothing published"
    assert "triton.repository" not in json.loads((run_dir / "run.json").read_text())["artifacts"]


def test_sigint_during_the_repair_leaves_no_candidate_or_partial_file(tiny_bert, tmp_path):
    run_dir = tmp_path / "run"
    # A gate no candidate meets, with a large build budget: the repair is still searching whenever the signal comes.
    run = _start(tiny_bert, run_dir, "export,optimize,parity", "-p", "precisions=[fp32,int8]",
                 "-p", "tolerances.sentence_embedding.min_cosine=1.0", "-p", "parity.repair.max_builds=400")
    try:
        _wait_for(lambda: list((run_dir / "repair" / "int8").glob("candidate-*.onnx")), "a repair candidate")
        code, output = _stop(run, signal.SIGINT)
    finally:
        run.kill()
    assert code == 128 + signal.SIGINT, output
    _wait_for(lambda: not _processes_of(run_dir), "the kernel gone", seconds=10)
    record = json.loads((run_dir / "run.json").read_text())
    assert record["steps"]["parity"] == {**record["steps"]["parity"], "status": "failed",
                                         "error": "interrupted (SIGINT)"}
    assert not list(run_dir.rglob("candidate-*")) and not list(run_dir.rglob("*partial*"))
    assert _step_status(run_dir, "export") == "ok"
    assert f"{workbench_command()} run --resume --output-dir {run_dir} --steps parity" in output, \
        "the fix is a command that runs as printed (here, where it ran), naming the steps left"


def _children(process: psutil.Process) -> list[psutil.Process]:
    """The process's descendants now; none when it has just exited (a short-lived helper named the run folder)."""
    try:
        return process.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.fixture
def temp() -> Iterator[Path]:
    """A temporary folder of the test's own, short enough for Unix socket paths: any other workbench process on the
    host clears a dead run's kernel folder from the shared one (a suite beside a fresh-clone trial lost it so)."""
    folder = Path(tempfile.mkdtemp(prefix="wb-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_sigkill_of_the_run_takes_its_kernel_server_and_stubs_along(tiny_bert, tmp_path, temp, monkeypatch):
    """Nothing can run in a SIGKILLed process: the kernel leaves when its parent is gone, and the server's watchdog
    stops the server and its stubs when the kernel is gone."""
    run_dir = tmp_path / "run"
    run = _start(tiny_bert, run_dir, "export,optimize,triton", "-p", "precisions=[fp32]",
                 "-p", f"triton.repository_dir={tmp_path / 'repos'}", temp=temp)
    try:
        _wait_for_server(run_dir)
        started = psutil.Process(run.pid).children(recursive=True)
        servers = [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]
        started += [child for server in servers for child in _children(server)]  # other sessions
        run.send_signal(signal.SIGKILL)
        run.wait()
        _wait_for(lambda: not [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE],
                  "the kernel, the server and its stubs gone", seconds=60)
    finally:
        run.kill()
    assert not _processes_of(run_dir)
    left = list(temp.glob(f"{KERNEL_FOLDER_PREFIX}{run.pid}-*"))
    assert left, "a SIGKILLed run cannot remove its kernel's socket folder itself"
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    with kernel_folder():  # the next notebook's kernel folder: a dead run's are removed first
        assert not any(folder.exists() for folder in left)


BETWEEN_STEPS = """
import os, signal, sys
from pathlib import Path
from workbench import pipeline
from workbench.core.config import RunConfig
from workbench.core.errors import RunInterruptedError
from workbench.steps import spec

def finishes_as_a_signal_comes(step, config, run_dir, progress, notebooks):
    os.kill(os.getpid(), signal.SIGINT)  # the step ends normally; the next one must not start
    dest = run_dir / "notebooks" / spec(step).notebook
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("{}")
    return dest

pipeline.run_notebook = finishes_as_a_signal_comes
try:
    pipeline.run_pipeline(RunConfig.model_validate({"steps": ["export", "report"]}), Path(sys.argv[1]), progress=False)
except RunInterruptedError as exc:
    print(exc.problem)
    print(exc.fix)
    sys.exit(128 + exc.signum)
"""


def test_a_signal_between_steps_records_the_steps_left_as_not_run(tmp_path):
    """Nothing runs after the signal, and run.json says which steps are left and why (as after a step stops)."""
    done = subprocess.run([sys.executable, "-c", BETWEEN_STEPS, str(tmp_path / "run")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 128 + signal.SIGINT, done.stderr
    assert "the run was interrupted (SIGINT) between steps, before step 'report'" in done.stdout
    assert f"--resume --output-dir {tmp_path / 'run'} --steps report" in done.stdout
    record = RunRecord.load(tmp_path / "run")
    assert record.status("report") == StepStatus.SKIPPED
    assert record.step_entry("report").detail == "not run: the run was interrupted (SIGINT) before it"

"""A hostile but fair user: copies, runs at once, full disks, killed parents, custom code, bad requests."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from workbench.core import data, disk
from workbench.core.config import DEFAULT_MODEL, RunConfig
from workbench.core.errors import DiskFullError, RunLockedError
from workbench.core.lock import LOCK_NAME, run_lock
from workbench.core.progress import PROGRESS_FILE_VAR
from workbench.core.record import RunRecord
from workbench.pipeline import NOTEBOOKS_DIR, run_pipeline

from .test_interrupt import SMALL
from .test_verdicts import _consume, _produce


def test_a_copy_with_new_file_times_is_not_stale(tmp_path):
    record = RunRecord.create(tmp_path / "run", RunConfig())
    _produce(record, "first")
    _consume(record)
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "run", copy, copy_function=shutil.copy)  # `cp -r`: same bytes, new times
    onnx = copy / "onnx" / "original.onnx"
    os.utime(onnx, ns=(onnx.stat().st_atime_ns, onnx.stat().st_mtime_ns + 10**9))
    copied = RunRecord.load(copy)
    copied.mark("parity", "skipped", "not requested")  # any change to the record re-checks every input
    assert copied.status("optimize") == "ok"
    assert RunRecord.load(copy).data["artifacts"]["onnx.original"]["mtime_ns"] == onnx.stat().st_mtime_ns

    onnx.write_text("second")  # same size, other bytes
    copied = RunRecord.load(copy)
    copied.mark("parity", "skipped", "not requested")
    assert copied.status("optimize") == "stale"
    assert "onnx.original (the file export wrote changed)" in copied.data["steps"]["optimize"]["reason"]


# ---- runs at once -----------------------------------------------------------------------------------------------
def _run(model: Path, run_dir: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    command = [str(Path(sys.executable).parent / "workbench"), "run", "--model", str(model), "--steps", "export",
               "--output-dir", str(run_dir), *SMALL, *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})


def _sockets() -> set[Path]:
    return set(NOTEBOOKS_DIR.glob("kernel-ipc*"))


@pytest.mark.slow
def test_runs_at_once_never_share_a_kernel_socket_nor_a_folder(tiny_bert, tmp_path):
    """Four runs started together: two into folders of their own pass; of two into one folder, one passes and the
    other is refused (held by the first, or, once the first finished, holding its files) and destroys nothing."""
    before = _sockets()
    runs = {name: _run(tiny_bert, tmp_path / folder)
            for name, folder in (("a", "a"), ("b", "b"), ("c1", "c"), ("c2", "c"))}
    outputs = {name: run.communicate(timeout=600)[0] for name, run in runs.items()}
    codes = {name: run.returncode for name, run in runs.items()}
    assert codes["a"] == codes["b"] == 0, outputs
    assert sorted((codes["c1"], codes["c2"])) == [0, 2], outputs
    refused = outputs["c2" if codes["c2"] else "c1"]
    assert re.search(r"error \(RunLockedError\): output directory .*/c is in use by another workbench run \(PID \d+\)|"
                     r"error \(OutputDirError\): output directory .*/c already holds files", refused), refused
    for folder in ("a", "b", "c"):
        record = RunRecord.load(tmp_path / folder)
        assert record.status("export") == "ok" and record.artifact("onnx.original").stat().st_size > 0
        assert not (tmp_path / folder / LOCK_NAME).exists()
    assert _sockets() == before, "no kernel socket in the source tree"


def _holder(run_dir: Path) -> subprocess.Popen:
    """Another process holding `run_dir` until it is killed."""
    code = ("import sys, time\nfrom pathlib import Path\nfrom workbench.core.lock import run_lock\n"
            "with run_lock(Path(sys.argv[1])):\n    print('held', flush=True)\n    time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    return holder


def test_a_held_folder_is_refused_naming_the_holder_and_a_dead_holders_lock_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    try:
        with pytest.raises(RunLockedError, match=f"{run_dir} is in use by another workbench run \\(PID {holder.pid}\\)"
                           ) as info, run_lock(run_dir):
            pass
        assert f"kill {holder.pid}" in info.value.fix
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (run_dir / LOCK_NAME).is_file(), "a SIGKILLed holder leaves its lock file"
    with run_lock(run_dir):
        assert (run_dir / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    assert not (run_dir / LOCK_NAME).exists()


# ---- a full disk ------------------------------------------------------------------------------------------------
def test_preflight_refuses_a_filesystem_without_room_for_the_run(tiny_bert, tmp_path, monkeypatch):
    config = RunConfig.model_validate({"model": DEFAULT_MODEL, "steps": ["export", "optimize", "parity"]})
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 5 * 10**6,
                                                                                        5 * 10**6))
    with pytest.raises(DiskFullError, match=r"this run \(export, optimize, parity\) needs about 5\d\d\.\d MB in "
                                            rf"{tmp_path}/run; its filesystem has 5\.0 MB free"):
        run_pipeline(config, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists(), "nothing written"


ENOSPC_AT = '''
import builtins, errno, os
_open, _at = builtins.open, os.environ["WORKBENCH_TEST_ENOSPC"]


class _Full:
    """A file on a full disk: half of the first write lands, then ENOSPC (as write(2) reports it: no file name)."""

    def __init__(self, file):
        self._file = file

    def write(self, data):
        self._file.write(data[: len(data) // 2])
        self._file.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()

    def __getattr__(self, name):
        return getattr(self._file, name)


def _full_open(file, mode="r", *args, **kwargs):
    opened = _open(file, mode, *args, **kwargs)
    return _Full(opened) if _at in str(file) and set(mode) & set("wax") else opened


builtins.open = _full_open
'''


@pytest.mark.slow
@pytest.mark.parametrize("where, writer", [("original.onnx", "the step in its kernel"),
                                           (".01_export.partial.ipynb", "the run writing the executed notebook")])
def test_a_full_disk_is_a_typed_error_and_cuts_nothing_into_place(tiny_bert, tmp_path, where, writer):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(ENOSPC_AT)
    path = os.pathsep.join(filter(None, [str(inject), os.environ.get("PYTHONPATH")]))
    run = _run(tiny_bert, tmp_path / "run", env={"PYTHONPATH": path, "WORKBENCH_TEST_ENOSPC": where})
    output = run.communicate(timeout=600)[0]
    assert run.returncode == 2, output
    full = rf"error \(DiskFullError\): no space left writing {tmp_path}/run.* \([\d,.]+ MB free on its filesystem\)"
    assert re.search(full, output), f"{writer}: {output}"
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["steps"]["export"]["status"] == "failed"
    assert not list((tmp_path / "run").rglob("*.partial*")) and not (tmp_path / "run" / "onnx" / "original.onnx"
                                                                    ).exists()
    notebook = tmp_path / "run" / "notebooks" / "01_export.ipynb"
    assert not notebook.exists() or json.loads(notebook.read_text())["cells"], "never a notebook cut short"


# ---- a corpus of any size ----------------------------------------------------------------------------------------
def test_a_large_corpus_is_streamed_into_a_bounded_sample_with_progress(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    with corpus.open("w", encoding="utf-8") as file:
        for number in range(200_000):
            file.write(f"text number {number} " + "word " * (number % 40) + "\n\n")  # blank lines are not texts
        file.write("x" * (3 * data.CORPUS_LINE_BYTES) + "\n")  # one line longer than any model reads
    lines = tmp_path / "progress.txt"
    lines.touch()  # the pipeline creates it for its kernels
    monkeypatch.setenv(PROGRESS_FILE_VAR, str(lines))
    monkeypatch.setattr(data, "PROGRESS_BYTES", 1 << 20)
    tracemalloc.start()
    sample = data.corpus_sample(corpus, 500)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert corpus.stat().st_size > 20 * 2**20 and peak < 4 * 2**20, f"{peak} bytes for a {corpus.stat().st_size} file"
    assert len(sample.texts) == 500 and sample.found == 200_001
    numbers = [int(t.split()[2]) for t in sample.texts if t.startswith("text")]
    assert numbers == sorted(numbers) and numbers[-1] > 150_000, "uniform over the file, in file order"
    assert data.corpus_sample(corpus, 500).texts == sample.texts, "the same sample every time"
    assert sample.record()["sampling"] == "500 of 200001 texts: a uniform reservoir sample (seed 0), in file order"
    shown = lines.read_text().splitlines()
    assert shown[0].startswith("reading corpus: 0/") and shown[-1].endswith(" MB") and len(shown) >= 2

    record = RunRecord.create(tmp_path / "run", RunConfig(corpus=str(corpus), corpus_max_texts=500))
    assert RunRecord.load(tmp_path / "run").data["corpus"] == {
        "path": str(corpus), "bytes": corpus.stat().st_size, "texts_found": 200_001, "texts_used": 500,
        "sampling": sample.sampling}
    assert record.data["corpus"]["texts_used"] == 500

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

from workbench import pipeline
from workbench.cli import main
from workbench.core import data, disk
from workbench.core.advice import command
from workbench.core.config import DEFAULT_MODEL, RunConfig
from workbench.core.errors import DiskFullError, OutOfMemoryError
from workbench.core.progress import PROGRESS_FILE_VAR
from workbench.core.record import RunRecord
from workbench.lock import LOCK_NAME, RunLockedError, run_lock
from workbench.pipeline import NOTEBOOKS_DIR, run_pipeline
from workbench.preflight import preflight

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
    assert "the file export wrote changed (onnx.original)" in copied.data["steps"]["optimize"]["reason"]


def test_a_graphs_weights_file_is_part_of_its_checksum(tmp_path):
    """An ONNX graph with its weights beside it (`original.onnx.data`): the pair is one artifact, so other weights
    of the same size make the steps that read it stale on --resume."""
    record = RunRecord.create(tmp_path / "run", RunConfig())
    weights = tmp_path / "run" / "onnx" / "original.onnx.data"
    weights.parent.mkdir()
    weights.write_text("weights 1")
    _produce(record, "first")
    assert RunRecord.load(tmp_path / "run").data["artifacts"]["onnx.original"]["bytes"] == len("first") + 9
    _consume(record)
    weights.write_text("weights 2")
    changed = RunRecord.load(tmp_path / "run")
    changed.mark("parity", "skipped", "not requested")
    assert changed.status("optimize") == "stale"
    assert "the file export wrote changed (onnx.original)" in changed.data["steps"]["optimize"]["reason"]


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
    code = ("import sys, time\nfrom pathlib import Path\nfrom workbench.lock import run_lock\n"
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


# ---- too little memory ------------------------------------------------------------------------------------------
CGROUPS = Path("/sys/fs/cgroup/memory")


@pytest.mark.skipif(not os.access(CGROUPS, os.W_OK), reason="needs a writable cgroup v1 memory controller (root)")
def test_a_step_killed_for_memory_is_an_out_of_memory_error_with_the_limit_and_the_fix(tmp_path):
    """The run inside a 450 MB memory cgroup: the export's kernel (torch and the model) is killed by the kernel's
    out-of-memory killer; the run says so, typed, with the limit, the peak seen and the fix, and records it."""
    group = CGROUPS / f"workbench-test-{os.getpid()}"
    group.mkdir()
    try:
        for limit in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
            if (group / limit).exists():
                (group / limit).write_text("450M")
        # preflight would refuse the model for this limit up front (test_preflight_refuses_a_model_the_memory_...):
        # left out here, so that the step runs into the limit
        cli = ("import sys, workbench.pipeline as pipeline; from workbench.cli import main; "
               "pipeline.preflight_apart = lambda *args: None; sys.exit(main(sys.argv[1:]))")
        run = subprocess.run(
            ["bash", "-c", f'echo $$ > {group}/cgroup.procs && exec "$0" -c "$1" run --steps export '
                           f'--output-dir {tmp_path / "run"} --quiet', sys.executable, cli],
            capture_output=True, text=True, timeout=600)
    finally:
        for pid in (group / "cgroup.procs").read_text().split():  # none should be left; none survives the test
            os.kill(int(pid), signal.SIGKILL)
        group.rmdir()
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr, "the kernel's own sampler, orphaned, says nothing"
    assert re.search(r"error \(OutOfMemoryError\): step 'export' was killed for memory by the out-of-memory killer: "
                     rf"its processes held up to \d+ MB \(sampled every 0.2 s\) where the memory cgroup's limit "
                     rf"\({group}/memory.limit_in_bytes\) is 450 MB", run.stderr), run.stderr
    assert "fix: give the run more memory" in run.stderr and "--resume" in run.stderr
    # export's own settings make it hold little less: no other step's settings are offered in their place
    assert "its settings change little of what it holds (the model and the libraries that run it)" in run.stderr
    assert "batch.max_tokens" not in run.stderr and "precisions" not in run.stderr
    assert "or leave it out" not in run.stderr and "go on without it" not in run.stderr  # export was the only one
    export = json.loads((tmp_path / "run" / "run.json").read_text())["steps"]["export"]
    assert export["status"] == "failed" and "killed for memory" in export["error"]
    assert not (tmp_path / "run" / "onnx").exists() or not any((tmp_path / "run" / "onnx").iterdir())


def test_preflight_refuses_a_model_the_memory_cannot_hold(tiny_bert, tmp_path, monkeypatch, capsys):
    """A memory limit below what a step holding the model peaks at (3 x its weights + 0.75 GB + its activations) is
    refused before anything runs, with the need, the limit and where it comes from; preflight.memory=warn goes on
    with a warning, and the estimate is recorded."""
    from workbench.core import memory

    monkeypatch.setattr(memory, "memory_limit", lambda: (2**29, "the memory cgroup's limit (a test's)"))
    monkeypatch.setattr(pipeline, "preflight_apart", preflight)  # in this process, where the limit is faked
    config = RunConfig.model_validate({"model": str(tiny_bert), "steps": ["export", "optimize"]})
    with pytest.raises(OutOfMemoryError, match=r"this run's export, optimize need about [89]\d\d MB at their peak "
                                                r"\(3 x the model's [\d.]+ MB of weights \+ 0.875 GB of libraries \+ "
                                                r"activations\), more than the memory cgroup's limit \(a test's\): "
                                                r"512 MB") as refused:
        run_pipeline(config, tmp_path / "run", progress=False)
    assert "-p preflight.memory=warn" in refused.value.fix
    assert not (tmp_path / "run").exists(), "nothing written"
    warned = config.model_copy(update={"steps": ["export"], "preflight": config.preflight.model_copy(
        update={"memory": "warn"})})
    record = run_pipeline(warned, tmp_path / "warned", progress=False)
    assert record.status("export") == "ok"
    assert "warning: export needs about " in capsys.readouterr().err
    estimate = record.data["preflight"]["memory"]
    assert estimate["verdict"] == "warned" and estimate["limit_mb"] == 512 and 850 < estimate["need_mb"] < 950
    monkeypatch.setattr(memory, "memory_limit", lambda: (2**30, "the memory cgroup's limit (a test's)"))
    fits = run_pipeline(config.model_copy(update={"steps": ["export"]}), tmp_path / "fits", progress=False)
    assert fits.data["preflight"]["memory"]["verdict"] == "fits"
    # the generation step holds its own models, Triton, HF and CTranslate2: it alone is named over a 1000 MB limit
    monkeypatch.setattr(memory, "memory_limit", lambda: (1000 * 2**20, "the memory cgroup's limit (a test's)"))
    with pytest.raises(OutOfMemoryError, match=r"this run's generation needs about 1536 MB at its peak \(Triton "
                                                r"serving its models, HF and CTranslate2: 1.5 GB\), more than") as over:
        preflight(config.model_copy(update={"steps": ["export", "generation"]}))
    assert "export" not in over.value.problem and "run the others alone (--steps export)" in over.value.fix
    # a step that fits but reads what a refused one writes is not offered alone (deploy reads triton)
    monkeypatch.setattr(memory, "memory_limit", lambda: (700 * 2**20, "the memory cgroup's limit (a test's)"))
    with pytest.raises(OutOfMemoryError) as reads:
        preflight(config.model_copy(update={"steps": ["export", "optimize", "triton", "deploy", "report"]}))
    assert "deploy" not in reads.value.fix and "run the others alone (--steps report)" in reads.value.fix


# ---- a full disk ------------------------------------------------------------------------------------------------
def test_preflight_refuses_a_filesystem_without_room_for_the_run(tiny_bert, tmp_path, monkeypatch):
    config = RunConfig.model_validate({"model": DEFAULT_MODEL, "steps": ["export", "optimize", "parity"]})
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 5 * 10**6,
                                                                                        5 * 10**6))
    monkeypatch.setattr(pipeline, "preflight_apart", preflight)  # in this process, where the disk is faked
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


# ---- issue 41: typed errors at every edge --------------------------------------------------------------------
@pytest.mark.parametrize(("field", "value", "said"), [
    ("hidden_size", "384", "Field 'hidden_size' expected int, got str \\(value: '384'\\)"),
    ("num_hidden_layers", "six", "Field 'num_hidden_layers' expected int, got str"),
    ("vocab_size", None, "Field 'vocab_size' expected int, got NoneType"),
    ("max_position_embeddings", -5, "max_position_embeddings is -5, and a size must be a positive integer"),
])
def test_a_config_json_with_wrong_types_is_refused_before_the_run_starts(tiny_bert, tmp_path, capsys, field, value,
                                                                           said):
    model = tmp_path / "model"
    shutil.copytree(tiny_bert, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, field: value}))
    assert main(["run", "--model", str(model), "--steps", "export", "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"error \(ModelLoadError\): {model}/config.json is invalid: .*{said}", err), err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize(("registry", "said"), [
    ("my registry:5000", "'my registry:5000' holds whitespace"),
    ("Registry.Example.com/MyTeam", "'Registry.Example.com/MyTeam' has uppercase letters .*did you mean "
                                    "'registry.example.com/myteam'"),
])
def test_an_image_registry_docker_refuses_is_refused(capsys, registry, said):
    assert main(["config", "-p", f"deploy.image_registry={registry}"]) == 2
    assert re.search(rf"error \(ConfigError\): .*deploy.image_registry: {said}", capsys.readouterr().err)
    assert RunConfig.model_validate({"deploy": {"image_registry": "registry.example.com:5000/ml/"}}
                                    ).deploy.image_registry == "registry.example.com:5000/ml"


def _parity_only(run_dir: Path) -> RunRecord:
    """A run with a passing fp32 verdict and no bench."""
    from .test_report import _verdict

    record = RunRecord.create(run_dir, RunConfig())
    with record.step("parity"):
        record.set_metric("parity.variants.fp32", _verdict("fp32", 0.99999, 0.9999))
    return record


def test_compare_output_that_is_a_file_or_read_only_is_refused(tmp_path, monkeypatch, capsys):
    _parity_only(tmp_path / "run")
    (tmp_path / "taken").write_text("mine")
    assert main(["compare", str(tmp_path / "run"), "--output", str(tmp_path / "taken")]) == 2
    assert f"error (OutputDirError): {tmp_path}/taken (--output) is a file, not a folder" in capsys.readouterr().err
    assert (tmp_path / "taken").read_text() == "mine"

    (tmp_path / "locked").mkdir()
    write = Path.write_text

    def read_only(path: Path, *args: object, **kwargs: object) -> int:  # as root, chmod would not stop a write
        if path.parent == tmp_path / "locked":
            raise PermissionError(13, "Permission denied", str(path))
        return write(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", read_only)
    assert main(["compare", str(tmp_path / "run"), "--output", str(tmp_path / "locked")]) == 2
    err = capsys.readouterr().err
    assert f"error (OutputDirError): cannot write to {tmp_path}/locked (--output): Permission denied" in err
    assert "Traceback" not in err and not list((tmp_path / "locked").iterdir())


def test_same_named_runs_are_told_apart_and_a_run_without_bench_is_named_with_what_to_run(tmp_path):
    from workbench.report.compare import compare, find_runs

    from .test_report import PASSING, _benched

    for sweep in ("a", "b"):
        _benched(tmp_path / sweep / "full", PASSING)
    (group,) = compare(find_runs([tmp_path / "a" / "full", tmp_path / "b" / "full"])).groups
    assert {row.run for row in group.rows} == {"a/full", "b/full"}
    latency = next(pick for pick in group.picks if pick.goal == "latency")
    assert (latency.run, latency.variant) == ("a/full", "int8_repaired"), "the first of two equal runs"

    _parity_only(tmp_path / "c" / "full")
    (group,) = compare(find_runs([tmp_path / "a" / "full", tmp_path / "c" / "full"])).groups
    assert group.unmeasured == ["c/full"] and group.latency_cell == "b1_s16"
    assert {pick.run for pick in group.picks if pick.variant} == {"a/full"}, "picked among the runs with a bench"
    (alone,) = compare(find_runs([tmp_path / "c" / "full"])).groups
    assert {pick.variant for pick in alone.picks} == {None}
    assert alone.picks[0].reason == (f"no bench in full: run `{command()} run --resume --output-dir {tmp_path}/c/full "
                                     "--steps bench` (each run alike), then compare again")


def test_resuming_with_another_corpus_records_the_corpus_it_runs_on(tmp_path):
    record = RunRecord.create(tmp_path / "run", RunConfig())
    with record.step("export"):
        pass
    corpus = tmp_path / "big.txt"
    corpus.write_text("".join(f"text number {i}\n" for i in range(1000)))
    resumed = RunRecord.open(tmp_path / "run", RunConfig(corpus=str(corpus), corpus_max_texts=300), must_exist=True)
    assert resumed.data["corpus"] == RunRecord.load(tmp_path / "run").data["corpus"]
    assert (resumed.data["corpus"]["path"], resumed.data["corpus"]["texts_found"],
            resumed.data["corpus"]["texts_used"]) == (str(corpus), 1000, 300)


def test_a_request_over_its_limits_is_refused_naming_the_setting():
    import numpy as np

    from workbench.serving.backend.text_input import Limits, decode

    limits = Limits.of({"max_texts": "3", "max_text_chars": "10"})
    texts = np.array([b"short", "caf\u00e9 " * 2], dtype=object)
    assert decode(texts, limits=limits) == ["short", "caf\u00e9 caf\u00e9 "], "characters, not bytes"
    with pytest.raises(ValueError, match="4 texts in TEXT; this deployment takes at most 3 in one request "
                                         "\\(triton.max_texts\\): send them in smaller requests"):
        decode(np.array([b"a"] * 4, dtype=object), limits=limits)
    with pytest.raises(ValueError, match="TEXT\\[1\\] has 11 characters; this deployment takes at most 10 in one "
                                         "text \\(triton.max_text_chars\\)"):
        decode(np.array([b"a", b"x" * 11], dtype=object), limits=limits)
    assert decode(np.array([b"x" * 10**6], dtype=object)) == ["x" * 10**6], "no limits: none enforced"


@pytest.mark.slow
def test_a_second_sweep_leaves_a_held_run_to_its_holder_and_comes_back_to_it(tiny_bert, tmp_path, monkeypatch,
                                                                            capsys):
    from workbench import sweep as sweeps

    path = tmp_path / "sweep.yaml"
    path.write_text(json.dumps({"output_root": "runs", "settings": {"steps": ["export"], "corpus_max_texts": 16},
                                "runs": [{"name": "a", "model": str(tiny_bert)},
                                         {"name": "b", "model": str(tiny_bert)}]}))
    holder = _holder(tmp_path / "runs" / "a")  # the first sweep, running `a`
    monkeypatch.setattr(sweeps, "_pause", lambda: (holder.kill(), holder.wait()))  # ... which then finishes it
    try:
        assert sweeps.run_sweep(sweeps.load_sweep(path)) == 0
    finally:
        holder.kill()
        holder.wait()
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(rf"\[1/2\] a: output directory {tmp_path}/runs/a is in use by another workbench run "
                        rf"\(PID {holder.pid}\); coming back to it", lines[1]), lines
    assert lines[2].startswith("[2/2] b: running export") and lines[3].startswith("[2/2] b: finished")
    assert lines[4].startswith("[1/2] a: running export") and lines[5].startswith("[1/2] a: finished"), lines
    assert all(RunRecord.load(tmp_path / "runs" / run).status("export") == "ok" for run in ("a", "b"))


def test_a_kubernetes_job_of_local_models_warns_and_a_foreign_file_is_kept(tiny_bert, tmp_path, capsys):
    path = tmp_path / "sweep.yaml"
    path.write_text(json.dumps({"output_root": "runs", "kubernetes": {"image": "localhost:5000/wb:1", "claim": "c"},
                                "runs": [{"name": "hub", "model": DEFAULT_MODEL},
                                         {"name": "local", "model": str(tiny_bert)}]}))
    assert main(["sweep", str(path), "--kubernetes", str(tmp_path / "job.yaml")]) == 0
    err = capsys.readouterr().err
    assert f"warning: 1 model(s) are paths on this machine, which the pods see only where the image or the claim " \
           f"holds them at that path (local: {tiny_bert})" in err
    assert main(["sweep", str(path), "--kubernetes", str(tmp_path / "job.yaml")]) == 0, "ours: written again"
    (tmp_path / "mine.yaml").write_text("kind: Secret\n")
    assert main(["sweep", str(path), "--kubernetes", str(tmp_path / "mine.yaml")]) == 2
    assert "is not a manifest `workbench sweep --kubernetes` wrote" in capsys.readouterr().err
    assert (tmp_path / "mine.yaml").read_text() == "kind: Secret\n"


def test_deploy_sizing_says_whether_a_served_bench_ran():
    from workbench.measure.capacity import plan_capacity
    from workbench.measure.settings import BenchSettings
    from workbench.measure.tables import ServedBenchmark
    from workbench.serving.settings import DeploySettings

    never = plan_capacity(DeploySettings(), BenchSettings(), None, "m", 0, "here", "no served bench: bench step "
                                                                                 "not run")
    assert never.replicas_reason == ("not measured (no served bench: bench step not run): one replica to start, "
                                     "whatever deploy.target_rps asks")
    slow = ServedBenchmark.model_validate({"batching_on": {"text": {"1": {
        "concurrency": 1, "requests": 10, "seconds": 2.0, "throughput": 5.0, "p50": 800.0, "p90": 880.0, "p95": 890.0,
        "p99": 900.0, "mean": 810.0}}}})
    assert plan_capacity(DeploySettings(), BenchSettings(), slow, "m", 0, "here").replicas_reason.startswith(
        "not measured (no served bench level kept p99 under 500 ms)")


def test_a_symlink_loop_or_a_dangling_link_is_named_as_such(tmp_path):
    from workbench.models.errors import ModelNotFoundError
    from workbench.models.loading import resolve_source

    (tmp_path / "one").symlink_to(tmp_path / "two")
    (tmp_path / "two").symlink_to(tmp_path / "one")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for path in (tmp_path / "one", tmp_path / "one" / "model"):
        with pytest.raises(ModelNotFoundError, match=f"model path {path} goes through symbolic links that loop"):
            resolve_source(str(path))
    with pytest.raises(ModelNotFoundError, match=f"is a symbolic link to {tmp_path}/nowhere, which does not exist"):
        resolve_source(str(tmp_path / "dangling"))


def test_a_disk_too_full_to_record_the_failed_step_says_so_on_stderr(tmp_path, monkeypatch, capsys):
    import errno

    from workbench.core import record as records

    full = []

    def step_fills_the_disk(step: str, *args: object) -> None:
        full.append(step)
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "onnx" / "original.onnx"))

    save = records.write_json

    def record_on_a_full_disk(*args: object) -> Path:
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(*args)

    monkeypatch.setattr(pipeline, "run_notebook", step_fills_the_disk)
    monkeypatch.setattr(pipeline, "preflight_apart", lambda *args: None)
    monkeypatch.setattr(records, "write_json", record_on_a_full_disk)
    with pytest.raises(DiskFullError, match=f"no space left writing {tmp_path}/run/onnx/original.onnx"):
        run_pipeline(RunConfig(steps=["export", "optimize"]), tmp_path / "run", progress=False)
    err = capsys.readouterr().err
    assert f"warning: {tmp_path}/run/run.json could not record that step 'export' stopped (OSError: " in err
    assert "it still holds the step as it was before. Free space, then re-run the steps" in err


def test_serve_run_uses_the_published_repository_when_the_runs_copy_is_gone(tmp_path):
    from workbench.core.errors import MissingArtifactError
    from workbench.serve import run_repository
    from workbench.serving.repository import write_models

    record = RunRecord.create(tmp_path / "run", RunConfig())
    about = {"name": "m", "run": str((tmp_path / "run").resolve())}
    run_copy = write_models({}, tmp_path / "run" / "model_repository" / "m", about=about)
    published = write_models({}, tmp_path / "repos" / "m", about=about)
    with record.step("triton"):
        record.add_artifact("triton.repository", run_copy, kind="triton-repository")
        record.set_metric("triton", {"repository": str(published), "published": True})
    shutil.rmtree(run_copy)
    assert run_repository(tmp_path / "run") == published
    write_models({}, published, about={**about, "run": "/elsewhere/another-run"})
    with pytest.raises(MissingArtifactError, match=f"the run's copy of its repository is gone and {published} no "
                                                   "longer holds what the run checked"):
        run_repository(tmp_path / "run")


def test_sentence_transformers_the_parity_reference_is_pinned():
    from importlib.metadata import version

    from workbench.models.pins import pin

    assert pin("sentence-transformers") == f"sentence-transformers=={version('sentence-transformers')}"


@pytest.mark.parametrize("family", ["minilm", "roberta"])
def test_a_long_text_is_tokenized_from_the_part_the_model_reads_with_the_same_tokens(family, tiny_models, tmp_path):
    """A text far past the model's limit costs no more to tokenize than the part kept: the served tokenizer cuts it
    to a prefix giving the same tokens (WordPiece and byte-level BPE), and leaves whole what it cannot cut safely."""
    from workbench.core.config import DEFAULT_MODEL
    from workbench.core.data import load_corpus
    from workbench.models.loading import resolve_source
    from workbench.serving.backend.text_input import CHARS_PER_TOKEN, TextEncoder
    from workbench.serving.repository import encoder_json

    folder = Path(resolve_source(DEFAULT_MODEL).location) if family == "minilm" else tiny_models[family]
    (tmp_path / "encoder.json").write_bytes(encoder_json(folder, 128))
    encoder = TextEncoder(tmp_path, 128, ["input_ids", "attention_mask"])
    corpus = " ".join(load_corpus())
    long = (corpus + "\n  ") * (100_000 // len(corpus) + 1)
    texts = [long, "a" * 20_000, "\u4e2d\u6587" * 5_000, "short text", " " * 3 + "spaced   out  " * 2_000,
             (long, corpus[:300]), (corpus[:200], long)]
    for text in texts:
        kept = encoder.kept(text)
        whole, cut = encoder.backend.encode_batch([text, kept])
        assert (cut.ids, cut.type_ids, bool(cut.overflowing)) == (whole.ids, whole.type_ids,
                                                                   bool(whole.overflowing)), repr(text)[:60]
    assert len(encoder.kept(long)) <= 128 * CHARS_PER_TOKEN * 2 < len(long) // 40, "the long text is cut"
    assert encoder.kept("a" * 20_000) == "a" * 20_000, "one unbroken word: left whole"
    assert [len(side) for side in encoder.kept((long, long))] == [len(encoder.kept(long))] * 2

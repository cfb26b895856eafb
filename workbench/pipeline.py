"""Run the step notebooks in order through papermill; run.json tells what finished."""
from __future__ import annotations

import inspect
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

import psutil

from workbench.core.advice import run_again
from workbench.core.config import RunConfig, outputs_root
from workbench.core.disk import FIX, as_disk_full, disk_full_typed
from workbench.core.errors import DiskFullError, OutOfMemoryError, OutputDirError, StepFailedError
from workbench.core.memory import SAMPLE_S, PeakMemory, memory_limit, oom_kills
from workbench.core.progress import INDENT, PROGRESS_FILE_VAR, tqdm_class
from workbench.core.record import (
    RECORD_NAME,
    RunRecord,
    StepStatus,
    described,
    remove_inside,
    settings_changes,
)
from workbench.interrupt import InterruptGuard, remove_partials
from workbench.lock import LOCK_NAME, run_lock
from workbench.preflight import preflight_apart
from workbench.report.notebook import NOTEBOOKS_DIR, as_options, parameters_cell
from workbench.steps import spec, specs

COMMAND = "workbench run"  # who set a run's settings, in its settings_log
NOT_RUN = "not run: "  # the reason of a step skipped because an earlier one failed (it still has to run)
# How long a finished cell's last output may take to arrive (nbclient's default, 4 s, failed a large model's optimize
# step that had finished: its kernel was slow to report while the host was busy and memory was being returned).
IOPUB_TIMEOUT_S = 120
POLL_S = 0.2  # how often the pipeline looks for new progress lines


class ProgressTail:
    """While active: a new temporary file named in WORKBENCH_PROGRESS_FILE (processes started meanwhile inherit
    it) and a thread printing each line written to it, indented, above any bar of this process; on exit the last
    lines are printed, the file is removed (also on an error or interrupt) and the variable is restored."""

    def __init__(self, out: TextIO | None = None, poll: float = POLL_S) -> None:
        self.out, self.poll = out, poll
        self.path = Path()
        self._offset = 0
        self._previous: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="progress-tail", daemon=True)
        self._bars: Any = None

    def __enter__(self) -> ProgressTail:
        self._bars = tqdm_class()  # imported here: its warning filter is not for a second thread to change
        handle, name = tempfile.mkstemp(prefix="workbench-progress-", suffix=".txt")
        os.close(handle)
        self.path = Path(name)
        self._previous = os.environ.get(PROGRESS_FILE_VAR)
        os.environ[PROGRESS_FILE_VAR] = name
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._stop.set()
            self._thread.join()
            self._print_new()
        finally:
            self.path.unlink(missing_ok=True)
            if self._previous is None:
                os.environ.pop(PROGRESS_FILE_VAR, None)
            else:
                os.environ[PROGRESS_FILE_VAR] = self._previous

    def _follow(self) -> None:
        while not self._stop.wait(self.poll):
            self._print_new()

    def _print_new(self) -> None:
        """Print the complete lines written since the last look (a line still being written waits)."""
        with open(self.path, "rb") as handle:
            handle.seek(self._offset)
            chunk = handle.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            self._bars.write(f"{INDENT}{line}", file=self.out)  # above papermill's bar; None: the current sys.stdout


def default_run_dir(config: RunConfig) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return outputs_root() / f"{stamp}-{config.model_slug}"


def prepare_run_dir(run_dir: Path, overwrite: bool) -> Path:
    """Refuse to write into a folder that already holds files unless `overwrite` says so; then remove what the
    earlier run wrote (the files its run.json lists and the folders the workbench owns) and nothing else."""
    if run_dir.exists() and not run_dir.is_dir():
        raise OutputDirError(f"output path {run_dir} is a file", "pass a folder path with --output-dir")
    if run_dir.is_dir() and any(p.name != LOCK_NAME for p in run_dir.iterdir()):
        if not overwrite:
            raise OutputDirError(
                f"output directory {run_dir} already holds files",
                "choose a new --output-dir, or pass --overwrite to replace that run's results",
            )
        remove_earlier_run(run_dir)
    return run_dir


def remove_earlier_run(run_dir: Path) -> None:
    """Delete the earlier run's listed artifacts, the workbench's folders and run.json; other files stay."""
    listed: list[Path] = []
    if (run_dir / RECORD_NAME).is_file():
        try:
            listed = RunRecord.load(run_dir).artifact_paths()
        except OutputDirError:
            pass  # an unreadable record: its folders still go
    owned = ("notebooks", *(folder for step in specs() for folder in step.owns))  # and each step's own folders
    for path in [*listed, *(run_dir / name for name in owned), run_dir / RECORD_NAME]:
        remove_inside(run_dir, path)
    remove_partials(run_dir)


KERNEL_FOLDER_PREFIX = "workbench-kernel-"


@contextmanager
def kernel_folder() -> Iterator[str]:
    """A private temporary folder for one kernel's sockets, named with this process's PID; folders a killed run
    left (their PID gone) are removed first."""
    root = Path(tempfile.gettempdir())
    for left in root.glob(f"{KERNEL_FOLDER_PREFIX}*-*"):
        owner = left.name[len(KERNEL_FOLDER_PREFIX):].split("-")[0]
        if owner.isdigit() and not psutil.pid_exists(int(owner)):
            shutil.rmtree(left, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=f"{KERNEL_FOLDER_PREFIX}{os.getpid()}-") as private:
        yield private


def _kernel_manager_class(private: Path) -> type:
    """Kernels reached over Unix sockets rather than unencrypted localhost TCP, their sockets and connection file in
    `private` (a folder of this run's own: runs at once never share a socket name, the source tree gets none), and
    shut down without the SIGINT jupyter_client sends first (a kernel busy with a last message logs it as an ERROR;
    a user's Ctrl-C reaches the kernel through InterruptGuard, not through this)."""
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import default

    class IpcKernelManager(AsyncKernelManager):
        @default("transport")
        def _ipc(self) -> str:
            return "ipc"

        @default("ip")
        def _sockets(self) -> str:
            return str(private / "kernel-ipc")

        @default("connection_file")
        def _connection(self) -> str:
            return str(private / "kernel.json")

        async def _async_interrupt_kernel(self) -> None:
            if not self.shutting_down:
                await super()._async_interrupt_kernel()

    return IpcKernelManager


def notebook_source(step: str, notebooks_dir: Path) -> Path:
    """Step `step`'s notebook: beside its module when it is there (a step kept outside the package brings its own),
    else in `notebooks_dir`."""
    declared = spec(step)
    beside = Path(inspect.getfile(declared.run)).parent / declared.notebook
    return beside if beside.is_file() else notebooks_dir / declared.notebook


def run_notebook(step: str, config: RunConfig, run_dir: Path, progress: bool = True,
                 notebooks_dir: Path = NOTEBOOKS_DIR) -> Path:
    """Execute one step notebook into `run_dir/notebooks/`; the copy lands even when it fails."""
    import papermill

    source = notebook_source(step, notebooks_dir)
    if not source.is_file():
        raise OutputDirError(f"notebook {source} is missing", "run from a full checkout of the workbench, or put a "
                             "step's notebook beside its module")
    dest = run_dir / "notebooks" / source.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(f".{dest.stem}.partial.ipynb")
    try:
        with kernel_folder() as private:
            papermill.execute_notebook(
                str(pristine(source, Path(private))), str(partial),
                parameters={"config": config.to_params(), "run_dir": str(run_dir.resolve())},
                kernel_name="python3", progress_bar=progress, cwd=str(notebooks_dir),
                kernel_manager_class=_kernel_manager_class(Path(private)), iopub_timeout=IOPUB_TIMEOUT_S,
            )
    finally:
        _land(partial, dest)
    return dest


def pristine(source: Path, folder: Path) -> Path:
    """A copy of step notebook `source` in `folder` with the generated parameters cell and no outputs: values a user
    saved in the notebook's parameters never reach a run the command configures."""
    import nbformat

    notebook = nbformat.read(source, as_version=4)
    for cell in notebook.cells:
        if "parameters" in cell.metadata.get("tags", []):
            edited = [line for line in cell.source.splitlines() if line not in parameters_cell().splitlines()]
            if edited:
                options = " ".join(as_options(edited)) or "-p sequence.max=128"
                print(f"warning: {source.name}'s saved parameters are not used ({'; '.join(edited)}): workbench "
                      f"run runs the run's settings; pass yours with -p ({options})", file=sys.stderr)
            cell.source = parameters_cell()
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    copy = folder / source.name
    nbformat.write(notebook, copy)
    return copy


def _land(partial: Path, dest: Path) -> None:
    """Move the executed copy into place when it is a whole notebook; one cut short (a full disk) is removed and
    never replaces a complete one."""
    if not partial.exists():
        return
    try:
        json.loads(partial.read_bytes())
    except ValueError:
        partial.unlink()
        return
    os.replace(partial, dest)


def run_pipeline(config: RunConfig, run_dir: Path | None = None, overwrite: bool = False,
                 progress: bool = True, resume: bool = False, notebooks_dir: Path = NOTEBOOKS_DIR) -> RunRecord:
    """Run `config.steps` in pipeline order (the step notebooks in `notebooks_dir`); stop at the first failed step
    and mark the rest skipped.

    `resume` continues a run folder that already has a run.json (same model and export settings), keeping what
    earlier steps produced, e.g. to build TensorRT engines on a GPU host after a CPU run.
    """
    run_dir = Path(run_dir or config.output_dir or default_run_dir(config))
    config = config.model_copy(update={"output_dir": str(run_dir)})
    if run_dir.exists() and not run_dir.is_dir():
        raise OutputDirError(f"output path {run_dir} is a file", "pass a folder path with --output-dir")
    with run_lock(run_dir), disk_full_typed(run_dir):  # one run per folder; any number into different folders
        return _run_steps(config, run_dir, overwrite, progress, resume, notebooks_dir)


def _run_steps(config: RunConfig, run_dir: Path, overwrite: bool, progress: bool, resume: bool,
               notebooks_dir: Path) -> RunRecord:
    resumed = RunRecord.load(run_dir) if resume and (run_dir / RECORD_NAME).is_file() else None
    memory = preflight_apart(config, resumed)
    if memory is not None and memory.verdict == "warned":
        print(f"warning: {memory.describe()}; going on as preflight.memory=warn asks (a step that runs out stops "
              "with OutOfMemoryError)", file=sys.stderr, flush=True)
    if resume:
        record = RunRecord.open(run_dir, config, must_exist=True, by=COMMAND)
        record.refresh_environment()  # the resumed steps may run on another machine
        remove_partials(run_dir)  # what a killed process half-wrote (this process holds the run's lock)
        print(resume_note(record, config.steps), flush=True)  # under --quiet too: what a resume redoes
    else:
        record = RunRecord.create(prepare_run_dir(run_dir, overwrite), config, by=COMMAND)
    if memory is not None:
        record.note_memory_estimate(asdict(memory))
    steps = [s.name for s in specs() if s.name in config.steps]
    with InterruptGuard() as guard:
        for index, step in enumerate(steps):
            rest = run_again(steps[index:], run_dir, lab=False)
            again = f"re-run the steps that did not finish, keeping the others: {rest}"
            if guard.reason:  # stopped between steps: those left are recorded as not run, as after a step stops
                _mark_not_run(steps[index:], run_dir, f"{NOT_RUN}the run was {guard.reason} before it")
            guard.check(f"between steps, before step {step!r}", again)
            if progress:
                print(f"[{index + 1}/{len(steps)}] {step}: {spec(step).summary}", flush=True)
            kills, peak = oom_kills(), PeakMemory()  # the step's whole tree, its kernel's death included
            try:
                with ProgressTail() if progress else nullcontext(), peak:
                    run_notebook(step, config, run_dir, progress, notebooks_dir)
            except Exception as exc:
                killed = _out_of_memory(config, step, exc, (kills, peak.mb), again, steps[index + 1:], index > 0)
                _record_stop(step, steps[index + 1:], run_dir, guard.reason or (killed.problem if killed else
                                                                                _describe(exc)), again)
                guard.check(f"during step {step!r}", again)
                full = _disk_full(exc, run_dir)
                if full is not None:
                    raise full from None
                if killed is not None:
                    raise killed from None
                raise StepFailedError(f"step {step!r} failed: {_describe(exc)}",
                                      f"read {run_dir / 'notebooks' / spec(step).notebook} and "
                                      f"{run_dir / RECORD_NAME}; once the cause is mended, {again}") from None
            record = RunRecord.load(run_dir)
            record.add_artifact(f"notebook.{step}", run_dir / "notebooks" / spec(step).notebook, kind="notebook")
            ran = settings_changes(config.to_params(), record.settings)
            if ran:
                raise StepFailedError(f"step {step!r} ran other settings than the command gave: {described(ran)}",
                                      f"the notebook {notebook_source(step, notebooks_dir)} sets them: take its "
                                      "change out, or pass it with -p")
    return record


def resume_note(record: RunRecord, steps: list[str]) -> str:
    """What `--resume` goes on with, said before any step runs: the settings changed since the run last ran (as
    `RunRecord.open` found them), the steps that made stale (those this run redoes, and those it leaves stale), and
    the steps it runs."""
    changed = record.reopened_with
    stale = [s.name for s in specs() if record.status(s.name) == StepStatus.STALE]
    left = [name for name in stale if name not in steps]
    lines = [f"resuming {record.run_dir}: " + (f"settings changed since it last ran: {described(changed)}"
                                               if changed else "no setting changed since it last ran")]
    if stale:
        stays = "it stays" if len(left) == 1 else "they stay"
        lines.append(f"  stale now: {', '.join(stale)}" + (f" ({', '.join(left)} not in this run: {stays} stale; "
                                                            f"{run_again(left, record.run_dir, lab=False)})"
                                                            if left else ""))
    lines.append(f"  runs: {', '.join(steps)}")
    return "\n".join(lines)


def _out_of_memory(config: RunConfig, step: str, exc: Exception, seen: tuple[int, float], again: str,
                   later: list[str], after_others: bool) -> OutOfMemoryError | None:
    """The step's kernel died and the out-of-memory killer killed a process meanwhile (its count passed `seen`'s
    kills): typed, with the most the step's processes were seen to hold (`seen`'s MB), the limit, the settings that
    make this step need less, and how to go on without it (the `later` steps; `after_others`: steps ran before it)."""
    from nbclient.exceptions import DeadKernelError

    kills, peak_mb = seen
    if not isinstance(exc, DeadKernelError) or oom_kills() <= kills:
        return None
    limit, source = memory_limit()
    lighter = spec(step).lighter
    less = (f"or make the step need less: {lighter}" if lighter else
            "its settings change little of what it holds (the model and the libraries that run it)")
    without = (f"; or go on without it: {run_again(later, config.output_dir, lab=False)}" if later else
               "; or leave it out: the steps before it are recorded as they ended" if after_others else "")
    return OutOfMemoryError(
        f"step {step!r} was killed for memory by the out-of-memory killer: its processes held up to {peak_mb:.0f} "
        f"MB (sampled every {SAMPLE_S:g} s) where {source} is {limit / 2**20:.0f} MB",
        f"give the run more memory (another host, or a higher cgroup limit), {less}; "
        f"then {again}{without}")


def _disk_full(exc: Exception, run_dir: Path) -> DiskFullError | None:
    """A full disk found by the step's kernel or by this process writing the executed notebook, typed."""
    if getattr(exc, "ename", None) == DiskFullError.__name__:
        return DiskFullError(getattr(exc, "evalue", "").split("\n  fix: ")[0], FIX)
    return as_disk_full(exc, run_dir / "notebooks")


def _describe(exc: Exception) -> str:
    from papermill.exceptions import PapermillExecutionError

    return f"{exc.ename}: {exc.evalue}" if isinstance(exc, PapermillExecutionError) else f"{type(exc).__name__}: {exc}"


def _record_stop(step: str, later: list[str], run_dir: Path, reason: str, again: str) -> None:
    """`_stop_at`; on a disk too full to save run.json, say on stderr what it could not record, and the fix."""
    try:
        _stop_at(step, later, run_dir, reason)
    except OSError as exc:
        full = as_disk_full(exc, run_dir / RECORD_NAME)
        if full is None:
            raise
        print(f"warning: {run_dir / RECORD_NAME} could not record that step {step!r} stopped ({reason}): "
              f"{full.problem}; it still holds the step as it was before. Free space, then {again}",
              file=sys.stderr, flush=True)


def _stop_at(step: str, later: list[str], run_dir: Path, reason: str) -> None:
    """Record `step` failed with `reason` (unless it recorded its own error and was not interrupted), the steps
    after it skipped, and remove what was half-written."""
    remove_partials(run_dir)
    record = RunRecord.load(run_dir)
    if record.status(step) != StepStatus.FAILED or reason.startswith("interrupted"):
        record.mark(step, StepStatus.FAILED, reason)
    ended = "was interrupted" if reason.startswith("interrupted") else "failed"
    _mark_not_run(later, run_dir, f"{NOT_RUN}step {step!r} {ended}", record)
    notebook = run_dir / "notebooks" / spec(step).notebook
    if notebook.is_file():
        record.add_artifact(f"notebook.{step}", notebook, kind="notebook")


def _mark_not_run(steps: list[str], run_dir: Path, reason: str, record: RunRecord | None = None) -> None:
    """Record `steps` skipped with `reason`: they still have to run."""
    record = record or RunRecord.load(run_dir)
    for name in steps:
        record.mark(name, StepStatus.SKIPPED, reason)

"""run.json: the single machine-readable record of a run (config, environment, steps, artifacts, metrics)."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
import traceback
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from workbench.core import dotted as dotted_keys
from workbench.core import registry
from workbench.core.advice import run_again
from workbench.core.atomic import sha256_file, write_json
from workbench.core.config import RunConfig, quietly_moved
from workbench.core.data import corpus_sample, lowercase_inputs
from workbench.core.disk import as_disk_full, disk_full_typed
from workbench.core.dotted import Tree, Value
from workbench.core.errors import ConfigError, MissingArtifactError, OutputDirError, StepSkipped
from workbench.core.estimate import Earlier, clock, earlier
from workbench.core.memory import PeakMemory
from workbench.core.metrics import Json, Metrics
from workbench.core.progress import Heartbeat, closed_bars, open_bar, say
from workbench.core.results import SCHEMA_VERSION, HostEnvironment, Verdict, migrate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase as Tokenizer

RECORD_NAME = "run.json"
M = TypeVar("M", bound=Metrics)
_RUN_DEFINING = ("model", "task", "pooling", "pooling_override", "token_embeddings", "exporter", "opset",
                 "attn_implementation")


_NOT_SETTINGS = ("steps", "output_dir", "preflight")  # which steps run, where, what is checked first: not how
_OTHER_SETTINGS = "it ran with other settings"  # how a stale step's reason starts when only its settings differ


def step_settings(params: Tree, step: str) -> Tree:
    """The settings step `step` runs with: the run-wide ones (but those first read by a later step) and its own
    section, not other steps' sections."""
    order = registry.step_names()
    later = order[order.index(step) + 1:] if step in order else ()
    others = {s.name for s in registry.facts() if s.settings and s.name != step} \
        | {key for s in registry.facts() if s.name in later for key in s.first_reads}
    return {key: value for key, value in params.items() if key not in others and key not in _NOT_SETTINGS}


def spelled_now(settings: Tree) -> Tree:
    """Settings as a run recorded them, as this version spells them: a moved key at its new place, a setting that
    run did not know at its default (as it ran then); as recorded where they no longer load."""
    try:
        return RunConfig.load(base=settings).to_params()
    except ConfigError:
        return settings


def as_now(settings: Tree, step: str) -> Tree:
    """The settings step `step` recorded, as this version spells them (`spelled_now`)."""
    return step_settings(spelled_now(settings), step)


def settings_changes(old: Tree, new: Tree) -> dict[str, tuple[Value, Value]]:
    """The settings (dotted) that differ between two configurations, which steps run and where left out."""
    return {key: values for key, values in dotted_keys.changes(old, new).items()
            if key.split(".")[0] not in _NOT_SETTINGS}


def described(changes: dict[str, tuple[Value, Value]]) -> str:
    """`sequence.max 256 -> 128, opset 17 -> 18`."""
    return ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changes.items())


@dataclass(frozen=True)
class Variant:
    """A model variant the run built (fp32, int8_repaired, openvino, a TensorRT engine ...): its name, precision,
    kind ("onnx", "engine", or "folder": a runner's folder with its workbench.json) and file or folder."""

    name: str
    precision: str
    kind: str
    path: Path


class StepStatus(str, Enum):
    """A step's state in run.json (`steps.<step>.status`); a step never run has none. It prints as its value, as
    enum.StrEnum would (Python 3.11+; the package runs on 3.10)."""

    RUNNING = "running"
    OK = "ok"
    SKIPPED = "skipped"  # StepSkipped: this machine or run cannot do it; the reason says why
    FAILED = "failed"  # an error or an interrupt; its files are dropped
    STALE = "stale"  # ok, but a step it read from ran again or failed since

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


@dataclass(frozen=True)
class StepEntry:
    """One step as the record has it: status (None: never run), why, seconds, what it wrote (metrics.<step>) and
    the most memory its process tree held (MB; None in records from before it was measured)."""

    name: str
    status: StepStatus | None
    detail: str
    seconds: float | None
    verified: bool | None
    metrics: dict[str, Any]
    peak_mb: float | None = None

    @property
    def label(self) -> str:
        """The status as people read it: an ok the user allowed without verification says so."""
        if self.status == StepStatus.OK and self.verified is False:
            return "ok, verified: false"
        return self.status or "not run"

    def __str__(self) -> str:
        """`step: ok` or `step: skipped: why`, as a notebook prints its step's outcome."""
        return f"step: {self.label}" + (f": {self.detail}" if self.detail else "")


class RunRecord:
    """Load, update and atomically save one run's record; paths inside are relative to the run folder."""

    def __init__(self, run_dir: Path, data: dict[str, Any]) -> None:
        self.run_dir = Path(run_dir)
        self.data = data
        self._current: str | None = None  # the step running in this process, if any
        self._started = 0.0  # when it started (time.perf_counter)
        self._earlier: Earlier | None = None  # how long it took before, where known
        self._phase = ""  # what the running step started last (`phase`), until it says anything else
        self._said = ("", 0)  # the running step's last line and how many bars had closed then
        self._heartbeat: Heartbeat | None = None
        self.reopened_with: dict[str, tuple[Value, Value]] = {}  # the settings `open` changed, old and new

    # ---- opening -------------------------------------------------------------------------
    @classmethod
    def create(cls, run_dir: Path | str, config: RunConfig, by: str = "") -> RunRecord:
        """A new record in `run_dir`; the settings apart from the defaults are logged as set `by`."""
        from workbench.core.machine import collect_environment

        run_dir = Path(run_dir)
        ensure_writable(run_dir)
        data = {
            "schema": SCHEMA_VERSION,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "run_dir": str(run_dir.resolve()),
            "config": config.to_params(),
            "environment": collect_environment(),
            "corpus": corpus_sample(config.corpus, config.corpus_max_texts).record(),
            "steps": {},
            "artifacts": {},
            "metrics": {},
        }
        record = cls(run_dir, data)
        record._log_settings(RunConfig().to_params(), by)
        return record

    @classmethod
    def load(cls, run_dir: Path | str) -> RunRecord:
        path = Path(run_dir) / RECORD_NAME
        if not path.is_file():
            raise OutputDirError(f"{path} does not exist", "run `workbench run` first, or pass the run folder")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise OutputDirError(f"{path} is not a readable run record ({exc})",
                                 "start a new run in another folder, or with --overwrite in this one") from None
        if not isinstance(data, dict) or not {"config", "steps", "artifacts", "metrics"} <= set(data):
            raise OutputDirError(f"{path} is not a workbench run record (keys missing)",
                                 "start a new run in another folder, or with --overwrite in this one")
        if data.get("schema", 1) > SCHEMA_VERSION:
            raise OutputDirError(f"{path} was written by a newer workbench (schema {data['schema']}, this one reads "
                                 f"up to {SCHEMA_VERSION})", "upgrade the workbench to read this run")
        return cls(Path(run_dir), migrate(data, {spec.name: spec.metrics for spec in registry.facts()}))

    @classmethod
    def open(cls, run_dir: Path | str, config: RunConfig, must_exist: bool = False, by: str = "") -> RunRecord:
        """Load the record in `run_dir` (or create it unless `must_exist`); refuse a folder holding another run.

        The settings `config` changes are logged as set `by` (a notebook, a command), and a finished step that ran
        with other settings reads stale, naming them."""
        if not (Path(run_dir) / RECORD_NAME).is_file():
            if must_exist:
                raise OutputDirError(f"{run_dir} holds no run.json to resume",
                                     "pass the folder of an earlier run, or drop --resume")
            return cls.create(run_dir, config, by)
        record = cls.load(run_dir)
        old, new = spelled_now(record.data["config"]), config.to_params()
        defaults = RunConfig().to_params()  # a setting older runs did not record had its default
        changed = [key for key in _RUN_DEFINING if old.get(key, defaults[key]) != new.get(key)]
        if changed and record.data["steps"]:
            raise ConfigError(
                f"{run_dir} holds a run with a different {', '.join(changed)} "
                f"({', '.join(f'{old.get(k)!r} -> {new.get(k)!r}' for k in changed)})",
                "use another run folder for another model or export setting",
            )
        if any(old.get(key) != new.get(key) for key in ("corpus", "corpus_max_texts")):
            record.data["corpus"] = corpus_sample(config.corpus, config.corpus_max_texts).record()  # what runs now
        record.data["config"] = new
        record.data["run_dir"] = str(Path(run_dir).resolve())  # the folder may have been moved or copied
        record._log_settings(old, by)
        record._refresh_stale()
        return record

    def _log_settings(self, old: Tree, by: str) -> None:
        """Append the settings that differ from `old` to `settings_log`, as set `by`; save."""
        changed = self.reopened_with = settings_changes(old, self.data["config"])
        if changed:
            self.data.setdefault("settings_log", []).append(
                {"at": _now(), "by": by or "a caller", "changed": {k: list(v) for k, v in changed.items()}})
        self.save()

    def set_by(self, setting: str) -> str | None:
        """Who last set `setting` to its value (a notebook, a command), from `settings_log`."""
        return next((entry["by"] for entry in reversed(self.data.get("settings_log", []))
                     if setting in entry["changed"]), None)

    def own_settings(self) -> list[str]:
        """The run's settings apart from the defaults, each with who set it: `sequence.max 128 (01_export.ipynb)`."""
        own = settings_changes(RunConfig().to_params(), self.settings)
        return [f"{key} {new!r} ({self.set_by(key) or 'earlier'})" for key, (_, new) in own.items()]

    # ---- persistence ---------------------------------------------------------------------
    @property
    def path(self) -> Path:
        return self.run_dir / RECORD_NAME

    @property
    def settings(self) -> Tree:
        """The run's configuration as run.json holds it (the next step runs with it)."""
        return self.data["config"]

    @property
    def config(self) -> RunConfig:
        return RunConfig.from_dict(quietly_moved(self.data["config"]))

    def save(self) -> None:
        write_json(self.path, self.data)

    def moved_here(self) -> None:
        """Name the folder the record now lies in as the run's output_dir (a sweep cell measured in a node's own
        folder, brought back into the output root)."""
        self.data["config"]["output_dir"] = str(self.run_dir.resolve())
        self.save()

    # ---- steps ---------------------------------------------------------------------------
    @contextmanager
    def step(self, name: str) -> Iterator[RunRecord]:
        """Time a step; record it ok, skipped (StepSkipped) or failed (re-raised), and save.

        The step's earlier metrics and artifacts are dropped first, and what it
        reads from other steps is remembered, so that steps which consumed its outputs read `stale` once it re-runs
        or fails.
        """
        start = time.perf_counter()
        peak = PeakMemory().__enter__()  # stopped by _finish, however the step ends
        settings = step_settings(self.data["config"], name)
        self._earlier = earlier(self.run_dir, self.data, name, settings)
        self._drop_outputs(name)
        self.data["steps"][name] = {"status": StepStatus.RUNNING, "started": _now(), "run_id": uuid.uuid4().hex,
                                    "settings": settings, "inputs": {}, "metrics": []}
        self._current, self._started, self._phase = name, time.perf_counter(), ""
        self._refresh_stale()
        self._progress("started" if self._earlier is None else
                       f"started (it took {clock(self._earlier.seconds)} in {self._earlier.run})", left=False)
        self._said = ("", closed_bars()[0])  # nothing done yet
        self._heartbeat = Heartbeat(self._still).__enter__()  # stopped by _finish, however the step ends
        entry: dict[str, Any]
        try:
            yield self
            self._type_metrics(name)
        except StepSkipped as skip:
            entry = {"status": StepStatus.SKIPPED, "reason": str(skip)}
        except BaseException as exc:
            typed = as_disk_full(exc, self.run_dir) or exc
            entry = {"status": StepStatus.FAILED, "error": f"{type(typed).__name__}: {typed}",
                     "traceback": traceback.format_exc(limit=8)}
            with disk_full_typed(self.run_dir):  # the record itself may find no room
                self._finish(name, start, entry, peak)
            if typed is not exc:
                raise typed from None
            raise
        else:
            entry = {"status": StepStatus.OK}
        self._finish(name, start, entry, peak)

    def _type_metrics(self, name: str) -> None:
        """Write step `name`'s metrics as its declared model has them (a step that recorded something its model
        refuses fails here, naming the field)."""
        section = self.data["metrics"].get(name)
        if section is not None:
            typed = registry.fact(name).metrics.model_validate(section)
            self.data["metrics"][name] = typed.recorded()

    def results(self, name: str) -> Metrics | None:
        """Step `name`'s metrics as its declared model (None when it recorded none)."""
        section = self.metric(name)
        return None if section is None else registry.fact(name).metrics.model_validate(section)

    def results_as(self, name: str, model: type[M]) -> M | None:
        """Step `name`'s metrics as `model`, its declared one, for a caller that names the type it reads."""
        found = self.results(name)
        if found is not None and not isinstance(found, model):
            raise TypeError(f"the {name} step declares {type(found).__name__} for its metrics, not {model.__name__}")
        return found

    def results_of(self, model: type[M]) -> M | None:
        """The metrics of the step that declares `model` for them (the registry's), for a reader that names the table
        it reads, not the step (None: no such step, or it recorded none)."""
        step = _declaring(model)
        return None if step is None else self.results_as(step, model)

    def current(self, model: type[M]) -> M | None:
        """The metrics of the step that declares `model` (`results_of`) if that step is ok now (not stale, failed
        or missing)."""
        step = _declaring(model)
        return self.results_as(step, model) if step and self.status(step) == StepStatus.OK else None

    def needed(self, model: type[M]) -> M:
        """The metrics of the step that declares `model` (`results_of`); MissingArtifactError naming that step and
        how to run it where it recorded none."""
        step = _declaring(model)
        found = None if step is None else self.results_as(step, model)
        if found is None:
            raise MissingArtifactError(f"the run in {self.run_dir} has no {step or model.__name__} metrics",
                                       f"run the {step} step first: " + run_again([step], self.run_dir) if step else
                                       f"no registered step declares {model.__name__} for its metrics")
        return found

    def _finish(self, name: str, start: float, entry: dict[str, Any], peak: PeakMemory) -> None:
        if self._heartbeat is not None:
            self._heartbeat.__exit__(None, None, None)
            self._heartbeat = None
        self._current = None
        peak.__exit__(None, None, None)
        if entry["status"] == StepStatus.FAILED:
            self._drop_artifacts(name)
        previous = self.data["steps"][name]
        kept = {k: previous[k] for k in ("started", "run_id", "settings", "inputs", "metrics", "verified",
                                         "unverified_reason")
                if k in previous}
        self.data["steps"][name] = {**entry, **kept, "seconds": round(time.perf_counter() - start, 3),
                                    "peak_mb": round(peak.mb, 1)}
        self._refresh_stale()

    def mark(self, name: str, status: StepStatus, reason: str) -> None:
        """Set a step's status from outside it (the pipeline marks steps it did not run, or that it stopped).

        A step marked skipped was not run this time: what an earlier run of it left is dropped; a step marked
        failed loses its files (its metrics stay, for diagnosis, but no step reads them)."""
        if status == StepStatus.SKIPPED:
            self._drop_outputs(name)
        elif status == StepStatus.FAILED:
            self._drop_artifacts(name)
        entry = {**self.data["steps"].get(name, {}), "status": status}
        entry.pop("error" if status != StepStatus.FAILED else "reason", None)
        self.data["steps"][name] = {**entry, "error" if status == StepStatus.FAILED else "reason": reason}
        self._refresh_stale()

    def status(self, name: str) -> StepStatus | None:
        found = self.data["steps"].get(name, {}).get("status")
        return None if found is None else StepStatus(found)

    def step_entry(self, name: str) -> StepEntry:
        """Step `name` as recorded, its metrics included ({} when it wrote none, e.g. skipped)."""
        step = self.data["steps"].get(name, {})
        verified = step.get("verified")
        detail = (step.get("unverified_reason") if verified is False else None) or step.get("reason") \
            or step.get("error") or ""
        return StepEntry(name, self.status(name), detail.split("\n")[0], step.get("seconds"), verified,
                         self.metric(name) or {}, step.get("peak_mb"))

    def step_entries(self) -> list[StepEntry]:
        """Every step the record has, in pipeline order."""
        return [self.step_entry(name) for name in registry.step_names() if name in self.data["steps"]]

    def _drop_outputs(self, name: str) -> None:
        """Forget the metrics `name` wrote and remove the artifacts it produced (inside the run folder)."""
        for dotted in self.data["steps"].get(name, {}).get("metrics", []):
            dotted_keys.pop(self.data["metrics"], dotted)
        self._drop_artifacts(name)
        self.data["steps"].get(name, {}).pop("metrics", None)

    def _drop_artifacts(self, name: str) -> None:
        """Remove the files `name` produced (inside the run folder) and their entries: what a failed step wrote
        is never an input of another step."""
        for artifact, entry in list(self.data["artifacts"].items()):
            if entry.get("step") == name:
                remove_inside(self.run_dir, self.run_dir / entry["path"])
                del self.data["artifacts"][artifact]

    def _consume(self, key: str, producer: str | None, sha256: str | None = None) -> None:
        """Remember that the running step read `key` from step `producer`."""
        if self._current is None or producer is None or producer == self._current:
            return
        source = self.data["steps"].get(producer, {})
        self.data["steps"][self._current]["inputs"][key] = {"step": producer, "run_id": source.get("run_id"),
                                                            "sha256": sha256, "status": source.get("status")}

    def _refresh_stale(self) -> None:
        """A finished step whose inputs came from a step that re-ran, failed or is stale (or whose input file
        changed), or whose settings are no longer the run's, reads `stale`, naming why; one stale only by its
        settings reads ok again once they are the run's again; then save."""
        for name in registry.step_names():
            step = self.data["steps"].get(name)
            if not step or step.get("status") not in (StepStatus.OK, StepStatus.STALE) or name == self._current:
                continue
            changes = {key: why for key, source in step.get("inputs", {}).items()
                       if (why := self._input_change(key, source))}
            settings = settings_changes(as_now(step["settings"], name), step_settings(self.data["config"], name)) \
                if "settings" in step else {}
            if not changes and not settings and step.get("reason", "").startswith(_OTHER_SETTINGS):
                step["status"] = StepStatus.OK  # the settings it ran with are the run's again
                del step["reason"]
            elif changes or settings:
                step["status"] = StepStatus.STALE
                step["reason"] = "; ".join(
                    ([f"{_OTHER_SETTINGS}: {described(settings)}"] if settings else [])
                    + (["inputs changed since it ran: " + _by_cause(changes)] if changes else []))
        self.save()

    def _input_change(self, key: str, source: dict[str, Any]) -> str | None:
        """How input `key` changed since the step read it (None: it did not)."""
        name = source["step"]
        producer = self.data["steps"].get(name, {})
        if producer.get("run_id") != source["run_id"]:
            return f"{name} ran again"
        # the status it had when read, stale included, is still news
        if producer.get("status") not in (StepStatus.OK, StepStatus.SKIPPED, source.get("status")):
            return f"{name} is {producer.get('status')}"
        if key.startswith("metrics:"):
            return None
        entry = self.data["artifacts"].get(key)
        if entry is None:
            return f"removed from the record of {name}"
        if entry.get("sha256") != source["sha256"] or self._modified(entry):
            return f"the file {name} wrote changed"
        return None

    def _modified(self, entry: dict[str, Any]) -> bool:
        """A recorded file that is gone or whose content changed: size first, then (when only the modification
        time differs, as after `cp -r`) its sha256; a file found unchanged gets its new time recorded."""
        if "mtime_ns" not in entry:
            return False
        path = self.run_dir / entry["path"]
        try:
            stats = [file.stat() for file in _files(path)]
        except OSError:
            return True
        if sum(stat.st_size for stat in stats) != entry["bytes"]:
            return True
        if max(stat.st_mtime_ns for stat in stats) != entry["mtime_ns"]:
            if _digest(path, _files(path)) != entry["sha256"]:
                return True
            entry["mtime_ns"] = max(stat.st_mtime_ns for stat in stats)
        return False

    # ---- artifacts -----------------------------------------------------------------------
    def add_artifact(self, name: str, path: Path | str, kind: str, **extra: Any) -> Path:
        path = Path(path)
        files = _files(path)
        entry = {
            "path": self._relative(path),
            "kind": kind,
            "bytes": sum(p.stat().st_size for p in files),
            "sha256": _digest(path, files),
            "step": self._current,
            **extra,
        }
        if path.is_file():
            entry["mtime_ns"] = max(p.stat().st_mtime_ns for p in files)
        self.data["artifacts"][name] = entry
        self.save()
        self._progress(f"wrote {entry['path']} ({entry['bytes'] / 1e6:.1f} MB)")
        return path

    def phase(self, what: str) -> None:
        """Say what the running step starts now (`building fp32: ONNX Runtime fusions`), with its time so far."""
        self._progress(what)
        self._phase = re.split(r": | \(", what, maxsplit=1)[0]  # `building openvino_int8`, without the detail

    def found(self, what: str) -> None:
        """Say what the running step found or finished (`tritonserver ready in 12 s`), with its time so far."""
        self._progress(what)

    def _still(self) -> str:
        """The heartbeat's line: `bench 2:38 still on latency grid, 3/5 cells` where a bar is open; `optimize 1:12
        still building openvino_int8` where the step said nothing since that phase began; else what it did last
        (`triton 0:40 still at work after: tritonserver ready in 3 s`, `... after: repair int8`)."""
        line, closed = self._said
        count, last_bar = closed_bars()
        after = last_bar if count > closed else line
        doing = open_bar() or (self._phase if count == closed else "") or \
            (f"at work after: {after}" if after else "at work")
        return f"{self._current} {clock(time.perf_counter() - self._started)} still {doing}"

    def _progress(self, what: str, left: bool = True) -> None:
        """Say what the running step just did, with the time since it started and, where it ran before here, about
        how long is left (nothing outside a step)."""
        if self._current is not None:
            elapsed = time.perf_counter() - self._started
            remaining = "" if self._earlier is None or not left else f" ({self._earlier.left(elapsed)})"
            say(f"{self._current} {clock(elapsed)} {what}{remaining}")
            self._phase, self._said = "", (what, closed_bars()[0])

    def remove_artifact(self, name: str) -> None:
        """Delete an artifact (its file or folder inside the run folder) and its entry."""
        entry = self.data["artifacts"].pop(name, None)
        if entry is not None:
            remove_inside(self.run_dir, self.run_dir / entry["path"])
            self.save()

    def artifact(self, name: str) -> Path:
        """Absolute path of a recorded artifact that still exists."""
        entry = self.data["artifacts"].get(name)
        if entry is None:
            raise MissingArtifactError(
                f"the run in {self.run_dir} has no artifact {name!r}",
                "run the step that produces it first (see `workbench steps`)",
            )
        path = self.run_dir / entry["path"]
        if not path.exists():
            raise MissingArtifactError(f"artifact {name!r} was recorded but {path} is gone",
                                       "re-run the step that wrote it: "
                                       + run_again([entry.get("step") or "export"], self.run_dir))
        self._consume(name, entry.get("step"), entry.get("sha256"))
        return path

    def variants(self, kind: str = "onnx") -> dict[str, Variant]:
        """Model variants of `kind` ("onnx" or "engine") by name. The `tensorrt` ONNX file is the exported graph
        again (with shapes for TensorRT), not a variant of its own."""
        return {name: self.variant(name, kind) for name in self.variant_names(kind)}

    def variant_names(self, kind: str = "onnx") -> list[str]:
        """Names of the recorded variants of `kind`, without reading them."""
        return [a["variant"] for a in self.data["artifacts"].values()
                if a["kind"] == kind and a.get("variant") != "tensorrt"]

    def variant_megabytes(self, kind: str = "onnx") -> dict[str, float]:
        """The file size of each recorded variant of `kind` (its external data included), in MB."""
        return {a["variant"]: a["bytes"] / 1e6 for a in self.data["artifacts"].values()
                if a["kind"] == kind and a.get("variant") not in (None, "tensorrt") and "bytes" in a}

    def variant(self, name: str, kind: str = "onnx") -> Variant:
        """One variant of `kind`; its file must exist."""
        path = self.artifact(f"{kind}.{name}")
        return Variant(name, self.data["artifacts"][f"{kind}.{name}"]["precision"], kind, path)

    def artifact_details(self, name: str) -> dict[str, Any]:
        """What was recorded with an artifact besides its file (e.g. an engine's profiles); the file must exist."""
        self.artifact(name)
        return {k: v for k, v in self.data["artifacts"][name].items() if k not in ("path", "bytes", "sha256")}

    def artifact_sha256(self, name: str) -> str:
        """The content hash recorded with an artifact (a folder's: over its files); the file must exist."""
        self.artifact(name)
        return self.data["artifacts"][name]["sha256"]

    def artifact_bytes(self, name: str) -> int | None:
        """The recorded size of an artifact (a folder's: its files together); None when the run has none."""
        entry = self.data["artifacts"].get(name)
        return None if entry is None else entry["bytes"]

    def artifact_paths(self) -> list[Path]:
        """Every recorded artifact's path."""
        return [self.run_dir / a["path"] for a in self.data["artifacts"].values()]

    def _relative(self, path: Path) -> str:
        try:
            return str(path.resolve().relative_to(self.run_dir.resolve()))
        except ValueError:
            return str(path.resolve())

    # ---- metrics and environment ---------------------------------------------------------
    def set_metric(self, dotted: str, value: Any) -> None:
        """Write `metrics.<dotted>`; a running step writes only under its own name."""
        if self._current is not None and dotted.split(".")[0] != self._current:
            raise ValueError(f"step {self._current!r} may write metrics.{self._current}.* only, not {dotted!r}")
        dotted_keys.put(self.data["metrics"], dotted, value)
        if self._current is not None:
            written = self.data["steps"][self._current].setdefault("metrics", [])
            if dotted not in written:
                written.append(dotted)
        self.save()
        self._progress(f"recorded {dotted}")

    def metric(self, dotted: str, default: Any = None) -> Any:
        """`metrics.<dotted>`, or `default`. A failed step's metrics stay in run.json for diagnosis, but read as
        absent: no step takes a result from a step that did not finish."""
        writer = self._metric_writer(dotted)
        if writer is not None and writer != self._current and self.status(writer) == StepStatus.FAILED:
            return default
        self._consume(f"metrics:{dotted}", writer)
        return dotted_keys.get(self.data["metrics"], dotted, default)

    def verdict(self, variant: str) -> Verdict | None:
        """The parity result of `variant` (an ONNX variant or an engine, from the step that declares where it
        records verdicts: `StepSpec.verdicts`) if the step that wrote it is ok now (not stale, failed or missing)."""
        for dotted in (f"{where}.{variant}" for where in _verdict_paths()):
            writer = self._metric_writer(dotted)
            if writer is not None:
                found = self.metric(dotted) if self.status(writer) == StepStatus.OK else None
                return None if found is None else Verdict.model_validate(found)
        return None

    def verdicts(self) -> dict[str, Verdict]:
        """Every variant's and engine's current parity result (see `verdict`)."""
        names = [name for where in _verdict_paths() for name in dotted_keys.get(self.data["metrics"], where, {})]
        found = {name: self.verdict(name) for name in names}
        return {name: result for name, result in found.items() if result is not None}

    # ---- what steps read from each other -------------------------------------------------
    def tokenizer(self) -> Tokenizer:
        """The tokenizer the export step saved with the model, lowercasing where the model's sentence-transformers
        files say so (transformers rebuilds some tokenizers' normalizers on loading, so it is applied again)."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.artifact("tokenizer"))
        if self.metric("export.sentence_pipeline.do_lower_case"):
            lowercase_inputs(tokenizer)
        return tokenizer

    def unverified(self, reason: str) -> None:
        """Mark the running step `verified: false` (it finished only because the user allowed it)."""
        if self._current is not None:
            self.data["steps"][self._current].update(verified=False, unverified_reason=reason)
            self.save()

    def _metric_writer(self, dotted: str) -> str | None:
        """The step that wrote `dotted` (or a key above or below it)."""
        for name, step in self.data["steps"].items():
            for written in step.get("metrics", []):
                if written == dotted or written.startswith(f"{dotted}.") or dotted.startswith(f"{written}."):
                    return name
        return None

    def all_metrics(self) -> dict[str, Any]:
        """Every metric of the run, as one mapping (for rendering the whole record)."""
        return self.data["metrics"]

    @property
    def created(self) -> str:
        return self.data["created"]

    @property
    def environment(self) -> HostEnvironment:
        return HostEnvironment.model_validate(self.data["environment"])

    def refresh_environment(self) -> None:
        """Record this machine again (a resumed run may continue on another host)."""
        from workbench.core.machine import collect_environment

        self.data["environment"] = collect_environment()
        self.save()

    def note_memory_estimate(self, estimate: Json) -> None:
        """Keep preflight's memory estimate (`preflight.memory` in run.json)."""
        self.data.setdefault("preflight", {})["memory"] = estimate
        self.save()

    def note_providers(self, providers: list[str]) -> None:
        """Remember which ONNX Runtime providers a session really used."""
        ort = self.data["environment"].setdefault("onnxruntime", {})
        used = ort.setdefault("providers_used", [])
        for provider in providers:
            if provider not in used:
                used.append(provider)
        self.save()


def _by_cause(changes: dict[str, str]) -> str:
    """`export ran again (onnx.fp32, metrics.export.nodes)`: each cause once, with the inputs it changed as run.json
    names them (an artifact, a metrics path)."""
    causes: dict[str, list[str]] = {}
    for key, why in changes.items():
        causes.setdefault(why, []).append(key.replace("metrics:", "metrics.", 1))
    return "; ".join(f"{why} ({', '.join(keys)})" for why, keys in causes.items())


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _files(path: Path) -> list[Path]:
    """An artifact's files: a folder's, else the file and, for an ONNX graph, the external-data file beside it
    (`<name>.data`), where there is one."""
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    data = Path(f"{path}.data")
    return [path, data] if path.suffix == ".onnx" and data.is_file() else [path]


def _digest(path: Path, files: list[Path]) -> str:
    """An artifact's sha256: a single file's own, else `_sha256_tree` of its files (a graph and its weights)."""
    return sha256_file(path) if files == [path] else _sha256_tree(path if path.is_dir() else path.parent, files)


def _sha256_tree(root: Path, files: list[Path]) -> str:
    """One digest for a folder: each file's relative path and content digest."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.relative_to(root)}\0{sha256_file(path)}\n".encode())
    return digest.hexdigest()


def remove_inside(run_dir: Path, path: Path) -> None:
    """Delete `path` (file or folder) if it lies inside `run_dir`; anything outside is not ours to remove."""
    try:
        path.resolve().relative_to(run_dir.resolve())
    except ValueError:
        return
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
        Path(f"{path}.data").unlink(missing_ok=True)


def ensure_writable(folder: Path, setting: str = "--output-dir") -> None:
    """Create `folder` if needed and prove a file can be written in it."""
    if folder.exists() and not folder.is_dir():
        raise OutputDirError(f"{folder} ({setting}) is a file, not a folder", f"pass a folder with {setting}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise OutputDirError(f"cannot write to {folder} ({setting}): {exc.strerror or exc}",
                             f"choose a writable folder with {setting}") from None


def _declaring(model: type[Metrics]) -> str | None:
    """The step that declares `model` for its metrics (None: no registered step does)."""
    return next((s.name for s in registry.facts() if s.metrics is model), None)


def _verdict_paths() -> list[str]:
    """Where the registered steps record a parity verdict per variant (`parity.variants`, `tensorrt.parity`)."""
    return [f"{step.name}.{step.verdicts}" for step in registry.facts() if step.verdicts]

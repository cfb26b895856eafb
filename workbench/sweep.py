"""`workbench sweep SWEEP.yaml`: many runs from one file (a list, a grid, or both), one after another, resumable;
or, for a sweep that outgrows one machine, the same file as a Kubernetes Indexed Job (one pod per run)."""
from __future__ import annotations

import hashlib
import itertools
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import ErrorDetails

from workbench.core import dotted
from workbench.core.atomic import write_marked
from workbench.core.config import RunConfig
from workbench.core.errors import ConfigError, MissingArtifactError, RunInterruptedError, WorkbenchError
from workbench.core.record import RECORD_NAME, RunRecord, StepStatus
from workbench.lock import RunLockedError
from workbench.models.loading import is_path
from workbench.pipeline import NOT_RUN, run_pipeline
from workbench.serving.hostkinds import BY_NAME, host_kind
from workbench.steps.generation import GenerationSettings

INDEX_VARIABLE = "WORKBENCH_SWEEP_INDEX"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
HELD_POLL_S = 5.0  # how often a run another process holds is tried again


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SweepRun(_Strict):
    name: str | None = Field(default=None, description="its folder under output_root; default: from the model")
    model: str
    settings: dict[str, Any] = Field(default_factory=dict, description="this run's settings, over `settings`")


class KubernetesSettings(_Strict):
    image: str = Field(description="an image with the workbench installed (and the models, if not hub ids)")
    claim: str = Field(description="a ReadWriteMany PersistentVolumeClaim for the run folders")
    parallelism: int = Field(default=2, ge=1)
    cpu: str = "2"
    memory: str = "8Gi"
    gpu: int = Field(default=0, ge=0, description="NVIDIA GPUs per pod")


class RaySettings(_Strict):
    address: str | None = Field(default=None, description="the cluster's GCS address, host:port (or --ray)")
    kinds: list[str] = Field(default_factory=list, description="host kinds each run is measured on; default: "
                             "every kind the cluster's live nodes offer")
    retries: int = Field(default=1, ge=0, description="times a cell whose node was lost is placed again")

    @field_validator("kinds")
    @classmethod
    def _known(cls, kinds: list[str]) -> list[str]:
        for kind in kinds:
            try:
                host_kind(kind)
            except ConfigError as unknown:
                raise ValueError(f"{unknown.problem}; one of {', '.join(BY_NAME)}") from None
        return kinds


class SweepFile(_Strict):
    output_root: str = Field(description="run folders go to <output_root>/<run name> (relative: to the file)")
    settings: dict[str, Any] = Field(default_factory=dict, description="every run's settings")
    runs: list[SweepRun] = Field(default_factory=list)
    grid: dict[str, list[Any]] = Field(default_factory=dict, description="every combination of these values")
    kubernetes: KubernetesSettings | None = None
    ray: RaySettings | None = None


@dataclass(frozen=True)
class PlannedRun:
    name: str
    config: RunConfig
    run_dir: Path


@dataclass(frozen=True)
class Sweep:
    path: Path
    text: str
    spec: SweepFile
    runs: tuple[PlannedRun, ...]

    @property
    def name(self) -> str:
        """The Kubernetes name of its Job and ConfigMap: the file's name and a hash of its content (two sweeps, or
        two versions of one, never share them)."""
        return f"{_slug(self.path.stem)[:50]}-{hashlib.sha256(self.text.encode()).hexdigest()[:8]}"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:63] or "run"


def _leaves(settings: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Every setting as a dotted key and its value: `{bench: {served: false}}` and `{bench.served: false}` alike."""
    found: list[tuple[str, Any]] = []
    for key, value in settings.items():
        name = f"{prefix}{key}"
        found += _leaves(value, f"{name}.") if isinstance(value, dict) and value else [(name, value)]
    return found


def configure(*layers: dict[str, Any]) -> RunConfig:
    """The defaults with each layer's settings put over them in turn, as `-p` puts them (a partial `sequence`
    keeps the other defaults)."""
    data = RunConfig().to_params()
    for layer in layers:
        for key, value in _leaves(layer):
            dotted.put(data, key, value)
    return RunConfig.from_dict(data)


def expand(spec: SweepFile) -> list[SweepRun]:
    """The listed runs, then one per combination of the grid (named from its values)."""
    runs = list(spec.runs)
    keys = list(spec.grid)
    for values in itertools.product(*(spec.grid[k] for k in keys)) if keys else ():
        combination = dict(zip(keys, values))
        model = combination.pop("model", spec.settings.get("model"))
        if model is None:
            raise ConfigError("a grid without a `model` key needs `model` in `settings`", "add model to the grid")
        label = "-".join([Path(str(model)).name, *(f"{k.split('.')[-1]}{v}" for k, v in combination.items())])
        runs.append(SweepRun(name=label, model=str(model), settings=combination))
    if not runs:
        raise ConfigError("the sweep has no runs", "list `runs:` (each a model and its settings) or a `grid:`")
    return runs


def _said(error: ErrorDetails) -> str:
    """One validation error as a person says it: an unknown key named with the keys its section takes."""
    where = ".".join(str(part) for part in error["loc"])
    if error["type"] != "extra_forbidden":
        return f"{where}: {error['msg'].removeprefix('Value error, ')}"
    model: type[BaseModel] = SweepFile
    for part in error["loc"][:-1]:
        field = model.model_fields.get(str(part))
        inner = field.annotation if field else None
        found = [t for t in getattr(inner, "__args__", (inner,)) if isinstance(t, type) and issubclass(t, BaseModel)]
        if not found:
            break
        model = found[0]
    return f"{where}: unknown key (its section takes {', '.join(model.model_fields)})"


def load_sweep(path: Path, output_root: Path | None = None) -> Sweep:
    """The sweep file, validated; each run's configuration checked now, not when its turn comes."""
    try:
        text = path.read_text(encoding="utf-8")
        spec = SweepFile.model_validate(yaml.safe_load(text) or {})
    except OSError as exc:
        raise ConfigError(f"cannot read sweep file {path}: {exc.strerror}", "pass a YAML sweep file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"sweep file {path} is not YAML: {exc}", "fix the YAML (docs/compare.md has an example)"
                          ) from None
    except ValidationError as exc:
        found = "; ".join(_said(error) for error in exc.errors()[:3])
        raise ConfigError(f"sweep file {path}: {found}",
                          "the keys are output_root, settings, runs (name, model, settings), grid, kubernetes, "
                          "ray (docs/compare.md)") from None
    root = output_root or (path.parent / spec.output_root)
    try:
        configure(spec.settings)
    except WorkbenchError as exc:
        raise ConfigError(f"sweep file {path}, settings: {exc.problem}", exc.fix) from None
    planned, names = [], set()
    for index, run in enumerate(expand(spec)):
        name = _slug(run.name or Path(run.model).name)
        if name in names:
            raise ConfigError(f"sweep file {path}: two runs are named {name!r}", "give each run its own `name`")
        names.add(name)
        try:
            config = configure(spec.settings, {"model": run.model}, run.settings)
        except WorkbenchError as exc:
            raise ConfigError(f"sweep file {path}, run {index} ({name}): {exc.problem}", exc.fix) from None
        planned.append(PlannedRun(name, config.model_copy(update={"output_dir": str(root / name)}), root / name))
    return Sweep(path, text, spec, tuple(planned))


def pending_steps(run: PlannedRun) -> list[str] | None:
    """The steps this run still has to do: all of them for a new run folder, none (None) for a finished one."""
    if not (run.run_dir / RECORD_NAME).is_file():
        return list(run.config.steps)
    record = RunRecord.load(run.run_dir)
    left = [step for step in run.config.steps if not finished(record, step)]
    return left or None


def finished(record: RunRecord, step: str) -> bool:
    """Ok with its executed notebook landed (a process killed between the two left none), or skipped for a reason
    of its own (this host cannot run it), not because an earlier step failed."""
    entry = record.step_entry(step)
    skipped_here = entry.status == StepStatus.SKIPPED and not entry.detail.startswith(NOT_RUN)
    try:
        landed = record.artifact(f"notebook.{step}").is_file()
    except MissingArtifactError:
        landed = False
    return (entry.status == StepStatus.OK and landed) or skipped_here


def run_sweep(sweep: Sweep, index: int | None = None, progress: bool = True) -> int:
    """Every run (or run `index` alone) in order; a finished run is not run again, an interrupted or failed one
    continues with the steps it has left, and one another process is running (a second sweep of the file) is come
    back to once the others are done, until that process lets it go. One line per run; 0 when every run finished,
    1 when one failed."""
    queue = list(enumerate(sweep.runs)) if index is None else [(index, _run_at(sweep, index))]
    failed, held = [], set()
    while queue:
        number, run = queue.pop(0)
        head = f"[{number + 1}/{len(sweep.runs)}] {run.name}"
        if number in held:
            _pause()  # every other run was tried since
        try:
            if not _run_one(sweep, run, head):
                failed.append(run.name)
        except RunLockedError as locked:
            if number not in held:
                print(f"{head}: {locked.problem}; coming back to it", flush=True)
            held.add(number)
            queue.append((number, run))
    if failed:
        print(f"failed: {', '.join(failed)}; `workbench sweep {sweep.path}` retries what they have left",
              file=sys.stderr, flush=True)
    return 1 if failed else 0


def _pause() -> None:
    time.sleep(HELD_POLL_S)


def _run_one(sweep: Sweep, run: PlannedRun, head: str) -> bool:
    """Run what `run` has left, with its line; False when it failed. RunLockedError: another process holds it."""
    left = pending_steps(run)
    if left is None:
        print(f"{head}: done ({run.run_dir})", flush=True)
        return True
    resume = (run.run_dir / RECORD_NAME).is_file()
    started = time.perf_counter()
    print(f"{head}: {'resuming' if resume else 'running'} {','.join(left)} -> {run.run_dir}", flush=True)
    try:
        record = run_pipeline(run.config.model_copy(update={"steps": left}), run.run_dir, progress=False,
                              resume=resume)
    except RunLockedError:
        raise
    except RunInterruptedError as stopped:
        raise RunInterruptedError(f"{stopped.problem} (sweep run {run.name})",
                                  f"workbench sweep {sweep.path} resumes it: finished runs are kept",
                                  stopped.signum) from None
    except WorkbenchError as error:
        print(f"{head}: failed in {time.perf_counter() - started:.0f} s: {error.headline()}", flush=True)
        return False
    states = ", ".join(f"{e.name} {e.label}" for e in record.step_entries() if e.name in left)
    print(f"{head}: finished in {time.perf_counter() - started:.0f} s: {states}", flush=True)
    return True


def _run_at(sweep: Sweep, index: int) -> PlannedRun:
    if not 0 <= index < len(sweep.runs):
        raise ConfigError(f"--index {index} is outside the sweep's {len(sweep.runs)} runs",
                          f"pass 0 to {len(sweep.runs) - 1}")
    return sweep.runs[index]


def indexed_job(sweep: Sweep) -> list[dict[str, Any]]:
    """A ConfigMap holding the sweep file and an Indexed Job running one run per pod (`workbench sweep --index`),
    the run folders on the shared claim."""
    settings = sweep.spec.kubernetes
    if settings is None:
        raise ConfigError(f"sweep file {sweep.path} has no `kubernetes:` section",
                          "add kubernetes: {image: <an image with the workbench>, claim: <a ReadWriteMany PVC>}")
    name = sweep.name
    limits: dict[str, Any] = {"memory": settings.memory, **({"nvidia.com/gpu": settings.gpu} if settings.gpu else {})}
    container = {
        "name": "workbench", "image": settings.image,
        "command": ["workbench", "sweep", "/sweep/sweep.yaml", "--output-root", "/runs",
                    "--index", f"$({INDEX_VARIABLE})"],
        "env": [{"name": INDEX_VARIABLE, "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}}],
        "resources": {"requests": {"cpu": settings.cpu, "memory": settings.memory}, "limits": limits},
        "volumeMounts": [{"name": "sweep", "mountPath": "/sweep", "readOnly": True},
                         {"name": "runs", "mountPath": "/runs"}]}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name},
                  "data": {"sweep.yaml": sweep.text}}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
           "spec": {"completionMode": "Indexed", "completions": len(sweep.runs),
                    "parallelism": min(settings.parallelism, len(sweep.runs)), "backoffLimitPerIndex": 1,
                    "template": {"spec": {"restartPolicy": "Never", "containers": [container], "volumes": [
                        {"name": "sweep", "configMap": {"name": name}},
                        {"name": "runs", "persistentVolumeClaim": {"claimName": settings.claim}}]}}}}
    return [config_map, job]


def local_models(sweep: Sweep) -> list[str]:
    """The runs' models that are paths on this machine (`run: path`): a pod sees one only where its image or the
    claim holds it at that path."""
    found = []
    for run in sweep.runs:
        generation = GenerationSettings.of(run.config)
        for model in (run.config.model, generation.translation_model, generation.text_generation_model):
            if model and is_path(model):
                found.append(f"{run.name}: {model}")
    return found


MANIFEST_MARK = "one pod each: kubectl apply -f this file"  # on the first line of every manifest written here


def write_manifest(sweep: Sweep, path: Path) -> Path:
    """The Indexed Job manifest in `path`; a file there that this command did not write is refused."""
    return write_marked(path, job_manifest(sweep), MANIFEST_MARK, "a manifest `workbench sweep --kubernetes` wrote")


def job_manifest(sweep: Sweep) -> str:
    return (f"# {len(sweep.runs)} runs of {sweep.path.name}, {MANIFEST_MARK}; the run folders land on the claim; "
            "then `workbench compare` them.\n"
            + yaml.safe_dump_all(indexed_job(sweep), sort_keys=False))

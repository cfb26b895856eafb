"""run.json: the single machine-readable record of a run (config, environment, steps, artifacts, metrics)."""
from __future__ import annotations

import json
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from workbench.atomic import sha256_file, write_json
from workbench.config import RunConfig
from workbench.errors import ConfigError, MissingArtifactError, OutputDirError, StepSkipped

RECORD_NAME = "run.json"
SCHEMA_VERSION = 1
_RUN_DEFINING = ("model", "task", "pooling", "exporter", "opset", "attn_implementation")


class RunRecord:
    """Load, update and atomically save one run's record; paths inside are relative to the run folder."""

    def __init__(self, run_dir: Path, data: dict[str, Any]) -> None:
        self.run_dir = Path(run_dir)
        self.data = data

    # ---- opening -------------------------------------------------------------------------
    @classmethod
    def create(cls, run_dir: Path | str, config: RunConfig) -> RunRecord:
        from workbench.environment import collect_environment

        run_dir = Path(run_dir)
        _ensure_writable(run_dir)
        data = {
            "schema": SCHEMA_VERSION,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "run_dir": str(run_dir.resolve()),
            "config": config.to_params(),
            "environment": collect_environment(),
            "steps": {},
            "artifacts": {},
            "metrics": {},
        }
        record = cls(run_dir, data)
        record.save()
        return record

    @classmethod
    def load(cls, run_dir: Path | str) -> RunRecord:
        path = Path(run_dir) / RECORD_NAME
        if not path.is_file():
            raise OutputDirError(f"{path} does not exist", "run `workbench run` first, or pass the run folder")
        return cls(Path(run_dir), json.loads(path.read_text(encoding="utf-8")))

    @classmethod
    def open(cls, run_dir: Path | str, config: RunConfig, must_exist: bool = False) -> RunRecord:
        """Load the record in `run_dir` (or create it unless `must_exist`); refuse a folder holding another run."""
        if not (Path(run_dir) / RECORD_NAME).is_file():
            if must_exist:
                raise OutputDirError(f"{run_dir} holds no run.json to resume",
                                     "pass the folder of an earlier run, or drop --resume")
            return cls.create(run_dir, config)
        record = cls.load(run_dir)
        old, new = record.data["config"], config.to_params()
        changed = [key for key in _RUN_DEFINING if old.get(key) != new.get(key)]
        if changed and record.data["steps"]:
            raise ConfigError(
                f"{run_dir} holds a run with a different {', '.join(changed)} "
                f"({', '.join(f'{old.get(k)!r} -> {new.get(k)!r}' for k in changed)})",
                "use another run folder for another model or export setting",
            )
        record.data["config"] = new
        record.save()
        return record

    # ---- persistence ---------------------------------------------------------------------
    @property
    def path(self) -> Path:
        return self.run_dir / RECORD_NAME

    @property
    def config(self) -> RunConfig:
        return RunConfig.from_dict(self.data["config"])

    def save(self) -> None:
        write_json(self.path, self.data)

    # ---- steps ---------------------------------------------------------------------------
    @contextmanager
    def step(self, name: str) -> Iterator[RunRecord]:
        """Time a step; record it ok, skipped (StepSkipped) or failed (re-raised), and save."""
        start = time.perf_counter()
        self.data["steps"][name] = {"status": "running", "started": _now()}
        self.save()
        entry: dict[str, Any]
        try:
            yield self
        except StepSkipped as skip:
            entry = {"status": "skipped", "reason": str(skip)}
        except BaseException as exc:
            entry = {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                     "traceback": traceback.format_exc(limit=8)}
            self._finish(name, start, entry)
            raise
        else:
            entry = {"status": "ok"}
        self._finish(name, start, entry)

    def _finish(self, name: str, start: float, entry: dict[str, Any]) -> None:
        previous = self.data["steps"][name]
        self.data["steps"][name] = {**entry, "started": previous["started"],
                                    "seconds": round(time.perf_counter() - start, 3)}
        self.save()

    def mark(self, name: str, status: str, reason: str) -> None:
        """Set a step's status from outside it (the pipeline marks steps it did not run)."""
        self.data["steps"][name] = {**self.data["steps"].get(name, {}), "status": status, "reason": reason}
        self.save()

    def status(self, name: str) -> str | None:
        return self.data["steps"].get(name, {}).get("status")

    # ---- artifacts -----------------------------------------------------------------------
    def add_artifact(self, name: str, path: Path | str, kind: str, **extra: Any) -> Path:
        path = Path(path)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        entry = {
            "path": self._relative(path),
            "kind": kind,
            "bytes": sum(p.stat().st_size for p in files),
            "sha256": sha256_file(path) if path.is_file() else None,
            **extra,
        }
        self.data["artifacts"][name] = entry
        self.save()
        return path

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
            raise MissingArtifactError(f"artifact {name!r} was recorded but {path} is gone", "re-run its step")
        return path

    def variants(self, kind: str = "onnx") -> dict[str, tuple[Path, str]]:
        """Model variants of `kind` ("onnx" or "engine"): name -> (path, precision). The `tensorrt` ONNX file is
        the exported graph again (with shapes for TensorRT), not a variant of its own."""
        return {a["variant"]: (self.run_dir / a["path"], a["precision"]) for a in self.data["artifacts"].values()
                if a["kind"] == kind and a.get("variant") != "tensorrt"}

    def _relative(self, path: Path) -> str:
        try:
            return str(path.resolve().relative_to(self.run_dir.resolve()))
        except ValueError:
            return str(path.resolve())

    # ---- metrics and environment ---------------------------------------------------------
    def set_metric(self, dotted: str, value: Any) -> None:
        node = self.data["metrics"]
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
        self.save()

    def metric(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.data["metrics"]
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def note_providers(self, providers: list[str]) -> None:
        """Remember which ONNX Runtime providers a session really used."""
        ort = self.data["environment"].setdefault("onnxruntime", {})
        used = ort.setdefault("providers_used", [])
        for provider in providers:
            if provider not in used:
                used.append(provider)
        self.save()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _ensure_writable(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise OutputDirError(
            f"cannot write to output directory {run_dir}: {exc.strerror or exc}",
            "choose a writable folder with --output-dir (or -p output_dir=...)",
        ) from None

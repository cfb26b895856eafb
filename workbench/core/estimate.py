"""How long a step will take, from how long it took before: the same step of the same model with the same settings
on the same kind of host (CPU, core count), finished ok, in this run or a run beside it. Only a time measured that
way is offered; a step never run so before has no estimate."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from workbench.core.dotted import Tree

RUNS_LOOKED_AT = 30  # the newest run folders beside this one that are read for an earlier time
_HOST_KEYS = ("cpu", "cpu_count", "gpu")


@dataclass(frozen=True)
class Earlier:
    """A step's earlier time: `seconds` it took in run `run`."""

    seconds: float
    run: str

    def left(self, elapsed: float) -> str:
        """`about 3:10 left` or, once past it, `past the 9:12 it took in run-x`."""
        if elapsed < self.seconds:
            return f"about {clock(self.seconds - elapsed)} left"
        return f"past the {clock(self.seconds)} it took in {self.run}"


def clock(seconds: float) -> str:
    """`m:ss`."""
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes}:{rest:02d}"


def earlier(run_dir: Path, data: Tree, step: str, settings: Tree) -> Earlier | None:
    """The newest ok time of `step` with `settings` for this run's model and host: this run's own earlier one first
    (`data` is its record before the step starts), else one of the newest runs beside it."""
    own = _matching(data, data, step, settings)
    if own is not None:
        return Earlier(own, run_dir.name)
    siblings = sorted((p for p in run_dir.parent.glob("*/run.json") if p.parent != run_dir),
                      key=_mtime, reverse=True)[:RUNS_LOOKED_AT]
    for path in siblings:
        other = _read(path)
        seconds = None if other is None else _matching(data, other, step, settings)
        if seconds is not None:
            return Earlier(seconds, path.parent.name)
    return None


def _matching(data: Tree, other: Tree, step: str, settings: Tree) -> float | None:
    """`other`'s time for `step` when it ran ok with `settings`, for `data`'s model on `data`'s kind of host."""
    entry = (other.get("steps") or {}).get(step) or {}
    same_host = all((other.get("environment") or {}).get(k) == (data.get("environment") or {}).get(k)
                    for k in _HOST_KEYS)
    same_model = (other.get("config") or {}).get("model") == (data.get("config") or {}).get("model")
    if entry.get("status") == "ok" and entry.get("settings") == settings and same_host and same_model:
        seconds = entry.get("seconds")
        return float(seconds) if isinstance(seconds, (int, float)) else None
    return None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _read(path: Path) -> Tree | None:
    """A run.json's content; None where it is unreadable (another run writing it, a damaged file)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None

"""How to run steps again, said where the user is: the notebooks to run in JupyterLab, the command elsewhere."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from workbench.core import registry
from workbench.core.parameters import parameter_of

IN_LAB = "WORKBENCH_IN_LAB"  # set in a kernel JupyterLab runs (not papermill's): advice names notebooks


def speak_notebooks() -> None:
    """From now on, this process's advice names notebooks to run."""
    os.environ[IN_LAB] = "1"


def in_lab(lab: bool | None = None) -> bool:
    """Whether advice names notebooks: `lab` where given, else whether this process runs in JupyterLab."""
    return bool(os.environ.get(IN_LAB)) if lab is None else lab


def run_again(steps: Sequence[str], run_dir: Path | str | None = None,
              settings: Mapping[str, object] | None = None, lab: bool | None = None) -> str:
    """`run 05_triton.ipynb with config = {"bench.served": True} in its parameters cell, then 07_bench.ipynb` in
    JupyterLab;
    `workbench run --resume --output-dir RUN --steps triton,bench -p bench.served=true` elsewhere (`lab`: which,
    else where this runs)."""
    settings = dict(settings or {})
    if in_lab(lab):
        first = f"run {registry.fact(steps[0]).notebook}" + (
            f" with {_cell_lines(settings)} in its parameters cell" if settings else "")
        return ", then ".join([first, *(registry.fact(step).notebook for step in steps[1:])])
    values = f" {set_settings(settings, lab=False)}" if settings else ""
    folder = shlex.quote(str(run_dir)) if run_dir else "<run>"
    return f"{command()} run --resume --output-dir {folder} --steps {','.join(steps)}{values}"


def command() -> str:
    """How to call the workbench from here: `workbench` where PATH finds this one, else its script beside this
    Python (`.venv/bin/workbench`, relative where it lies under the working folder), else `python -m workbench`."""
    script = Path(sys.executable).parent / "workbench"
    if not script.is_file():
        return f"{sys.executable} -m workbench"
    if shutil.which("workbench") == str(script):
        return "workbench"
    return str(script.relative_to(Path.cwd())) if script.is_relative_to(Path.cwd()) else str(script)


def set_settings(settings: Mapping[str, object], lab: bool | None = None) -> str:
    """How to set `settings` where the user is: `-p sequence.max=auto` on the command line; in JupyterLab
    `sequence_max = "auto" in the parameters cell of 01_export.ipynb`, the notebook of the first step that reads
    them (`lab`: which, else where this runs)."""
    if in_lab(lab):
        reader = _reader(next(iter(settings)))
        return f"{_cell_lines(settings)} in the parameters cell of {registry.fact(reader).notebook}"
    return " ".join(f"-p {key}={_cli_value(value)}" for key, value in settings.items())


def _cell_lines(settings: Mapping[str, object]) -> str:
    """What to type into a parameters cell: `sequence_max = "auto"` where each setting has a parameter of its own,
    else `config = {"optimize.openvino": "always"}` (Python: True, not true)."""
    named = {key: parameter_of(key) for key in settings}
    if all(named.values()):
        return "; ".join(f"{named[key]} = {_python(value)}" for key, value in settings.items())
    return f"config = {_python(dict(settings))}"


def _python(value: object) -> str:
    """`value` as Python source, strings in double quotes."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_python(k)}: {_python(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_python(v) for v in value) + "]"
    return json.dumps(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else repr(value)


def _reader(key: str) -> str:
    """The first step that reads setting `key`: the one whose section it is, or which first reads it, else the
    first step (run-wide settings)."""
    top = key.split(".")[0]
    found = [s.name for s in registry.facts() if (s.settings and s.name == top) or top in s.first_reads]
    return found[0] if found else registry.step_names()[0]


def _cli_value(value: object) -> str:
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return value if isinstance(value, str) else json.dumps(value)


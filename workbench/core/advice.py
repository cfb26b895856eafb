"""How to run steps again, said where the user is: the notebooks to run in JupyterLab, the command elsewhere."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from workbench.core import catalog

IN_LAB = "WORKBENCH_IN_LAB"  # set in a kernel JupyterLab runs (not papermill's): advice names notebooks


def speak_notebooks() -> None:
    """From now on, this process's advice names notebooks to run."""
    os.environ[IN_LAB] = "1"


def run_again(steps: Sequence[str], run_dir: Path | str | None = None,
              settings: Mapping[str, object] | None = None, lab: bool | None = None) -> str:
    """`run 05_triton.ipynb, then 07_bench.ipynb (config = {"bench.served": true} in the parameters cell of
    05_triton.ipynb)` in JupyterLab;
    `workbench run --resume --output-dir RUN --steps triton,bench -p bench.served=true` elsewhere (`lab`: which,
    else where this runs)."""
    settings = dict(settings or {})
    if os.environ.get(IN_LAB) if lab is None else lab:
        notebooks = ", then ".join(catalog.spec(step).notebook for step in steps)
        return f"run {notebooks}" + (f" (config = {json.dumps(settings)} in the parameters cell of "
                                     f"{catalog.spec(steps[0]).notebook})" if settings else "")
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
    """How to set `settings` where the user is: `-p precisions=[fp32,int8]` on the command line; in JupyterLab
    `config = {"precisions": ["fp32", "int8"]} in the parameters cell of 02_optimize.ipynb`, the notebook of the first
    step that reads them (`lab`: which, else where this runs)."""
    if os.environ.get(IN_LAB) if lab is None else lab:
        reader = _reader(next(iter(settings)))
        return f"config = {json.dumps(dict(settings))} in the parameters cell of {catalog.spec(reader).notebook}"
    return " ".join(f"-p {key}={_cli_value(value)}" for key, value in settings.items())


def _reader(key: str) -> str:
    """The first step that reads setting `key`: the one whose section it is, or which first reads it, else the
    first step (run-wide settings)."""
    top = key.split(".")[0]
    found = [s.name for s in catalog.specs() if s.settings == top or top in s.first_reads]
    return found[0] if found else catalog.step_names()[0]


def _cli_value(value: object) -> str:
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return value if isinstance(value, str) else json.dumps(value)


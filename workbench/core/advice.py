"""How to run steps again, said where the user is: the notebooks to run in JupyterLab, the command elsewhere."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from workbench.core import catalog

IN_LAB = "WORKBENCH_IN_LAB"  # set in a kernel JupyterLab runs (not papermill's): advice names notebooks


def speak_notebooks() -> None:
    """From now on, this process's advice names notebooks to run."""
    os.environ[IN_LAB] = "1"


def run_again(steps: Sequence[str], run_dir: Path | str | None = None,
              settings: Mapping[str, object] | None = None, lab: bool | None = None) -> str:
    """`run 05_triton.ipynb, then 07_bench.ipynb (config={"bench.served": true} in the first)` in JupyterLab;
    `workbench run --resume --output-dir RUN --steps triton,bench -p bench.served=true` elsewhere (`lab`: which,
    else where this runs)."""
    settings = dict(settings or {})
    if os.environ.get(IN_LAB) if lab is None else lab:
        notebooks = ", then ".join(catalog.spec(step).notebook for step in steps)
        return f"run {notebooks}" + (f" (config={json.dumps(settings)} in the first)" if settings else "")
    values = "".join(f" -p {key}={value if isinstance(value, str) else json.dumps(value)}"
                     for key, value in settings.items())
    return f"workbench run --resume --output-dir {run_dir or '<run>'} --steps {','.join(steps)}{values}"

"""`workbench lab`: JupyterLab rooted at the outputs folder, on working copies of the step notebooks beside the runs.

The tracked notebooks stay the templates `workbench run` executes: the Lab never opens them, so its saves and
autosaves land in the copies (`<outputs>/lab/`), which are the user's and are never overwritten.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat

from workbench.core.config import OUTPUTS_VARIABLE, outputs_root
from workbench.report.notebook import NOTEBOOKS_DIR

LAB_FOLDER = "lab"
CHROMIUM = "/usr/bin/chromium"  # Debian's, which the browser checks and the docs' screenshots drive
# A closed network: no background connections, no first-run work.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def working_copies(root: Path, templates: Path = NOTEBOOKS_DIR) -> tuple[list[Path], list[Path]]:
    """Copy every template notebook (tools/ included) that `root/lab` lacks; return (copied, kept: copies whose
    code differs from their template, left as the user saved them)."""
    copied, kept = [], []
    for template in sorted(templates.rglob("*.ipynb")):
        if ".ipynb_checkpoints" in template.parts:
            continue
        copy = root / LAB_FOLDER / template.relative_to(templates)
        if not copy.exists():
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(template, copy)
            copied.append(copy)
        elif _code(copy) != _code(template):
            kept.append(copy)
    return copied, kept


def _code(path: Path) -> list[str]:
    """The sources of a notebook's code cells, its parameters cell left out (a user's values are theirs)."""
    notebook = nbformat.read(path, as_version=4)
    return [c.source for c in notebook.cells
            if c.cell_type == "code" and "parameters" not in c.metadata.get("tags", [])]


def lab_command(root: Path, extra: list[str]) -> list[str]:
    """`jupyter lab` rooted at `root`, opening its lab/ folder; as root too (containers, cloud notebooks)."""
    as_root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    return [str(Path(sys.executable).with_name("jupyter")), "lab", f"--ServerApp.root_dir={root}",
            f"--LabApp.default_url=/lab/tree/{LAB_FOLDER}", *as_root, *extra]


def started_lab(root: Path, port: int, token: str, state: Path, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """JupyterLab on `root`, 127.0.0.1 only, with fresh workspace state under `state`, in its own process group;
    returns once it answers (SystemExit if it does not within 2 minutes)."""
    command = lab_command(root, ["--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
                                 f"--IdentityProvider.token={token}", f"--LabApp.workspaces_dir={state}", *extra])
    lab = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                           env={**os.environ, OUTPUTS_VARIABLE: str(root)})
    for _ in range(240):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=5)
            return lab
        except OSError:
            if lab.poll() is not None:
                raise SystemExit(f"JupyterLab exited with status {lab.returncode}") from None
            time.sleep(0.5)
    os.killpg(lab.pid, signal.SIGTERM)
    raise SystemExit("JupyterLab did not answer within 2 minutes")


def lab(extra: list[str]) -> int:
    """Prepare the working copies, say where everything is, then become JupyterLab."""
    root = outputs_root().resolve()
    copied, kept = working_copies(root)
    print(f"JupyterLab on {root}: the step notebooks in {LAB_FOLDER}/ (copied now: {len(copied)}), the runs beside "
          "them; the tracked notebooks/ stay the templates `workbench run` executes")
    for path in kept:
        template = NOTEBOOKS_DIR / path.relative_to(root / LAB_FOLDER)
        print(f"kept your edited {path.relative_to(root)}; its template is {template} (delete the copy to get the "
              "template's again)")
    command = lab_command(root, extra)
    os.execve(command[0], command, {**os.environ, OUTPUTS_VARIABLE: str(root)})

"""`make lab-check`: a real browser runs the step notebooks in JupyterLab as a user does, and says what it saw.

Headless Chromium (Debian's) opens `workbench lab`'s working copies in a fresh outputs folder, changes one parameter
in 01 (`sequence_max = 128`, typed into the cell), then per notebook clicks Run -> Run All Cells, waits until the
kernel is idle, saves (Ctrl+S), and counts from the saved file and the page: cells, seconds, error outputs, plotly
figures (in the file, and drawn on the page), progress bars that did not finish, and whether the notebook's first
output names the run and `sequence.max 128 (01_export.ipynb)`, then closes it and shuts its kernel down. 09's report
must load inside its frame. No saved notebook may hold a widget (blank once saved, an error once reopened); every
saved one is reopened to check it shows no widget error.

It touches nothing of the user's: the runs go to a scratch outputs folder, the triton and generation steps publish
into a scratch repository in it ($WORKBENCH_REPOSITORY), and the checkout's model_repository/ and outputs/ are hashed
before and after (a difference fails the check). The scratch folder is removed at the end unless --keep; the
screenshots and lab-check.json stay in a small folder of their own, printed at the end.

    python tests/browser/lab_check.py [--out FOLDER] [--keep] [--notebooks 01,02,03]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import nbformat
from playwright.sync_api import Locator, Page, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from workbench.core.atomic import sha256_file
from workbench.core.config import RunConfig
from workbench.core.estimate import clock
from workbench.core.progress import Heartbeat
from workbench.lab import CHROMIUM, CHROMIUM_ARGS, LAB_FOLDER, started_lab, working_copies
from workbench.serving.plan import PROJECT_REPOSITORIES
from workbench.serving.server import free_port
from workbench.serving.settings import REPOSITORY_VARIABLE
from workbench.steps import specs

USERS = (PROJECT_REPOSITORIES, PROJECT_REPOSITORIES.parent / "outputs")  # what the check must leave as it was

VIEWPORT = {"width": 1600, "height": 1000}
HEARTBEAT_S = 30.0  # a notebook running longer says so this often
EDIT = "sequence_max = 128"
SET_BY = "sequence.max 128 (01_export.ipynb)"
ACTIVE = ".jp-NotebookPanel:not(.lm-mod-hidden)"  # the notebook in view (others stay in the DOM, hidden)
BAR = re.compile(r"(\d+)/(\d+) \[")  # a text bar's count, e.g. `12/80 [00:03<...`


@dataclass
class Seen:
    """What the browser saw of one notebook."""

    notebook: str
    cells: int
    seconds: float
    errors: int
    plots: int
    drawn: int
    unfinished_bars: int
    widgets: int
    inherited: bool
    ends_with_next: bool  # its last output names the notebook to open next (09: where the report is)
    report_framed: bool | None
    screenshot: str

    def line(self) -> str:
        """What the browser saw, in one line."""
        bars = f", {self.unfinished_bars} unfinished bars" if self.unfinished_bars else ""
        widgets = f", {self.widgets} widgets saved" if self.widgets else ""
        return (f"{self.notebook}: {self.cells} cells in {self.seconds:.0f} s, {self.errors} errors, plots drawn "
                f"{self.drawn} of {self.plots}{bars}{widgets}, settings {'' if self.inherited else 'NOT '}inherited, "
                f"{'ends naming the next' if self.ends_with_next else 'does NOT end naming the next'}")


def run_all(page: Page, root: Path, notebook: str, port: int, token: str, shots: Path, edit: str | None) -> Seen:
    """Open `notebook` (a reset workspace: the Lab reopens no closed tab), optionally replace its parameters cell,
    Run All through the menu, wait, save, look."""
    page.goto(f"http://127.0.0.1:{port}/lab/tree/{LAB_FOLDER}/{notebook}?token={token}&reset")
    panel = page.locator(ACTIVE)
    panel.locator(".jp-Cell").first.wait_for(timeout=120_000)
    wait_idle(panel, 120)
    news = page.get_by_role("button", name="No", exact=True)  # JupyterLab's news feed: not for a closed network
    if news.count():
        news.first.click()
    if edit is not None:
        parameters = panel.locator(".jp-CodeCell").first.locator(".cm-content")
        parameters.click()
        page.keyboard.press("Control+a")
        page.keyboard.type(edit)
        page.keyboard.press("Escape")
    started = time.monotonic()
    print(f"{notebook}: Run All Cells", flush=True)
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    page.wait_for_timeout(2_000)
    with Heartbeat(lambda: f"{notebook}: still running, {clock(time.monotonic() - started)}", quiet=HEARTBEAT_S):
        wait_idle(panel, 3_600)
    seconds = time.monotonic() - started
    page.keyboard.press("Control+s")
    page.wait_for_timeout(2_000)
    drawn = panel.locator(".jp-OutputArea .js-plotly-plot").count()
    shot = shots / notebook.replace(".ipynb", ".png")
    panel.locator(".jp-Cell").last.scroll_into_view_if_needed()  # its ending in view: the verdict and what next
    panel.locator(".jp-Cell").last.locator(".jp-OutputArea").last.scroll_into_view_if_needed()
    page.wait_for_timeout(1_000)
    page.screenshot(path=str(shot))
    framed = report_in_frame(panel) if notebook.startswith("09") else None
    running = kernels_left(port, token)
    page.locator(".lm-MenuBar-itemLabel", has_text="File").first.click()  # its kernel goes: memory for the next
    page.locator(".lm-Menu-itemLabel", has_text="Close and Shut Down Notebook").first.click()
    try:  # the dialog asking to shut the kernel down
        page.locator(".jp-Dialog .jp-Dialog-button.jp-mod-accept").last.click(timeout=10_000)
    except PlaywrightTimeout:
        print(f"{notebook}: no dialog to shut its kernel down", flush=True)
    deadline = time.monotonic() + 30  # a kernel that ran a step takes seconds to shut down
    while kernels_left(port, token) >= running and time.monotonic() < deadline:
        page.wait_for_timeout(500)
    saved = nbformat.read(root / LAB_FOLDER / notebook, as_version=4)
    outputs = [o for c in saved.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    first = next((c for c in saved.cells if c.cell_type == "code" and "start(globals()" in c.source), None)
    opened = "".join(o.get("text", "") for o in (first.outputs if first else []))
    ending = "".join(o.get("text", "") for o in saved.cells[-1].get("outputs", []))
    return Seen(notebook, len(saved.cells), round(seconds, 1), sum(o.output_type == "error" for o in outputs),
                sum("application/vnd.plotly.v1+json" in o.get("data", {}) for o in outputs), drawn,
                unfinished("".join(o.get("text", "") for o in outputs if o.output_type == "stream")),
                sum("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs),
                SET_BY in opened, bool(re.search(r"^(next: open \d\d_\w+\.ipynb|this was the last step)", ending,
                                                 re.MULTILINE)), framed, str(shot))


def wait_idle(panel: Locator, limit_s: float) -> None:
    """Until the notebook's kernel reports idle and no cell shows `[*]` on three looks in a row."""
    quiet, deadline = 0, time.monotonic() + limit_s
    while quiet < 3:
        if time.monotonic() > deadline:
            raise SystemExit(f"the notebook was still running after {limit_s:.0f} s")
        busy = panel.locator(".jp-Notebook-ExecutionIndicator[data-status='busy']").count() or any(
            "[*]" in text for text in panel.locator(".jp-InputArea-prompt").all_inner_texts())
        quiet = 0 if busy else quiet + 1
        panel.page.wait_for_timeout(1_000)


def unfinished(text: str) -> int:
    """Text bars whose last drawn state is short of their total, in a notebook's streams joined (a bar's updates
    can land in several outputs)."""
    lasts: dict[str, tuple[int, int]] = {}
    for piece in re.split(r"[\r\n]", text):
        found = BAR.search(piece)
        if found:
            lasts[piece.split(":")[0]] = (int(found.group(1)), int(found.group(2)))
    return sum(done < total for done, total in lasts.values())


def reopened_clean(page: Page, notebooks: list[str], port: int, token: str) -> bool:
    """Each saved notebook opened again in a new page shows no widget error."""
    clean = True
    for notebook in notebooks:
        page.goto(f"http://127.0.0.1:{port}/lab/tree/{LAB_FOLDER}/{notebook}?token={token}&reset")
        page.locator(ACTIVE).locator(".jp-Cell").first.wait_for(timeout=120_000)
        page.wait_for_timeout(3_000)
        content = page.locator(ACTIVE).inner_text()
        clean = clean and "Error displaying widget" not in content and "model not found" not in content
    return clean


def kernels_left(port: int, token: str) -> int:
    """Kernels the Lab still runs (each notebook's was shut down as it closed)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/kernels?token={token}", timeout=30) as answer:
        return len(json.load(answer))


def sessions_left(port: int, token: str) -> list[str]:
    """The notebooks whose kernels the Lab still runs."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/sessions?token={token}", timeout=30) as answer:
        return [session["path"] for session in json.load(answer)]


def report_in_frame(panel: Locator) -> bool:
    """09's report.html loaded inside its output frame (served by the Lab's own server)."""
    frame = panel.frame_locator(".jp-OutputArea iframe").first
    try:
        frame.locator("h1").first.wait_for(timeout=30_000)
        return True
    except PlaywrightTimeout:  # the frame stayed empty
        return False


STOPPED: list[int] = []  # the signal that stopped the check, once one did


def _stop(signum: int, _frame: object) -> None:
    """Stop the check: what playwright's event loop and driver say as they are torn down midway (pending tasks, a
    closed connection) is no news to the user who stopped it, so it goes unsaid."""
    if not STOPPED:
        STOPPED.append(signum)
        logging.getLogger("asyncio").disabled = True
        sys.unraisablehook = lambda _unraisable: None
        raise KeyboardInterrupt(signal.Signals(signum).name)


def tree_hashes(folder: Path) -> dict[str, str]:
    """Every file under `folder` by relative path, with its sha256 (links by their target)."""
    if not folder.is_dir():
        return {}
    return {str(p.relative_to(folder)): (f"-> {os.readlink(p)}" if p.is_symlink() else sha256_file(p))
            for p in sorted(folder.rglob("*")) if p.is_file() or p.is_symlink()}


def chosen(parser: argparse.ArgumentParser, asked: str | None) -> list[str]:
    """The step notebooks `--notebooks` names (`1`, `01`, `export`), in run order; a name no notebook has is a usage
    error listing them, before the Lab starts."""
    notebooks = [s.notebook for s in specs()]
    if not asked:
        return notebooks
    found, unknown = set(), []
    for word in (w.strip() for w in asked.split(",") if w.strip()):
        match = [n for n in notebooks if (word.isdigit() and int(n[:2]) == int(word)) or n[3:].removesuffix(
            ".ipynb") == word or n == word]
        if match:
            found.update(match)
        else:
            unknown.append(word)
    if unknown or not found:
        parser.error(f"--notebooks {asked}: no step notebook {', '.join(unknown) or 'named'}; choose among "
                     f"{', '.join(notebooks)} (by number or step, e.g. --notebooks 1,2 or export,optimize)")
    return [n for n in notebooks if n in found]


def main() -> int:
    for signum in (signal.SIGTERM, signal.SIGINT):  # stopped: the Lab, its kernels and the scratch folder go too
        signal.signal(signum, _stop)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="outputs folder for the Lab (default: a new temporary one)")
    parser.add_argument("--notebooks", help="the notebooks to run, by number or step, e.g. 1,2,03 or export,optimize "
                                            "(default: every step notebook)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch outputs folder (runs, repository)")
    args = parser.parse_args()
    if args.out is not None and args.out.resolve() in [p.resolve() for p in USERS]:
        raise SystemExit(f"--out {args.out} is the checkout's own folder: pass a scratch folder")
    if args.out is not None and args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"--out {args.out} already holds files, which the check would remove: pass a new or empty "
                         "folder")
    wanted = chosen(parser, args.notebooks)  # a bad choice is refused before anything is made
    before = {folder: tree_hashes(folder) for folder in USERS}
    root = (args.out or Path(tempfile.mkdtemp(prefix="lab-check-"))).resolve()
    root.mkdir(parents=True, exist_ok=True)
    os.environ[REPOSITORY_VARIABLE] = str(root / "model_repository")  # the Lab's kernels publish there
    working_copies(root)
    run = root / f"interactive-{RunConfig().model_slug}"
    shots = Path(tempfile.mkdtemp(prefix="lab-check-shots-"))
    port, token, state = free_port(), secrets.token_hex(16), Path(tempfile.mkdtemp(prefix="lab-state-"))
    print(f"starting JupyterLab on 127.0.0.1:{port} over {root} and headless Chromium", flush=True)
    lab = started_lab(root, port, token, state)
    seen: list[Seen] = []
    try:
        with sync_playwright() as driver:
            browser = driver.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            context = browser.new_context(viewport=VIEWPORT)
            page = context.new_page()
            for notebook in wanted:
                edit = EDIT if notebook.startswith("01") else None  # a setting in 01 that later notebooks inherit
                seen.append(run_all(page, root, notebook, port, token, shots, edit))
                print(seen[-1].line(), flush=True)
            framed = seen[-1].report_framed
            left = sessions_left(port, token)
            clean = reopened_clean(context.new_page(), wanted, port, token)
            browser.close()
    except BaseException:  # interrupted, or the Lab failed: nothing of the check is left behind unless --keep
        os.killpg(lab.pid, signal.SIGTERM)  # the Lab and its kernels first: a dying kernel still writes its run
        lab.wait(timeout=60)
        for folder in ([] if args.keep else [root]) + [shots]:
            shutil.rmtree(folder, ignore_errors=True)
        print(f"stopped: the Lab and its kernels ended; the scratch folder {root} {'kept' if args.keep else 'removed'}"
              f", the screenshots ({shots}) removed", flush=True)
        raise
    finally:
        if lab.poll() is None:
            os.killpg(lab.pid, signal.SIGTERM)
            lab.wait(timeout=60)
        shutil.rmtree(state, ignore_errors=True)
    config = json.loads((run / "run.json").read_text())["config"] if (run / "run.json").is_file() else {}
    evidence = (run if args.keep else shots) / "lab-check"
    evidence.mkdir(parents=True, exist_ok=True)
    for item in seen:
        item.screenshot = str(shutil.move(item.screenshot, evidence / Path(item.screenshot).name))
    if args.keep:
        shutil.rmtree(shots, ignore_errors=True)
    touched = [str(folder) for folder in USERS if tree_hashes(folder) != before[folder]]
    published = sorted(p.name for p in (root / "model_repository").glob("*"))
    verdict = {"notebooks": [asdict(s) for s in seen], "report_in_frame": framed, "reopened_without_widget_errors":
               clean, "kernels_left": left, "run_sequence_max": config.get("sequence", {}).get("max"),
               "published_in_scratch": published, "users_folders_changed": touched}
    (evidence / "lab-check.json").write_text(json.dumps(verdict, indent=1), encoding="utf-8")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    print("| notebook | cells | seconds | errors | plots (file / drawn) | unfinished bars | widgets saved | "
          "settings inherited | ends naming the next |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in seen:
        print(f"| {s.notebook} | {s.cells} | {s.seconds:.0f} | {s.errors} | {s.plots} / {s.drawn} | "
              f"{s.unfinished_bars} | {s.widgets} | {'yes' if s.inherited else 'NO'} | "
              f"{'yes' if s.ends_with_next else 'NO'} |")
    shown = {True: "yes", False: "NO", None: "not looked at (09_report.ipynb did not run)"}[framed]
    print(f"report in its frame: {shown}; reopened without widget errors: {clean}; kernels left running: "
          f"{len(left)} {left}; run.json sequence.max: {verdict['run_sequence_max']}; published in the scratch "
          f"repository: {published}; the checkout's folders changed: {touched or 'none'}; scratch folder "
          f"{root if args.keep else 'removed'}; screenshots and lab-check.json: {evidence}")
    ok = all(s.errors == 0 and s.unfinished_bars == 0 and s.widgets == 0 and s.inherited and s.ends_with_next
             for s in seen) and clean \
        and framed is not False and not left and verdict["run_sequence_max"] == 128 and not touched
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except (KeyboardInterrupt, Exception):  # stopped: what ended and what was removed is said above
        if not STOPPED:
            raise
        raise SystemExit(128 + STOPPED[0]) from None

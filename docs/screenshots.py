"""Screenshots for the README, from a finished run: JupyterLab showing an executed step notebook, and the top of the
run's report (the recommendation); or the top of a `workbench compare` page.

    python docs/screenshots.py outputs/<run> [--notebook 03_parity.ipynb]
    python docs/screenshots.py --compare <folder>/compare.html

Needs Debian's Chromium (`apt-get install chromium`) and the `docs` extra (Playwright drives it); writes
docs/jupyterlab-notebook.png and docs/report-recommendation.png, or docs/compare-page.png.
"""
from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from workbench.serving.server import free_port

DOCS = Path(__file__).resolve().parent
CHROMIUM = "/usr/bin/chromium"
# A closed network: no background connections, no first-run work.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1500, "height": 1000}


def start_lab(root: Path, port: int, token: str, state: Path) -> subprocess.Popen:
    """JupyterLab on `root`, 127.0.0.1 only, with fresh workspace state under `state`, in its own process group;
    returns once it answers."""
    command = [str(Path(sys.executable).with_name("jupyter")), "lab", "--no-browser", f"--port={port}",
               "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
               f"--LabApp.workspaces_dir={state}"]
    if os.geteuid() == 0:
        command.append("--allow-root")
    lab = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    for _ in range(240):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=5)
            return lab
        except OSError:
            if lab.poll() is not None:
                raise SystemExit(f"JupyterLab exited with status {lab.returncode}")
            time.sleep(0.5)
    os.killpg(lab.pid, signal.SIGTERM)
    raise SystemExit("JupyterLab did not answer within 2 minutes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, nargs="?", help="a run folder with notebooks/ and report.html")
    parser.add_argument("--notebook", default="03_parity.ipynb", help="executed notebook to show in JupyterLab")
    parser.add_argument("--compare", type=Path, help="a compare.html to show instead of a run")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    if args.compare:
        with sync_playwright() as driver:
            browser = driver.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport=VIEWPORT)
            page.goto(args.compare.resolve().as_uri())
            page.wait_for_selector(".plotly", timeout=60_000)
            page.wait_for_timeout(2_000)
            page.screenshot(path=str(DOCS / "compare-page.png"))
            browser.close()
        print(f"wrote {DOCS / 'compare-page.png'}")
        return
    if args.run is None:
        parser.error("pass a run folder, or --compare <compare.html>")

    run = args.run.resolve()
    port, token = free_port(), secrets.token_hex(16)
    state = Path(tempfile.mkdtemp(prefix="workbench-lab-"))
    lab = start_lab(run / "notebooks", port, token, state)
    try:
        with sync_playwright() as driver:
            browser = driver.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport=VIEWPORT)
            page.goto(f"http://127.0.0.1:{port}/lab/tree/{args.notebook}?token={token}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            page.wait_for_timeout(5_000)
            for answer in ("No Kernel", "No"):  # a kernel is not needed to show outputs; no news feed either
                button = page.get_by_role("button", name=answer, exact=True)
                if button.count():
                    button.first.click()
            page.locator(".jp-Notebook .jp-Cell").first.click()
            page.keyboard.press("Escape")  # command mode: `j` selects the next cell and scrolls it into view
            for _ in range(page.locator(".jp-Notebook .jp-Cell").count()):
                page.keyboard.press("j")
                page.wait_for_timeout(300)
            page.wait_for_timeout(4_000)  # let plotly draw the figures in view
            page.screenshot(path=str(DOCS / "jupyterlab-notebook.png"))
            page.goto((run / "report.html").as_uri())
            page.wait_for_selector("table", timeout=60_000)
            page.screenshot(path=str(DOCS / "report-recommendation.png"))
            browser.close()
    finally:
        os.killpg(lab.pid, signal.SIGTERM)
        lab.wait(timeout=60)
        shutil.rmtree(state, ignore_errors=True)
    print(f"wrote {DOCS / 'jupyterlab-notebook.png'} and {DOCS / 'report-recommendation.png'}")


if __name__ == "__main__":
    main()

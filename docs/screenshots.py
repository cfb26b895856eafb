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
import tempfile
from pathlib import Path

from workbench.lab import CHROMIUM, CHROMIUM_ARGS, started_lab
from workbench.serving.server import free_port

DOCS = Path(__file__).resolve().parent
VIEWPORT = {"width": 1500, "height": 1000}


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
    lab = started_lab(run / "notebooks", port, token, state)
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

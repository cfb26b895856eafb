"""A benchmark's printed results as a markdown page (`--page FILE`): the date, this host's CPU and flags, the command,
then what it printed. Written whole once the benchmark ends well, never half (docs/results/ holds the project's)."""
from __future__ import annotations

import argparse
import io
import os
import shlex
import sys
import time
from collections.abc import Callable
from contextlib import redirect_stdout
from pathlib import Path

from workbench.core.atomic import write_text
from workbench.core.machine import cpu_features, cpu_model


class _Tee(io.TextIOBase):
    """Writes to the terminal and keeps a copy."""

    def __init__(self, terminal: io.TextIOBase) -> None:
        self.terminal, self.kept = terminal, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.terminal.write(text)

    def flush(self) -> None:
        self.terminal.flush()


def add_page_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--page", type=Path, help="also write what it prints as a markdown results page to this file "
                                                  "(e.g. docs/results/<name>.md; an existing file is replaced)")


def printed_to(page: Path | None, title: str, body: Callable[[], object]) -> None:
    """Run `body`; with a `page`, what it prints goes there too, under `title` and the host and command."""
    if page is None:
        body()
        return
    tee = _Tee(sys.stdout)  # type: ignore[arg-type]
    with redirect_stdout(tee):
        body()
    features = cpu_features()
    command = shlex.join(["python", *(os.path.relpath(a) if Path(a).exists() else a for a in sys.argv)])
    head = (f"# {title}\n\nMeasured {time.strftime('%Y-%m-%d')} on {cpu_model()}, {os.cpu_count()} vCPUs, CPU flags "
            f"`{' '.join(features.flags)}`, by `{command}` (written by the benchmark with `--page`; run it again "
            "on your host to compare: its ratios are this host's).\n\n")
    write_text(page, head + "```text\n" + tee.kept.getvalue().strip("\n") + "\n```\n")
    print(f"written: {page}")

"""Progress of long loops and steps: a tqdm bar where the loop runs (text on stdout in notebooks, so a reopened one
shows where each ended), a step's lines (`say`: what it wrote and recorded, with the time since it started) and,
under `workbench run`, both as lines in the file WORKBENCH_PROGRESS_FILE names, which the pipeline prints.

The step notebooks run in a kernel, a process of their own: the pipeline creates the file and names it in the
environment before papermill starts the kernel (`pipeline.ProgressTail`), and `Progress` in the kernel appends to
it. Without the variable nothing is written anywhere but the bar. Lines are throttled to one per `interval` per
bar, plus the last one; the time only decides what is shown, never what a loop does.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Collection, Iterator
from typing import Any, TypeVar

PROGRESS_FILE_VAR = "WORKBENCH_PROGRESS_FILE"
LINE_INTERVAL_S = 1.0  # at most one line per bar this often, plus the last one
INDENT = "    "
QUIET_S = 10.0  # a running step that said nothing this long says what it is still doing (`Heartbeat`)
T = TypeVar("T")
_text_bars = False  # set in notebooks: a saved notebook keeps a text bar's last state, never a widget's
_said_at = time.monotonic()  # when this process last said a line or moved a bar
_open: list[Progress] = []  # the bars open in this process, the innermost last
_closed: list[str] = []  # the labels of the bars closed in this process, in order


def use_text_bars() -> None:
    """Bars as text on stdout from now on (notebooks: reopened, they show where each bar ended, with no widget
    state to lose)."""
    global _text_bars
    _text_bars = True


class Progress:
    """`with Progress("repair int8", total=80, unit="candidates") as bar: ... bar.update(1, note="...")` shows
    `repair int8: 7/80 candidates (note)` as a bar and, when WORKBENCH_PROGRESS_FILE is set, as throttled lines."""

    def __init__(self, label: str, total: int, unit: str, interval: float = LINE_INTERVAL_S) -> None:
        self.label, self.total, self.unit, self.interval = label, total, unit, interval
        self.done = 0
        self.note = ""
        self._path = os.environ.get(PROGRESS_FILE_VAR) or None
        self._written: str | None = None
        self._written_at = 0.0
        self._bar: Any = None

    def line(self) -> str:
        return f"{self.label}: {self.done}/{self.total} {self.unit}" + (f" ({self.note})" if self.note else "")

    def __enter__(self) -> Progress:
        self._bar = tqdm_class()(total=self.total, desc=self.label, unit=self.unit,
                            **({"file": sys.stdout} if _text_bars else {}))  # a notebook's stdout: no red
        self._write()
        _open.append(self)
        return self

    def update(self, steps: int = 1, note: str | None = None) -> None:
        """Count `steps` more done; `note` (kept until the next one) says what was last done or found."""
        global _said_at
        self.done += steps
        _said_at = time.monotonic()
        if note is not None:
            self.note = note
            self._bar.set_postfix_str(note, refresh=False)
        self._bar.update(steps)
        if self.done >= self.total or time.monotonic() - self._written_at >= self.interval:
            self._write()

    def __exit__(self, *exc: object) -> None:
        _open.remove(self)
        _closed.append(self.label)
        if exc[0] is None and self.done < self.total:  # the work ended early (found, out of time): the bar finishes
            self.note = f"{self.note}; done at {self.done} of {self.total}" if self.note else \
                f"done at {self.done} of {self.total}"
            self.total = self.done
            self._bar.total = self.done
            self._bar.set_postfix_str(self.note, refresh=False)
            self._bar.refresh()
        if self._written != self.line():
            self._write()
        self._bar.close()

    def _write(self) -> None:
        """Append the current line to the pipeline's file; a file that is gone (the step ended) ends the lines."""
        self._written, self._written_at = self.line(), time.monotonic()
        if self._path is not None and not _append(self._path, self._written):
            self._path = None


def open_bar() -> str | None:
    """The innermost bar open in this process, in words (`on latency grid, 3/5 cells`), else None."""
    bar = _open[-1] if _open else None
    return f"on {bar.label}, {bar.done}/{bar.total} {bar.unit}" if bar else None


def closed_bars() -> tuple[int, str]:
    """How many bars this process has closed so far, and the label of the last ("" before any)."""
    return len(_closed), (_closed[-1] if _closed else "")


def say(line: str) -> None:
    """A line of a step's progress: printed where the step runs (its notebook keeps it) and, under `workbench run`,
    appended to the pipeline's file. Under an open text bar, on a line of its own above the bar (tqdm.write)."""
    global _said_at
    _said_at = time.monotonic()
    if _text_bars:
        from tqdm.std import tqdm as text_tqdm

        text_tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()
    else:
        print(line, flush=True)
    path = os.environ.get(PROGRESS_FILE_VAR)
    if path:
        _append(path, line)


class Heartbeat:
    """While active, `say(line())` whenever this process said nothing and moved no bar for `quiet` seconds: a long
    library call (a quantizer, a compiler, a model load) shows it is still at work (default: `QUIET_S`)."""

    def __init__(self, line: Callable[[], str], quiet: float | None = None) -> None:
        self.line, self.quiet = line, QUIET_S if quiet is None else quiet
        self._stop = threading.Event()
        self._since = 0.0  # when it started: quiet is counted from then at the earliest
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._since = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(min(1.0, self.quiet)):
            if time.monotonic() - max(_said_at, self._since) >= self.quiet:
                say(self.line())


def _append(path: str, line: str) -> bool:
    """Append `line` to the file at `path`; False where it is gone (the step ended): it is never created."""
    try:
        handle = os.open(path, os.O_WRONLY | os.O_APPEND)
    except OSError:
        return False
    try:
        os.write(handle, f"{line}\n".encode())
    finally:
        os.close(handle)
    return True


def track(items: Collection[T], label: str, unit: str, note: Callable[[T], str] = str) -> Iterator[T]:
    """Each of `items` in turn, counted in a `Progress` whose note names the item last done."""
    with Progress(label, total=len(items), unit=unit) as bar:
        for item in items:
            yield item
            bar.update(1, note=note(item))


def tqdm_class() -> Any:
    """tqdm.auto's bar (text for headless runs), without its warning that ipywidgets is missing."""
    from tqdm import TqdmWarning

    if _text_bars:
        from tqdm.std import tqdm as text_tqdm

        return text_tqdm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TqdmWarning)
        from tqdm.auto import tqdm
    return tqdm

"""Stop a run cleanly on SIGINT, SIGTERM or SIGHUP: interrupt the step's kernel, then end every process it started."""
from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workbench.core.errors import RunInterruptedError, WorkbenchError

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
GRACE_SECONDS = 5.0  # the kernel's own cleanup (servers stopped, temp files removed) gets this long
PARTIAL_PATTERNS = (".*.partial*", "candidate-*.onnx*")  # atomic writes in progress, repair candidates


class InterruptGuard:
    """While active, a signal interrupts the kernel (KeyboardInterrupt in the running cell) and, GRACE_SECONDS
    later or at a second signal, kills every process this one started (servers and their stubs included)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._seen: list[Any] = []
        self._timer: threading.Timer | None = None

    def __enter__(self) -> InterruptGuard:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._timer is not None:
            self._timer.cancel()
        if self.signum is not None:
            self.kill_descendants()

    @property
    def reason(self) -> str:
        return f"interrupted ({signal.Signals(self.signum).name})" if self.signum else ""

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            self.kill_descendants()
            return
        self.signum = signum
        self._seen = _descendants()
        for child in _children():
            _quietly(child.send_signal, signal.SIGINT)
        self._timer = threading.Timer(GRACE_SECONDS, self.kill_descendants)
        self._timer.daemon = True
        self._timer.start()

    def kill_descendants(self) -> None:
        """SIGKILL every process started below this one, each by its process group when it leads its own."""
        own_group = os.getpgrp()
        for process in {p.pid: p for p in [*self._seen, *_descendants()]}.values():
            try:
                group = os.getpgid(process.pid)
            except ProcessLookupError:
                continue
            if group != own_group and group == process.pid:
                _quietly(os.killpg, group, signal.SIGKILL)
            else:
                _quietly(process.kill)

    def check(self, where: str, fix: str = "re-run the steps that did not finish (--resume --output-dir <run> "
                                           "--steps <them>)") -> None:
        """Raise RunInterruptedError if a signal came (`where`: "during step 'parity'"); `fix` says how to go on."""
        if self.signum is not None:
            raise RunInterruptedError(f"the run was {self.reason} {where}", fix, self.signum)


def remove_partials(run_dir: Path) -> list[Path]:
    """Delete half-written files and folders (temp names of atomic writes, repair candidates) under `run_dir`."""
    removed = []
    for pattern in PARTIAL_PATTERNS:
        for path in sorted(run_dir.rglob(pattern), reverse=True):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _children() -> list[Any]:
    import psutil

    return psutil.Process().children()


def _descendants() -> list[Any]:
    import psutil

    return psutil.Process().children(recursive=True)


def _quietly(action: Any, *args: Any) -> None:
    import psutil

    try:
        action(*args)
    except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
        pass


def script_exit(body: Callable[[], None], interrupted: str) -> int:
    """How a benchmark script ends: 0 once `body` returns; a WorkbenchError as its message and fix, 2; SIGINT,
    SIGTERM or SIGHUP (SIGINT too where a background launch ignored it) as Ctrl-C, one line `interrupted (<signal>):
    <interrupted>`, 130 (what `body` started is stopped on the way out by its own `finally` and `with`)."""
    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)
    for sig in SIGNALS:
        signal.signal(sig, interrupt)
    try:
        body()
    except WorkbenchError as exc:
        print(f"error ({type(exc).__name__}): {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # abandoned requests of a load say nothing more
        print(f"interrupted ({stop or 'SIGINT'}): {interrupted}", file=sys.stderr)
        return 130
    return 0

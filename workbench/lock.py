"""One run per output folder: an exclusive lock on `<run>/.workbench.lock` holding the holder's PID. The operating
system releases it when the holder dies, however it dies, so a stale lock is taken over without asking."""
from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from workbench.core.errors import OutputDirError
from workbench.core.record import ensure_writable

LOCK_NAME = ".workbench.lock"


class RunLockedError(OutputDirError):
    """Another workbench run holds the output directory."""


@contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold `run_dir` for this process (creating the folder and missing parents; removing those again when they are
    left empty) or raise RunLockedError naming the holder's PID."""
    absolute = run_dir.absolute()
    created = [folder for folder in (absolute, *absolute.parents) if not folder.exists()]
    ensure_writable(run_dir)
    path = run_dir / LOCK_NAME
    descriptor = _acquire(path, run_dir)
    try:
        os.ftruncate(descriptor, 0)
        os.write(descriptor, f"{os.getpid()}\n".encode())
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(descriptor)
        for folder in created:  # innermost first: a parent goes only once what this run made inside it went
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()


def _acquire(path: Path, run_dir: Path) -> int:
    """A descriptor of the lock file, locked; retried when the holder removed the file between open and lock."""
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by kernels or servers
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(descriptor, 32).decode(errors="replace").strip() or "unknown"
            os.close(descriptor)
            raise RunLockedError(f"output directory {run_dir} is in use by another workbench run (PID {holder})",
                                 f"wait for it to finish or stop it (kill {holder}), or choose another --output-dir"
                                 ) from None
        try:
            if os.fstat(descriptor).st_ino == path.stat().st_ino:
                return descriptor
        except FileNotFoundError:
            pass
        os.close(descriptor)

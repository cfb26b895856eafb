"""Write files and folders under a temporary name and rename them when complete.

Temporary files and folders are created with the modes `open(..., "w")` and `mkdir` ask for (0o666, 0o777; 0o777
for executable files), so the kernel applies the process umask (and any default ACL) as it does for ordinary files:
0644 / 0755 under the usual umask 022. The umask is never read or changed, so there is no race with other threads.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any


def _beside(dest: Path, create: Callable[[Path], None]) -> Path:
    """A new path beside `dest`, named `.<name>.<random>.partial`, made by `create` (which fails if it exists)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    while True:
        candidate = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.partial")
        try:
            create(candidate)
            return candidate
        except FileExistsError:
            continue


def temporary_dir(dest: Path | str) -> Path:
    """A new empty folder beside `dest`, with the mode `mkdir` gives (0o777 less the umask)."""
    return _beside(Path(dest), Path.mkdir)


def _temporary_file(dest: Path, executable: bool) -> Path:
    """A new empty file beside `dest`, with the mode `open(..., "w")` gives (0o666, or 0o777, less the umask)."""
    def create(path: Path) -> None:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o777 if executable else 0o666))

    return _beside(dest, create)


@contextmanager
def atomic_path(dest: Path | str, executable: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `dest`; rename it onto `dest` only if the block succeeds. Write into the file
    (opening it truncates and keeps its mode); replacing it with a new file gives that file's mode instead."""
    dest = Path(dest)
    tmp = _temporary_file(dest, executable)
    try:
        yield tmp
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_dir(dest: Path | str) -> Iterator[Path]:
    """Yield a temporary folder beside `dest`; it replaces `dest` only if the block succeeds."""
    dest = Path(dest)
    tmp = temporary_dir(dest)
    try:
        yield tmp
        old = None
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            os.replace(dest, old)
        os.replace(tmp, dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_text(dest: Path | str, text: str) -> Path:
    """Write `text` atomically; a script (text starting with `#!`) is made executable, as `chmod +x` would."""
    with atomic_path(dest, executable=text.startswith("#!")) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(dest)


def write_marked(dest: Path, text: str, mark: str, what: str) -> Path:
    """`text` (whose first line holds `mark`) into `dest`, unless a file there lacks the mark: one a person made,
    refused (OutputDirError naming `what` wrote the marked ones) rather than replaced."""
    from workbench.core.errors import OutputDirError

    if dest.exists() and (not dest.is_file() or mark not in dest.read_text(errors="replace")[:300]):
        raise OutputDirError(f"{dest} exists and is not {what}", "pass another path, or move that one away")
    return write_text(dest, text)


def _finite(value: Any) -> Any:
    """JSON has no NaN/Infinity: non-finite floats become null (counts of them are recorded separately)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(dest: Path | str, data: Any) -> Path:
    return write_text(dest, json.dumps(_finite(data), indent=2, allow_nan=False, default=str) + "\n")


def sha256_file(path: Path | str, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@lru_cache(maxsize=8)
def _tree_checksum(folder: str, stamp: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for name, _, _ in stamp:
        digest.update(name.encode("utf-8"))
        digest.update(sha256_file(Path(folder) / name).encode())
    return digest.hexdigest()


def tree_checksum(folder: Path) -> str:
    """sha256 over every file below `folder` (relative names and contents); recomputed only when a file's size or
    time changed."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    stamp = tuple((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _tree_checksum(str(folder), stamp)

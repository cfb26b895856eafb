"""Room on disk: what a full filesystem is called (DiskFullError naming the file and the free space), and the
check before a run that there is room for what it will write."""
from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from workbench.core.errors import DiskFullError

FULL = (errno.ENOSPC, errno.EDQUOT)
FIX = "free space on that filesystem, or pass an --output-dir on one with more room"


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem `path` is (or would be) on: its nearest existing folder's."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def megabytes(count: int) -> str:
    return f"{count / 1e6:,.1f} MB"


def as_disk_full(exc: BaseException, where: Path) -> DiskFullError | None:
    """The DiskFullError an OSError for a full disk or quota means (naming its file, else `where`), else None."""
    if not isinstance(exc, OSError) or exc.errno not in FULL:
        return None
    path = Path(exc.filename) if exc.filename else Path(where)
    return DiskFullError(f"no space left writing {path} ({megabytes(free_bytes(path))} free on its filesystem)", FIX)


@contextmanager
def disk_full_typed(where: Path) -> Iterator[None]:
    """Raise a full disk inside the block as DiskFullError."""
    try:
        yield
    except OSError as exc:
        typed = as_disk_full(exc, where)
        if typed is None:
            raise
        raise typed from None


def require_free(folder: Path, needed: int, what: str) -> None:
    """Refuse when `folder`'s filesystem has less than `needed` bytes free for `what`."""
    free = free_bytes(folder)
    if free < needed:
        raise DiskFullError(f"{what} needs about {megabytes(needed)} in {folder}; its filesystem has "
                            f"{megabytes(free)} free", FIX)

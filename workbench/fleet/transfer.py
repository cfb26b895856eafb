"""A run folder from a node to the driver, whole or not at all: packed on the node with a checksum per file and
one over the pack, checked on the driver, unpacked beside its destination and moved into place in one rename."""
from __future__ import annotations

import hashlib
import io
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from workbench.core.errors import OutputDirError
from workbench.fleet.errors import TransferError


@dataclass(frozen=True)
class PackedRun:
    """A run folder as bytes (an uncompressed tar: ONNX weights do not compress), each file's sha256, and the
    pack's own."""

    data: bytes
    files: dict[str, str]  # relative path -> sha256
    sha256: str


def _digest(path: Path) -> str:
    found = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            found.update(block)
    return found.hexdigest()


def pack(folder: Path) -> PackedRun:
    """Every file under `folder` (links and other non-files refused: a run folder holds none)."""
    files: dict[str, str] = {}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(folder.rglob("*")):
            relative = path.relative_to(folder).as_posix()
            if path.is_symlink() or not (path.is_file() or path.is_dir()):
                raise TransferError(f"{path} is not a plain file or folder", "a run folder holds only those")
            tar.add(path, arcname=relative, recursive=False)
            if path.is_file():
                files[relative] = _digest(path)
    data = buffer.getvalue()
    return PackedRun(data, files, hashlib.sha256(data).hexdigest())


def install(packed: PackedRun, destination: Path) -> Path:
    """Unpack `packed` into `destination` (which must not exist) after checking the pack's checksum and then every
    file's: on any mismatch, or when interrupted, nothing is left there or beside it."""
    if hashlib.sha256(packed.data).hexdigest() != packed.sha256:
        raise TransferError(f"the run for {destination} arrived damaged (its pack's checksum differs)",
                            "run the sweep again: the cell is measured again")
    if destination.exists():
        raise OutputDirError(f"{destination} exists", "move it away, or pass another --output-root")
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".incoming-{destination.name}-", dir=destination.parent))
    try:
        with tarfile.open(fileobj=io.BytesIO(packed.data), mode="r") as tar:
            tar.extractall(staging, filter="data")
        found = {p.relative_to(staging).as_posix(): _digest(p) for p in staging.rglob("*") if p.is_file()}
        if found != packed.files:
            wrong = sorted(set(found) ^ set(packed.files)) or sorted(k for k in found if found[k] != packed.files[k])
            raise TransferError(f"the run for {destination} arrived damaged ({wrong[0]} differs from the node's)",
                                "run the sweep again: the cell is measured again")
        os.replace(staging, destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return destination

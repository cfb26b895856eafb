"""Reference outputs kept between runs: what a reference runner (the PyTorch module, the model's own library)
returned on a lab's batches, keyed by what decides them: the runner's identity (the model's files, the library
call, versions) and every batch's token arrays. A second run of the same model on the same texts reads them instead
of running the model again; a changed model, tokenizer, text, cut or batch misses. Files are written whole
(temporary name, then rename) and the oldest go once the folder holds more than `MAX_BYTES`."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from workbench.core.atomic import atomic_path
from workbench.models.batches import Batch

MAX_BYTES = 4 << 30  # the folder's size past which the least recently used entries go
CACHE_VARIABLE = "XDG_CACHE_HOME"


def default_folder() -> Path:
    """$XDG_CACHE_HOME/transformer-workbench/reference, else ~/.cache/transformer-workbench/reference."""
    root = Path(os.environ.get(CACHE_VARIABLE) or Path.home() / ".cache")
    return root / "transformer-workbench" / "reference"


def cache_key(identity: str, batches: list[Batch]) -> str:
    """sha256 of the runner's identity and, per batch, its text ids and token arrays (names, shapes, values)."""
    digest = hashlib.sha256(identity.encode("utf-8"))
    for batch in batches:
        digest.update(repr(batch.text_ids).encode())
        for name in sorted(batch.feed):
            array = np.ascontiguousarray(batch.feed[name])
            digest.update(f"{name}{array.shape}{array.dtype}".encode())
            digest.update(array.tobytes())
    return digest.hexdigest()


class ReferenceCache:
    """Reference outputs per key in `folder` (one .npz per key)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.npz"

    def load(self, key: str, batches: int) -> list[dict[str, np.ndarray]] | None:
        """The outputs of `batches` batches stored under `key`, or None (none stored, or unreadable)."""
        path = self.path(key)
        try:
            with np.load(path) as stored:
                found: list[dict[str, np.ndarray]] = [{} for _ in range(batches)]
                for name in stored.files:
                    index, output = name.split("/", 1)
                    found[int(index)][output] = stored[name]
        except (OSError, ValueError, KeyError, IndexError):
            return None
        os.utime(path)  # recently used: the last to go
        return found if all(found) else None

    def save(self, key: str, expected: list[dict[str, np.ndarray]]) -> None:
        """Store `expected` under `key` (whole or not at all), then keep the folder under MAX_BYTES."""
        self.folder.mkdir(parents=True, exist_ok=True)
        arrays = {f"{index}/{name}": value for index, outputs in enumerate(expected) for name, value in outputs.items()}
        with atomic_path(self.path(key)) as tmp, open(tmp, "wb") as handle:
            np.savez(handle, **arrays)
        self.trim()

    def trim(self) -> None:
        entries = sorted(self.folder.glob("*.npz"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in entries)
        for path in entries[:-1]:  # the newest stays, however large
            if total <= MAX_BYTES:
                break
            total -= path.stat().st_size
            path.unlink(missing_ok=True)

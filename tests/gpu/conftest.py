"""GPU tests: run with `make test-gpu` on an NVIDIA host installed with EXTRAS=gpu,serve,generation,dev."""
from __future__ import annotations

from pathlib import Path

import pytest

from workbench.core.machine import gpu_name


def pytest_collection_modifyitems(config, items):
    if gpu_name() is None:
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU (nvidia-smi found none)")
        here = Path(__file__).parent
        for item in items:
            if here in Path(item.fspath).parents:
                item.add_marker(skip)

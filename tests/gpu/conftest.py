"""GPU tests: run with `make test-gpu` (or `make gpu-check`) on an NVIDIA host installed with
EXTRAS=gpu,serve,generation,dev. Without a GPU they are skipped, unless WORKBENCH_REQUIRE_GPU=1 (`make gpu-check`
sets it): then the run stops at once, since a check of GPU paths with none run is no check."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from workbench.core.machine import gpu_name


def pytest_collection_modifyitems(config, items):
    if gpu_name() is None and os.environ.get("WORKBENCH_REQUIRE_GPU") == "1":
        raise pytest.UsageError("no NVIDIA GPU here (nvidia-smi found none): make gpu-check needs one; "
                                "`workbench doctor` shows what this machine can run")
    if gpu_name() is None:
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU (nvidia-smi found none)")
        here = Path(__file__).parent
        for item in items:
            if here in Path(item.fspath).parents:
                item.add_marker(skip)

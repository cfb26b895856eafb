"""Typed errors of running a graph: a GPU session that came back on the CPU."""
from __future__ import annotations

from workbench.core.errors import WorkbenchError


class CudaFallbackError(WorkbenchError):
    """A session asked for a GPU provider was created without it (ONNX Runtime fell back to the CPU): the step
    fails, it is not a skip, since what was asked for did not run."""

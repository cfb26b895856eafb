"""Typed errors of measuring: no stable window, runners on two devices."""
from __future__ import annotations

from workbench.core.errors import WorkbenchError


class UnstableMeasurementError(WorkbenchError):
    """perf_analyzer found no stable measurement window within its trials."""


class DeviceMismatchError(WorkbenchError):
    """Two measurements from different devices were about to be compared as if they were one."""

"""Typed errors of cluster sweeps: the cluster, its nodes, the run folders they send back."""
from __future__ import annotations

from workbench.core.errors import WorkbenchError


class ClusterError(WorkbenchError):
    """A sweep's Ray cluster cannot do what the sweep asks: unreachable, no node of a host kind, a node lost."""


class TransferError(WorkbenchError):
    """A run folder packed on a cluster node does not match its checksums on the driver: nothing of it was kept."""

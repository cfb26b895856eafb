"""The API front's Prometheus metrics (`GET /metrics`), per route: requests by status, tokens, requests in the front,
and the latency of the whole request and of its Triton part. With several front processes (`--workers`) each writes
prometheus_client's multiprocess files and any one answers for all (PROMETHEUS_MULTIPROC_DIR, set before the import).
Imports nothing from the workbench (copied beside api_front.py into the deployment image)."""
from __future__ import annotations

import os

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

MULTIPROCESS_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class FrontMetrics:
    """One registry of the front's metrics; `route` is a served route's path, else "other"."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        shared = os.environ.get(MULTIPROCESS_VARIABLE)
        into = None if shared else self.registry  # multiprocess: values go to files, collected at scrape time
        if shared:
            MultiProcessCollector(self.registry, path=shared)
        self.requests = Counter("workbench_front_requests", "Requests answered, by route and HTTP status",
                                ["route", "status"], registry=into)
        self.tokens = Counter("workbench_front_tokens", "Tokens of the texts answered, as the served model counts "
                              "them (each text cut at its max_length)", ["route"], registry=into)
        self.in_front = Gauge("workbench_front_requests_in_progress", "Requests being answered (the front's queue)",
                              ["route"], registry=into, multiprocess_mode="livesum")
        self.latency = Histogram("workbench_front_request_seconds", "From a request's arrival to its answer",
                                 ["route"], buckets=BUCKETS, registry=into)
        self.triton = Histogram("workbench_front_triton_seconds", "A request's wait for Triton's answers",
                                ["route"], buckets=BUCKETS, registry=into)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

"""Soak a deployment: many requests on one local Triton, then check that it is still healthy, answers the same and
did not grow.

    python benchmarks/soak.py [--run outputs/<run>] [--requests 10000] [--concurrency 32] [--max-seconds 1800]

Without --run it first runs export, optimize, parity and triton on all-MiniLM-L6-v2. Serves the run's repository,
warms it up (every corpus text once), then sends one corpus text per request over gRPC (asyncio, `--concurrency` in
flight) until `--requests` answered or `--max-seconds` passed. Prints requests, errors, throughput, p50/p99, the RSS
of the server's process tree (tritonserver and its Python-backend stubs) after the warm-up and after the load, and
whether the server is still ready and answers a probe text bit-identically to its answer before the load.
Exits 1 when a request failed, the RSS grew 5 % or more, or the server is not ready or answers the probe otherwise.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from workbench.core.config import RunConfig
from workbench.core.errors import MissingArtifactError, ServedError
from workbench.core.record import RunRecord
from workbench.measure.load import asyncio_level
from workbench.pipeline import run_pipeline
from workbench.serving.client import AsyncTritonClient, TritonClient
from workbench.serving.server import TritonServer

STEPS = ["export", "optimize", "parity", "triton"]
PROBE = "A soak probe: the same text must get the same answer, bit for bit, before and after the load."
MAX_GROWTH = 0.05
MIB = 2**20


def deployed(run: Path) -> tuple[Path, str, list[str]]:
    """The run's served repository, its ensemble's name and the run's corpus; the triton step must be ok."""
    record = RunRecord.load(run)
    deployment = record.deployment()
    if deployment is None:
        raise MissingArtifactError(f"the triton step of {run} is {record.status('triton') or 'not run'}, not ok",
                                   f"run it: workbench run --resume --output-dir {run} --steps triton, or leave "
                                   "out --run")
    return record.artifact("triton.repository"), deployment.name, list(record.config.texts())


def probe(server: TritonServer, model: str) -> dict[str, np.ndarray]:
    with TritonClient(server.grpc_url, "grpc") as client:
        return client.infer_texts(model, [PROBE])


def verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="a run whose triton step is ok")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-seconds", type=float, default=1800.0, help="bound on the load (and on the warm-up)")
    args = parser.parse_args()
    if args.run is None:
        args.run = Path("outputs") / f"soak-{time.strftime('%Y%m%d-%H%M%S')}"
        run_pipeline(RunConfig(steps=STEPS), args.run)
    repository, model, texts = deployed(args.run)
    rss: dict[str, int] = {}

    async def send(client: AsyncTritonClient, index: int) -> object:
        return await client.infer_texts(model, [texts[index % len(texts)]])

    with TritonServer(repository, args.run / "soak" / "server") as server:
        print(f"run: {args.run}  model: {model}  gRPC {server.grpc_url}  server log: {server.log_path}")
        before = probe(server, model)
        try:
            with server.watch():
                level = asyncio_level(server.grpc_url, "grpc", send, args.concurrency, args.requests,
                                      args.max_seconds, after_warmup=lambda: rss.update(before=server.rss_bytes()),
                                      warmup=len(texts))
        except ServedError as error:
            print(f"FAIL: the load stopped: {error}")
            return 1
        rss["after"] = server.rss_bytes()
        ready = server.is_ready()
        after = probe(server, model) if ready else {}
    growth = rss["after"] / rss["before"] - 1
    identical = before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)
    bounded = "" if level.requests + level.errors >= args.requests else f" (stopped at {args.max_seconds:.0f} s)"
    print(f"requests:   {level.requests + level.errors} of {args.requests} at concurrency {args.concurrency}"
          f"{bounded}, {level.seconds:.1f} s")
    print(f"errors:     {level.errors}  {verdict(level.errors == 0)}")
    print(f"throughput: {level.throughput:.1f} req/s")
    print(f"latency:    p50 {level.p50:.2f} ms  p99 {level.p99:.2f} ms")
    print(f"server RSS: {rss['before'] / MIB:.1f} MiB after the warm-up, {rss['after'] / MIB:.1f} MiB after the "
          f"load: {growth:+.2%} (must stay under +{MAX_GROWTH:.0%})  {verdict(growth < MAX_GROWTH)}")
    print(f"healthy:    {'ready' if ready else 'NOT ready'}  {verdict(ready)}")
    print(f"probe:      {'bit-identical to' if identical else 'DIFFERS from'} its answer before the load  "
          f"{verdict(identical)}")
    passed = level.errors == 0 and growth < MAX_GROWTH and ready and identical
    print(f"soak: {verdict(passed)}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())

"""What the API front costs beside Triton direct: one-text embedding requests over HTTP JSON, sent straight to
tritonserver's KServe v2 endpoint and through the front's OpenAI route (base64 vectors, as the openai client asks),
interleaved in one run, at concurrency 1 and 16; the front in one process and in `--workers` processes.

    .venv/bin/python benchmarks/api_front.py [--repository model_repository/<name> | --tiny] [--rounds 3]
        [--requests 300] [--workers 2]

Prints the host (its CPU and how busy other work kept it before), then per level the medians over the rounds
(requests/s, p50 and p99 ms of each path) and the front's ratios to Triton direct: p50 at c1 and requests/s at c16,
the figures docs/api.md quotes. `--tiny` builds a tiny random-weight sentence-transformers model's repository
first (the front's own cost, where the model costs almost nothing). Exits 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import numpy as np
from peerlib.peers import Embedder, front_embedder, http_level, triton_embedder

from workbench.core.config import RunConfig
from workbench.core.data import load_corpus
from workbench.core.errors import ConfigError
from workbench.core.machine import cpu_features
from workbench.core.record import RunRecord
from workbench.interrupt import script_exit
from workbench.measure.tables import ServedLevel
from workbench.models.tiny import build_sentence_encoder
from workbench.runners.timing import others_busy
from workbench.serving.endpoints import text_endpoints
from workbench.serving.front import ApiFront
from workbench.serving.repository import write_repository
from workbench.serving.server import TritonServer

ROOT = Path(__file__).resolve().parents[1]
LEVELS = (1, 16)
TINY = {"batch": {"min": 1, "opt": 8, "max": 32}, "sequence": {"min": 1, "opt": 32, "max": 128},
        "precisions": ["fp32"], "optimize": {"openvino": "never"}}


def default_repository() -> Path:
    found = sorted(p for p in (ROOT / "model_repository").glob("*") if (p / ".workbench.json").is_file())
    if not found:
        raise ConfigError("no repository under model_repository/", "run `make demo` first, pass --repository, or "
                                                                   "--tiny")
    return found[0]


def tiny_repository(root: Path) -> Path:
    """A tiny sentence-transformers model exported, optimized and written as a repository under `root`."""
    from workbench.steps import export, optimize
    from workbench.steps.triton import serving_plan

    model = build_sentence_encoder(root / "tiny", pooling="mean", dense=None, normalize=True)
    config = RunConfig.model_validate({"model": str(model), "task": "feature-extraction", **TINY,
                                       "triton": {"name": "tiny", "repository_dir": str(root / "published")}})
    record = RunRecord.create(root / "run", config)
    export.run(config, record)
    optimize.run(config, record)
    plan, _ = serving_plan(config, record)
    return write_repository(plan, root / "repository")


def median(runs: list[ServedLevel], key: str) -> float:
    return float(np.median([getattr(run, key) for run in runs]))


def measure(paths: list[Embedder], texts: list[str], rounds: int, requests: int) -> dict[tuple[str, int],
                                                                                       list[ServedLevel]]:
    """Each path at each level, interleaved: a round runs every path at a level before the next level."""
    results: dict[tuple[str, int], list[ServedLevel]] = {}
    for _ in range(rounds):
        for concurrency in LEVELS:
            for path in paths:
                results.setdefault((path.name, concurrency), []).append(
                    http_level(path, texts, concurrency, requests, 120))
    return results


def report(paths: list[Embedder], results: dict[tuple[str, int], list[ServedLevel]]) -> None:
    print("| concurrency | path | req/s | p50 ms | p99 ms |\n|---|---|---|---|---|")
    for concurrency in LEVELS:
        for path in paths:
            runs = results[(path.name, concurrency)]
            print(f"| {concurrency} | {path.name} | {median(runs, 'throughput'):.1f} | {median(runs, 'p50'):.2f} | "
                  f"{median(runs, 'p99'):.2f} |")
    direct = paths[0].name
    for path in paths[1:]:
        p50 = median(results[(path.name, 1)], "p50") / median(results[(direct, 1)], "p50")
        rps = median(results[(path.name, 16)], "throughput") / median(results[(direct, 16)], "throughput")
        print(f"{path.name}: p50 at c1 {p50:.2f}x Triton direct's (target <= 1.10x); req/s at c16 {rps:.2f}x "
              "(target >= 0.95x on the embedded MiniLM, >= 0.8x on a tiny model)")


def compare() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--repository", type=Path, help="a Triton model repository the triton step wrote")
    source.add_argument("--tiny", action="store_true", help="a tiny random-weight model's repository, built first")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=300, help="requests per level and path, each round")
    parser.add_argument("--workers", type=int, default=2, help="the second front's processes (1: no second front)")
    args = parser.parse_args()
    texts = list(load_corpus())
    print(f"host: {cpu_features().recorded()}; other processes kept {others_busy():.1f} cores busy before")
    with tempfile.TemporaryDirectory() as workdir:
        work = Path(workdir)
        repository = tiny_repository(work) if args.tiny else args.repository or default_repository()
        endpoint = next(e for e in text_endpoints(repository) if not e.reranks)
        with TritonServer(repository, work / "server") as server, \
                ApiFront(repository, server.grpc_url, work / "front") as one:
            paths = [triton_embedder("triton direct", "fp32", server, endpoint.model, endpoint.output),
                     front_embedder("front", "fp32", one, endpoint.model)]
            if args.workers > 1:
                many = ApiFront(repository, server.grpc_url, work / "front-many", workers=args.workers).start()
                paths.append(dataclasses.replace(front_embedder("", "fp32", many, endpoint.model),
                                                 name=f"front x{args.workers}"))
            try:
                print(f"model {endpoint.model} in {repository}; {args.rounds} rounds of {args.requests} one-text "
                      "requests per path and level")
                results = measure(paths, texts, args.rounds, args.requests)
            finally:
                if args.workers > 1:
                    many.stop()
    report(paths, results)


if __name__ == "__main__":
    sys.exit(script_exit(compare, "nothing kept"))

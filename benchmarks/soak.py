"""Soak a deployment: many requests on one local Triton, 1 % of them bad and 1 % at the deployment's limits, then
check that it is still healthy, answers the same and did not grow, and how the small requests fared beside the
large ones.

    python benchmarks/soak.py [--run outputs/<run>] [--reranker [base|minilm]] [--requests 10000] [--concurrency 32]
                              [--max-seconds 1800] [--warmup N] [--front]

Without --run it first runs export, optimize, parity and triton on all-MiniLM-L6-v2 (with --reranker: on a random-
weight cross-encoder of BERT-base's shape or MiniLM-L6's, 512 tokens, built under outputs/). Serves the run's
repository, warms it up, times 100 small requests alone, then sends requests over gRPC (asyncio, `--concurrency` in
flight) until `--requests` were answered or `--max-seconds` passed: request i is bad when i % 100 == 0 (an empty
text, or no documents: must be answered 400), at the limits when i % 100 == 50 (triton.max_texts texts, or
max_documents documents, of max_text_chars characters each; a batched model's batch.max at most: answered, or refused
400 past triton.max_request_tokens), else small (one corpus text; a reranker: one query and 4 documents). Prints the
outcomes per kind, the small requests' p50/p99 against alone, the RSS of the server's process tree after the warm-up,
half way through the load (each session's buffers have grown to the largest shapes by then) and after it, and whether
the server is still ready and answers a probe bit-identically to its answer before. Exits 1 when a request got an
answer its kind does not expect, the RSS grew 5 % or more in the load's second half, or the server is not ready or
answers the probe otherwise. `--front`: the requests go through the API front (OpenAI's /v1/embeddings, base64
vectors, or /v1/rerank) over HTTP instead, a bad one answered 400, one at the limits answered or refused 413; the RSS
is the server's and the front's.
"""
from __future__ import annotations

import argparse
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

from workbench.core.config import RunConfig
from workbench.core.errors import MissingArtifactError
from workbench.core.record import RunRecord
from workbench.measure.load import asyncio_level, closed_loop_level
from workbench.models.tiny import build_cross_encoder
from workbench.pipeline import run_pipeline
from workbench.serving.backend.api_front import ROUTES
from workbench.serving.client import AsyncTritonClient, TritonClient, rerank_arrays, text_array
from workbench.serving.errors import ServedError
from workbench.serving.front import ApiFront
from workbench.serving.repository import read_repository
from workbench.serving.server import TritonServer, tree_rss
from workbench.serving.tables import TritonMetrics

STEPS = ["export", "optimize", "parity", "triton"]
MAX_GROWTH = 0.05
MIB = 2**20
EVERY = 100  # of every 100 requests: one bad (index 0), one at the limits (index 50)
ALONE = 100  # small requests timed one at a time before the load
SHAPES = {"base": {"layers": 12, "hidden": 768, "heads": 12, "intermediate": 3072, "positions": 512},  # BERT-base
          "minilm": {"layers": 6, "hidden": 384, "heads": 12, "intermediate": 1536, "positions": 512}}  # MiniLM-L6


@dataclass
class Deployment:
    """What the soak sends to: the served model, whether it reranks, its request limits and texts to send."""

    repository: Path
    model: str
    reranks: bool
    texts: list[str]
    limits: dict[str, int]

    def request(self, kind: str, index: int) -> tuple[str, list[str]]:
        """A request of `kind` (small, bad, large), its texts chosen by `index`: the query (a reranker's; else the
        text) and the documents (else the texts). At the limits: as many texts as one Triton request takes (a
        batched model batch.max at most; `benchmarks/api_limits.py` sends the front's own limit), each as long as
        max_text_chars allows."""
        text = self.texts[index % len(self.texts)]
        if kind == "large":
            long = (" ".join(self.texts) * 60)[:self.limits["max_text_chars"]]
            count = min(self.limits["max_texts"], self.limits["max_batch_size"] or self.limits["max_texts"])
            return text, [long] * (self.limits["max_documents"] if self.reranks else count)
        if self.reranks:
            return text, [] if kind == "bad" else [self.texts[(index + k) % len(self.texts)] for k in range(1, 5)]
        return text, ["" if kind == "bad" else text]

    def arrays(self, kind: str, index: int) -> dict[str, np.ndarray]:
        query, texts = self.request(kind, index)
        return rerank_arrays([query], texts) if self.reranks else {"TEXT": text_array(texts)}

    def body(self, kind: str, index: int) -> dict[str, object]:
        """The front's request: OpenAI's embeddings (base64, as the openai client asks) or a rerank."""
        query, texts = self.request(kind, index)
        if self.reranks:
            return {"model": self.model, "query": query, "documents": texts}
        return {"model": self.model, "input": texts, "encoding_format": "base64"}


def deployed(run: Path) -> Deployment:
    """The run's served repository, its model and limits, and the run's corpus; the triton step must be ok."""
    record = RunRecord.load(run)
    deployment = record.current(TritonMetrics)
    if deployment is None:
        raise MissingArtifactError(f"the triton step of {run} is {record.status('triton') or 'not run'}, not ok",
                                   f"run it: workbench run --resume --output-dir {run} --steps triton, or leave "
                                   "out --run")
    repository = record.artifact("triton.repository")
    config = read_repository(repository)[deployment.name]
    limits = {key: int(config.parameters[key].string_value) for key in ("max_texts", "max_text_chars",
                                                                        "max_documents") if key in config.parameters}
    limits["max_batch_size"] = config.max_batch_size
    return Deployment(repository, deployment.name, record.config.task == "rerank", list(record.config.texts()),
                      limits)


def kind_of(index: int) -> str:
    return {0: "bad", EVERY // 2: "large"}.get(index % EVERY, "small")


def verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


EXPECTED = {"small": {"ok"}, "bad": {"refused"}, "large": {"ok", "refused"}}


def built_run(reranker: str | None) -> Path:
    """A new run of STEPS on all-MiniLM-L6-v2 or on a random-weight cross-encoder of the `reranker` shape."""
    run = Path("outputs") / f"soak-{'reranker-' if reranker else ''}{time.strftime('%Y%m%d-%H%M%S')}"
    if not reranker:
        run_pipeline(RunConfig(steps=STEPS), run)
        return run
    model = build_cross_encoder(run.with_name(f"{run.name}-model"), initializer_range=0.02, **SHAPES[reranker])
    run_pipeline(RunConfig(model=str(model), task="rerank", steps=STEPS), run)
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="a run whose triton step is ok")
    parser.add_argument("--reranker", nargs="?", const="base", choices=sorted(SHAPES), help=(
        "without --run: soak a random-weight reranker of this shape (base: BERT-base's; minilm: 6 x 384, the shape "
        "of the most used cross-encoder)"))
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-seconds", type=float, default=1800.0, help="bound on the load (and on the warm-up)")
    parser.add_argument("--warmup", type=int, help="requests before the load (default: one per corpus text)")
    parser.add_argument("--front", action="store_true", help="send through the API front (HTTP JSON)")
    args = parser.parse_args()
    target = deployed(args.run or built_run(args.reranker))
    rss: dict[str, dict[str, int]] = {}  # when ("before", "middle", "after") -> owner ("server", "front") -> bytes
    seen: dict[str, dict[str, int]] = {kind: {} for kind in EXPECTED}
    small_ms: list[float] = []
    large_ms: list[float] = []

    async def send(client: AsyncTritonClient | aiohttp.ClientSession, index: int) -> object:
        kind = kind_of(index)
        begin = time.perf_counter()
        error: ServedError | None = None
        if isinstance(client, aiohttp.ClientSession):
            async with client.post(f"{front.url}{ROUTES['rerank' if target.reranks else 'embeddings']}",
                                   json=target.body(kind, index)) as response:
                answer = await response.read()
            if response.status != 200:
                error = ServedError(f"HTTP {response.status}: {answer[:300]!r}", "")
            found = "ok" if error is None else "refused" if 400 <= response.status < 500 else "failed"
        else:
            try:
                await client.infer(target.model, target.arrays(kind, index))
            except ServedError as refused:
                error = refused
            found = "ok" if error is None else "refused"
        seen[kind][found] = seen[kind].get(found, 0) + 1
        if index == args.requests // 2 and "before" in rss:
            rss["middle"] = held()  # by the middle every shape has run: growth past it is a leak
        if kind == "small" and found == "ok":
            small_ms.append((time.perf_counter() - begin) * 1e3)
        if kind == "large":
            large_ms.append((time.perf_counter() - begin) * 1e3)
        if found not in EXPECTED[kind]:
            raise error or ServedError(f"a {kind} request was answered", "")
        return None

    def probe(server: TritonServer) -> dict[str, np.ndarray]:
        with TritonClient(server.grpc_url, "grpc") as client:
            return client.infer(target.model, target.arrays("small", 0))

    work = (args.run or target.repository.parent) / "soak"
    with TritonServer(target.repository, work / "server") as server, \
            ApiFront(target.repository, server.grpc_url, work / "front") if args.front else nullcontext() as front:
        def held() -> dict[str, int]:
            return {"server": server.rss_bytes(),
                    **({"front": tree_rss(front.process.pid)} if front and front.process else {})}
        print(f"model: {target.model} ({'reranker' if target.reranks else 'text'}; limits {target.limits})  "
              f"gRPC {server.grpc_url}  server log: {server.log_path}" + (f"  front {front.url}" if front else ""))
        before = probe(server)
        with TritonClient(server.grpc_url, "grpc") as client:
            alone = []
            for index in range(1, ALONE + 1):
                begin = time.perf_counter()
                client.infer(target.model, target.arrays("small", index))
                alone.append((time.perf_counter() - begin) * 1e3)
        try:
            with server.watch():
                def reset() -> None:
                    rss.update(before=held())
                    small_ms.clear()
                    large_ms.clear()
                    for counts in seen.values():
                        counts.clear()
                warmup = args.warmup or len(target.texts)
                if front:
                    level = closed_loop_level(lambda: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)),
                                              send, args.concurrency, args.requests, args.max_seconds, front.url,
                                              reset, warmup)
                else:
                    level = asyncio_level(server.grpc_url, "grpc", send, args.concurrency, args.requests,
                                          args.max_seconds, reset, warmup)
        except ServedError as error:
            print(f"FAIL: the load stopped: {error}")
            return 1
        rss["after"] = held()
        ready = server.is_ready()
        after = probe(server) if ready else {}
    middle = rss.get("middle", rss["before"])
    growth = {owner: rss["after"][owner] / middle[owner] - 1 for owner in rss["after"]}
    identical = before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)
    bounded = "" if level.requests + level.errors >= args.requests else f" (stopped at {args.max_seconds:.0f} s)"
    print(f"requests:   {level.requests + level.errors} of {args.requests} at concurrency {args.concurrency}"
          f"{bounded}, {level.seconds:.1f} s, {level.throughput:.1f} req/s")
    for kind, counts in seen.items():
        print(f"{kind + ':':11s} " + ", ".join(f"{n} {found}" for found, n in sorted(counts.items())) +
              f" (expected: {' or '.join(sorted(EXPECTED[kind]))})")
    print(f"unexpected: {level.errors}  {verdict(level.errors == 0)}")
    print(f"small:      p50 {np.percentile(small_ms, 50):.2f} ms  p99 {np.percentile(small_ms, 99):.2f} ms under "
          f"the load; alone p50 {np.percentile(alone, 50):.2f} ms  p99 {np.percentile(alone, 99):.2f} ms")
    if large_ms:
        print(f"at limits:  p50 {np.percentile(large_ms, 50):.0f} ms, the longest {max(large_ms):.0f} ms to be "
              "answered or refused")
    for owner, grew in growth.items():
        print(f"{owner + ' RSS:':11s} {rss['before'][owner] / MIB:.1f} MiB after the warm-up, "
              f"{middle[owner] / MIB:.1f} MiB half way, {rss['after'][owner] / MIB:.1f} MiB after the load: "
              f"{grew:+.2%} in the second half (must stay under +{MAX_GROWTH:.0%})  {verdict(grew < MAX_GROWTH)}")
    print(f"healthy:    {'ready' if ready else 'NOT ready'}  {verdict(ready)}")
    print(f"probe:      {'bit-identical to' if identical else 'DIFFERS from'} its answer before the load  "
          f"{verdict(identical)}")
    passed = level.errors == 0 and max(growth.values()) < MAX_GROWTH and ready and identical
    print(f"soak: {verdict(passed)}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())

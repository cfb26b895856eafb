"""The worst request the API front takes, and what it does to others: one embeddings request at the deployment's
limits (triton.max_texts texts of triton.max_text_chars characters each) while one-text requests keep coming.

    .venv/bin/python benchmarks/api_limits.py [--repository model_repository/<name>] [--concurrency 4]
        [--seconds 20]

Serves the repository with the front, times one-text requests through the front alone for `--seconds`, then again
while the request at the limits runs (the front sends its pieces two at a time, so the small ones interleave in
Triton's queue). Prints the large request's time, and the small requests' p50, p99 and longest wait alone and beside
it. Exits 0.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
from api_front import default_repository

from workbench.core.data import load_corpus
from workbench.core.machine import cpu_features
from workbench.interrupt import script_exit
from workbench.runners.timing import others_busy
from workbench.serving.front import ApiFront
from workbench.serving.server import TritonServer


async def small_requests(url: str, model: str, texts: list[str], concurrency: int, until: asyncio.Event,
                         seconds: float) -> list[float]:
    """One-text requests, `concurrency` in flight, until `until` is set or `seconds` passed: each one's ms."""
    times: list[float] = []
    deadline = time.monotonic() + seconds

    async def worker(session: aiohttp.ClientSession, offset: int) -> None:
        index = offset
        while not until.is_set() and time.monotonic() < deadline:
            begin = time.perf_counter()
            async with session.post(url, json={"model": model, "input": texts[index % len(texts)],
                                               "encoding_format": "base64"}) as response:
                await response.read()
                assert response.status == 200, response.status
            times.append((time.perf_counter() - begin) * 1e3)
            index += concurrency
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session, k) for k in range(concurrency)))
    return times


async def beside_large(url: str, model: str, texts: list[str], large: list[str], concurrency: int,
                       seconds: float) -> tuple[float, list[float]]:
    """The large request's seconds, and the small requests' ms while it ran."""
    done = asyncio.Event()

    async def one_large() -> float:
        begin = time.perf_counter()
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.post(
                url, json={"model": model, "input": large, "encoding_format": "base64"}) as response:
            await response.read()
            assert response.status == 200, response.status
        done.set()
        return time.perf_counter() - begin
    took, small = await asyncio.gather(one_large(), small_requests(url, model, texts, concurrency, done,
                                                                   seconds * 100))
    return took, small


def summary(times: list[float]) -> str:
    return (f"{len(times)} requests, p50 {np.percentile(times, 50):.1f} ms, p99 {np.percentile(times, 99):.1f} ms, "
            f"longest {max(times):.0f} ms")


def measure() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    repository = args.repository or default_repository()
    texts = list(load_corpus())
    print(f"host: {cpu_features().recorded()}; other processes kept {others_busy():.1f} cores busy before")
    with tempfile.TemporaryDirectory() as workdir, TritonServer(repository, Path(workdir) / "server") as server, \
            ApiFront(repository, server.grpc_url, Path(workdir) / "front") as front:
        model = next(m for m in front.spec.models if m.kind == "embeddings")
        count, chars = model.max_texts or 256, model.max_text_chars or 100_000
        large = [(" ".join(texts) * 60)[:chars]] * count
        url = f"{front.url}/v1/embeddings"
        alone = asyncio.run(small_requests(url, model.id, texts, args.concurrency, asyncio.Event(), args.seconds))
        took, beside = asyncio.run(beside_large(url, model.id, texts, large, args.concurrency, args.seconds))
    print(f"model {model.id}: the request at the limits, {count} texts of {chars} characters ({count} x "
          f"{model.max_length} tokens as the model reads them), took {took:.1f} s")
    print(f"one-text requests at concurrency {args.concurrency}, alone:         {summary(alone)}")
    print(f"one-text requests at concurrency {args.concurrency}, beside it:     {summary(beside)}")


if __name__ == "__main__":
    sys.exit(script_exit(measure, "nothing kept"))

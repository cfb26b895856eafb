"""Load against a served model: NVIDIA's perf_analyzer where it is installed (`measure.perf_analyzer` finds and
installs it), else an asyncio closed-loop generator on tritonclient; both bounded in requests and time, loopback only.
Plus Triton's server-side breakdown."""
from __future__ import annotations

import asyncio
import csv
import json
import re
import subprocess
import time
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

from workbench.measure.errors import UnstableMeasurementError
from workbench.measure.perf_analyzer import STABILITY_TRIALS, PerfAnalyzer, stability_options
from workbench.measure.tables import ServedLevel
from workbench.models.batches import Feed
from workbench.serving.client import AsyncTritonClient, rerank_arrays, run_async, text_array
from workbench.serving.errors import ServedError, ServerUnreachableError


class Closable(Protocol):
    """A client a load level opens once and closes at its end."""

    async def close(self) -> None: ...


STAGES = ("queue", "compute_input", "compute_infer", "compute_output")


# ---- asyncio closed loop ---------------------------------------------------------------------------------------
Client = TypeVar("Client", bound=Closable)


async def _closed_loop(open_client: Callable[[], Client], send: Callable[[Client, int], Awaitable[object]],
                       concurrency: int, requests: int, seconds: float, where: str) -> ServedLevel:
    """A server that gives no answer stops the level with its ServerUnreachableError; other failed requests are
    counted as errors, and a level where every request failed is a ServedError, not a measurement."""
    client = open_client()
    latencies: list[float] = []
    failures: list[Exception] = []
    issued = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal issued
        while issued < requests and time.perf_counter() < deadline:
            index = issued
            issued += 1
            begin = time.perf_counter()
            try:
                await send(client, index)
                latencies.append(time.perf_counter() - begin)
            except ServerUnreachableError:
                raise
            except Exception as error:  # noqa: BLE001 - counted, the level goes on
                failures.append(error)

    start = time.perf_counter()
    workers = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
    try:
        await asyncio.gather(*workers)
    finally:
        for task in workers:  # the rest of a level stopped by an unreachable server
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        await client.close()
    elapsed = time.perf_counter() - start
    if not latencies:
        first = getattr(failures[0], "problem", repr(failures[0])) if failures else "none was sent"
        raise ServedError(f"all {len(failures)} requests at concurrency {concurrency} to {where} failed; the first: "
                          f"{first}", "fix what the first error names; a level without one answer measures nothing")
    values = np.asarray(latencies) * 1e3
    p50, p90, p95, p99 = (float(np.percentile(values, q)) for q in (50, 90, 95, 99))
    return ServedLevel(concurrency=concurrency, requests=len(latencies), errors=len(failures), seconds=elapsed,
                       throughput=len(latencies) / elapsed, p50=p50, p90=p90, p95=p95, p99=p99,
                       mean=float(values.mean()))


def closed_loop_level(open_client: Callable[[], Client], send: Callable[[Client, int], Awaitable[object]],
                      concurrency: int, requests: int, seconds: float, where: str,
                      after_warmup: Callable[[], None] | None = None, warmup: int | None = None) -> ServedLevel:
    """A warm-up of `warmup` requests (default: `concurrency`), then up to `requests` requests (or `seconds`) with
    `concurrency` in flight on one client from `open_client`, each sent as soon as the previous one of its worker
    returned (`send(client, index)`). `after_warmup` runs in between (to reset whatever `send` counts)."""
    run_async(_closed_loop(open_client, send, concurrency, warmup or concurrency, seconds, where))
    if after_warmup:
        after_warmup()
    return run_async(_closed_loop(open_client, send, concurrency, requests, seconds, where))


def asyncio_level(url: str, protocol: str, send: Callable[[AsyncTritonClient, int], Awaitable[object]],
                  concurrency: int, requests: int, seconds: float, after_warmup: Callable[[], None] | None = None,
                  warmup: int | None = None) -> ServedLevel:
    """`closed_loop_level` on a tritonclient asyncio client of `url` over `protocol`. A server that stops
    answering raises ServerUnreachableError."""
    return closed_loop_level(lambda: AsyncTritonClient(url, protocol), send, concurrency, requests, seconds, url,
                             after_warmup, warmup)


# ---- perf_analyzer (found and installed by workbench.measure.perf_analyzer) ----------------------------------------
def write_input_data(path: Path, data: list[Feed]) -> Path:
    """perf_analyzer's --input-data file: one entry per request (`data`: a dict of arrays each, batch axis first)."""
    def tensor(array: np.ndarray) -> dict[str, list[str] | list[int]]:
        content = [x.decode() for x in array.ravel()] if array.dtype == object else array.ravel().tolist()
        return {"content": content, "shape": list(array.shape[1:])}
    path.write_text(json.dumps({"data": [{name: tensor(v) for name, v in item.items()} for item in data]}))
    return path


def perf_analyzer_level(tool: PerfAnalyzer, url: str, protocol: str, model: str, data: list[Feed],
                        concurrency: int, requests: int, seconds: float, workdir: Path) -> ServedLevel:
    """One perf_analyzer measurement at `concurrency` over real inputs (`data`: one dict of arrays per request)."""
    workdir.mkdir(parents=True, exist_ok=True)
    inputs = write_input_data(workdir / "inputs.json", data)
    report = workdir / f"c{concurrency}.csv"
    command = [str(tool.executable), "-m", model, "-u", url, "-i", protocol, "-b", "1",
               "--input-data", str(inputs), "--concurrency-range", f"{concurrency}:{concurrency}",
               *stability_options(requests), "-f", str(report), "--verbose-csv"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=tool.environment(),
                          timeout=seconds * STABILITY_TRIALS + 60)
    if "Failed to obtain stable measurement" in done.stdout + done.stderr:
        raise UnstableMeasurementError(
            f"perf_analyzer found no stable window at concurrency {concurrency} in {STABILITY_TRIALS} windows of "
            f"{requests} requests", "raise bench.requests_per_level, or measure on a quieter machine")
    if done.returncode != 0:
        raise RuntimeError(f"perf_analyzer failed ({done.returncode}): {done.stdout[-1500:]}{done.stderr[-1500:]}")
    row = next(csv.DictReader(report.open()))
    ms = {k: float(row[f"{k} latency"]) / 1e3 for k in ("p50", "p90", "p95", "p99", "Avg")}  # CSV is in usec
    throughput = float(row["Inferences/Second"])
    elapsed = time.perf_counter() - start
    return ServedLevel(concurrency=concurrency, requests=requests, errors=0, seconds=elapsed, throughput=throughput,
                       p50=ms["p50"], p90=ms["p90"], p95=ms["p95"], p99=ms["p99"], mean=ms["Avg"])


def text_level(tool: PerfAnalyzer | None, url: str, model: str, texts: list[str], concurrency: int, requests: int,
               seconds: float, workdir: Path, protocol: str = "grpc") -> ServedLevel:
    """One level of one-text requests over `protocol` (`url` is the server's address for it): perf_analyzer when
    it is there and finds a stable window, else the asyncio generator."""
    note = ""
    if tool is not None:
        try:
            return perf_analyzer_level(tool, url, protocol, model, [{"TEXT": text_array([t])} for t in texts],
                                       concurrency, requests, seconds, workdir)
        except UnstableMeasurementError as error:
            note = f"{error.problem}; measured with the asyncio generator instead"

    async def send(client: AsyncTritonClient, index: int) -> object:
        return await client.infer_texts(model, [texts[index % len(texts)]])
    level = asyncio_level(url, protocol, send, concurrency, requests, seconds)
    if note:
        level.tool, level.note = "asyncio", note
    return level


def request_texts(texts: Sequence[str], index: int, documents: int) -> list[str]:
    """Request `index`'s texts: one corpus text, and for a reranker the next `documents` as its documents."""
    start = index * (documents + 1)
    return [texts[(start + i) % len(texts)] for i in range(documents + 1)]


def rerank_level(url: str, model: str, texts: list[str], documents: int, concurrency: int, requests: int,
                 seconds: float, protocol: str = "grpc") -> ServedLevel:
    """One level of reranker requests, each a corpus text as the query with the next `documents` texts
    (`request_texts`), over `protocol` with the asyncio generator: requests/s and pairs/s."""
    async def send(client: AsyncTritonClient, index: int) -> object:
        query, *chosen = request_texts(texts, index, documents)
        return await client.infer(model, rerank_arrays([query], chosen), ["scores"])
    level = asyncio_level(url, protocol, send, concurrency, requests, seconds)
    level.documents, level.pairs_per_s = documents, round(level.throughput * documents, 1)
    return level


# ---- server-side breakdown -----------------------------------------------------------------------------------------
def stage_totals(stats: dict[str, Any]) -> dict[str, int]:
    """Cumulative request count and nanoseconds per stage from Triton's statistics (HTTP or gRPC JSON)."""
    inference = stats.get("inference_stats", {})
    totals = {"requests": int(inference.get("success", {}).get("count", 0))}
    for stage in STAGES:
        totals[stage] = int(inference.get(stage, {}).get("ns", 0))
    return totals


def breakdown(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """Mean milliseconds per request in each server stage between two snapshots."""
    requests = max(after["requests"] - before["requests"], 1)
    result = {stage: (after[stage] - before[stage]) / requests / 1e6 for stage in STAGES}
    result["requests"] = after["requests"] - before["requests"]
    return result


def model_stages(metrics_url: str, model: str) -> dict[str, float]:
    """The Python model's own cumulative seconds per stage of `execute` and its timed executions (`executions`),
    from the server's metrics port (serving/backend/stages.py); empty where the model times nothing or the metrics
    port does not answer (the timing is extra information, never a reason to stop a measurement)."""
    try:
        with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=10) as response:
            text = response.read().decode()
    except OSError:  # urllib's URLError included
        return {}
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("workbench_stage_seconds_total{", "workbench_executions_total{")) and \
                f'model="{model}"' in line:
            labels, value = line.rsplit(" ", 1)
            stage = re.search(r'stage="([^"]+)"', labels)
            totals[stage.group(1) if stage else "executions"] = float(value)
    return totals


def own_breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean milliseconds per execution in each of the model's own stages between two `model_stages` snapshots."""
    executions = max(after.get("executions", 0) - before.get("executions", 0), 1)
    return {stage: (after[stage] - before.get(stage, 0.0)) * 1e3 / executions for stage in after
            if stage != "executions"}


FLUSH_SECONDS = 0.5  # how often every instance of a timed model sends its sums (serving/backend/stages.py)


def settled_stages(metrics_url: str, model: str) -> dict[str, float]:
    """`model_stages` once every instance of the model has sent all it timed so far (FLUSH_SECONDS and a margin
    later), so that the window between two readings holds its own executions; empty, and no wait, for a model
    that times nothing."""
    if not model_stages(metrics_url, model):
        return {}
    time.sleep(FLUSH_SECONDS + 0.2)
    return model_stages(metrics_url, model)

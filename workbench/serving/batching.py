"""Watching Triton's dynamic batcher: a burst of concurrent one-text requests, and the batch sizes each model ran."""
from __future__ import annotations

import asyncio
import time
from typing import Any

from workbench.serving.client import AsyncTritonClient, TritonClient, run_async
from workbench.serving.repository import ServingPlan
from workbench.serving.server import TritonServer
from workbench.serving.tables import BatchingBurst


async def burst(url: str, model: str, texts: list[str], concurrency: int) -> None:
    """`concurrency` single-text requests in flight at once (to let the dynamic batcher group them)."""
    client = AsyncTritonClient(url)
    try:
        await asyncio.gather(*(client.infer_texts(model, [texts[i % len(texts)]]) for i in range(concurrency)))
    finally:
        await client.close()


def batch_sizes(stats: dict[str, Any]) -> dict[int, int]:
    """Executions per batch size from Triton's statistics."""
    return {int(entry["batch_size"]): int(entry["compute_infer"]["count"]) for entry in stats.get("batch_stats", [])}


def observe_batching(server: TritonServer, plan: ServingPlan, texts: list[str],
                     concurrency: int, settle_seconds: float = 5.0) -> BatchingBurst:
    """Send `concurrency` one-text requests at once; report the batch sizes each model executed for them. Triton
    counts an execution once its responses are sent, so the counts are read until every request shows (or
    `settle_seconds` passed: then what showed)."""
    models = plan.working_models

    def executed(before: dict[str, dict[int, int]], after: dict[str, dict[int, int]]) -> dict[str, dict[int, int]]:
        return {name: {size: count - before[name].get(size, 0) for size, count in after[name].items()
                       if count > before[name].get(size, 0)} for name in models}

    with TritonClient(server.grpc_url) as client:
        before = {name: batch_sizes(client.statistics(name)) for name in models}
        run_async(burst(server.grpc_url, plan.name, texts, concurrency))
        deadline = time.monotonic() + settle_seconds
        while True:
            found = executed(before, {name: batch_sizes(client.statistics(name)) for name in models})
            counted = min(sum(size * count for size, count in sizes.items()) for sizes in found.values())
            if counted >= concurrency or time.monotonic() > deadline:
                return BatchingBurst(requests=concurrency, batch_sizes=found)
            time.sleep(0.05)

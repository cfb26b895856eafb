"""The bench step: in-process latency of every runner on a batch x sequence grid, and served load sweeps against
a local Triton (batching off and on, a batching search, where tokenization runs)."""
from __future__ import annotations

from typing import Any

from workbench.config import RunConfig
from workbench.data import load_corpus
from workbench.errors import TritonNotFoundError
from workbench.latency import run_latency_benchmark
from workbench.record import RunRecord, StepEntry
from workbench.served import run_served_benchmark
from workbench.triton.plan import serving_plan
from workbench.triton.server import find_tritonserver

STEP = "bench"


def served_benchmark(config: RunConfig, record: RunRecord) -> dict[str, Any]:
    """The served measurements, or why they were not taken (no server, or a flavor this server cannot run)."""
    deployment = record.deployment()
    plan, variant = serving_plan(config, record, deployment and deployment["variant"])  # else the best candidate
    try:
        binary = find_tritonserver()
    except TritonNotFoundError as missing:
        return {"skipped": str(missing)}
    if plan.flavor != "python-ort" and binary.origin == "nvidia-pytriton":
        return {"skipped": f"the {plan.flavor} flavor needs NVIDIA's Triton container"}
    result = run_served_benchmark(config, plan, list(load_corpus(config.corpus)), record.tokenizer(),
                                  record.run_dir / "served-bench")
    verdict = record.verdict(variant) or {}
    verified = bool(deployment and deployment["verified"]) or bool(verdict.get("passed"))
    return {**result, "variant": variant, "verified": verified}


def run(config: RunConfig, record: RunRecord) -> StepEntry:
    """Measure in process (metrics.bench.latency) and, unless bench.served is false, served (metrics.bench.served)."""
    with record.step(STEP):
        record.set_metric(f"{STEP}.latency", run_latency_benchmark(config, record))
        if config.bench.served:
            record.set_metric(f"{STEP}.served", served_benchmark(config, record))
    return record.step_entry(STEP)

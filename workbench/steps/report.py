"""The report step: benchmark in-process and served, then write one self-contained report.html."""
from __future__ import annotations

from typing import Any

from workbench.config import RunConfig
from workbench.data import load_corpus
from workbench.errors import TritonNotFoundError
from workbench.html_report import build_report
from workbench.latency import run_latency_benchmark
from workbench.record import RunRecord
from workbench.served import run_served_benchmark
from workbench.triton.plan import serving_plan
from workbench.triton.server import find_tritonserver

STEP = "report"
MEASURED = ("latency", "served")  # kept when the report is only re-rendered (bench.enabled false)


def served_benchmark(config: RunConfig, record: RunRecord) -> dict[str, Any]:
    """The served measurements, or why they were not taken (no server, or a flavor this server cannot run)."""
    from transformers import AutoTokenizer

    deployed = record.metric("triton.variant") if record.status("triton") == "ok" else None
    plan, variant = serving_plan(config, record, deployed)  # what the triton step verified, else the best candidate
    try:
        binary = find_tritonserver()
    except TritonNotFoundError as missing:
        return {"skipped": str(missing)}
    if plan.flavor != "python-ort" and binary.origin == "nvidia-pytriton":
        return {"skipped": f"the {plan.flavor} flavor needs NVIDIA's Triton container"}
    tokenizer = AutoTokenizer.from_pretrained(record.artifact("tokenizer"))
    result = run_served_benchmark(config, plan, list(load_corpus(config.corpus)), tokenizer,
                                  record.run_dir / "served-bench")
    verdict = record.verdict(variant) or {}
    return {**result, "variant": variant, "verified": deployed is not None or bool(verdict.get("passed"))}


def run(config: RunConfig, record: RunRecord) -> dict[str, Any]:
    """Measure (unless bench.enabled is false: then only re-render) and write report.html."""
    with record.step(STEP, keep=() if config.bench.enabled else MEASURED):
        if config.bench.enabled:
            record.set_metric("latency", run_latency_benchmark(config, record))
            if config.bench.served:
                record.set_metric("served", served_benchmark(config, record))
        path = build_report(record, record.run_dir / "report.html")
        record.add_artifact("report", path, kind="report")
        return {"report": str(path)}

"""The optimize step's precision decisions: which reduced precisions the deployment's target asks for before any is
built (`measure.precisions.plan`), and, where `precisions: auto` times them here, whether each pays against fp32."""
from __future__ import annotations

from pathlib import Path

from workbench.core.config import RunConfig
from workbench.core.record import RunRecord
from workbench.graphs.tables import PrecisionDecision
from workbench.measure.forms import RaceBench
from workbench.measure.precisions import Target, paired_speedups, plan, settle, target_for
from workbench.runners.onnxruntime import device_for


def decide_precisions(config: RunConfig, record: RunRecord) -> tuple[Target, dict[str, PrecisionDecision]]:
    """The deployment's target and, per reduced precision, whether it is built and why (`measure.precisions.plan`),
    before any is built."""
    gpu = device_for(config.device) == "cuda"
    target = target_for(config.target.cpu, gpu)
    record.set_metric("optimize.precisions", {"setting": config.precisions, "target": target.record()})
    return target, plan(config.precisions, target, tensorrt="tensorrt" in config.steps and gpu)


def measure_against_fp32(config: RunConfig, fp32: Path, decisions: dict[str, PrecisionDecision], files: dict[str, Path],
                         bench: RaceBench) -> None:
    """Each plain reduced-precision variant (`files`, by precision) timed against the `fp32` file at the goal cells
    on this host, in pairs (two sessions in memory at a time), and its decision settled (auto keeps only those that
    pay)."""
    for precision, path in files.items():
        speedups, ms = paired_speedups({"fp32": fp32, precision: path}, bench.feeds, bench.providers, bench.threads,
                                       bench.device)
        settle(decisions[precision], precision, speedups[precision], ms, auto=config.precisions == "auto")


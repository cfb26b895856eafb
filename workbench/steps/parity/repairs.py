"""The parity step's repairs: which failing variants to repair and in what order (the serving order's), the repair
of each, and the race of a repaired int8 against the variant served after it."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from workbench.core.config import RunConfig
from workbench.core.progress import Progress
from workbench.core.record import RunRecord, Variant
from workbench.core.results import Verdict
from workbench.graphs import onnxfiles
from workbench.graphs.names import VariantName
from workbench.graphs.settings import OptimizeSettings
from workbench.graphs.tables import ExportMetrics, OptimizeMetrics, Trial
from workbench.measure.forms import RUNTIME_ROUNDS, race, race_bench
from workbench.measure.settings import BenchSettings
from workbench.models.footprint import release_memory
from workbench.precision.checker import Checker
from workbench.precision.lab import ParityLab
from workbench.precision.repair import RepairPlan, openvino_int8_problem
from workbench.precision.repair import repair as repair_variant
from workbench.precision.settings import ParitySettings
from workbench.precision.tables import ParityMetrics, RepairOutcome
from workbench.runners.registry import open_variant
from workbench.runners.timing import median_ms
from workbench.serving.flavor import Flavor
from workbench.serving.plan import (
    choose_flavor,
    int8_decision,
    lost_races,
    preference,
    recorded_preference,
)
from workbench.serving.settings import TritonSettings

STEP = "parity"


# the variants a failing parity check repairs (`<name>_repaired`)
REPAIRABLE = (VariantName.FP16, VariantName.INT8, VariantName.OPENVINO_INT8)


# A repaired int8 keeps units in fp32 and runs slower than the plain int8 whose speed put int8 first: it is timed
# against the first of these that passed (served after it). A repaired openvino_int8 that is not clearly faster is
# removed; an int8_repaired that is not is served after the variant it lost to (serving.plan.lost_races).
RACED_AGAINST = (VariantName.INT8_REPAIRED, VariantName.INT8, VariantName.OPENVINO_BF16, VariantName.OPENVINO,
                 VariantName.FP32, VariantName.ORIGINAL)


def repair_plan(config: RunConfig, budget_s: float) -> RepairPlan:
    optimize = OptimizeSettings.of(config)
    repair, fp16, int8 = ParitySettings.of(config).repair, optimize.fp16, optimize.int8
    return RepairPlan(repair.max_builds, budget_s, fp16.op_block_list, fp16.node_block_list,
                      int8.nodes_to_exclude, int8.per_channel)


def serving_order(config: RunConfig, record: RunRecord) -> tuple[str, ...]:
    """The variants the run's deployment would serve, best first (`serving.plan.preference`)."""
    flavor = choose_flavor(TritonSettings.of(config).flavor, config.device, config.task_choice.name)
    return recorded_preference(flavor, record.results_of(OptimizeMetrics), record.results_of(ParityMetrics))[0]


def repair_order(failing: list[str], config: RunConfig, record: RunRecord) -> list[str]:
    """The failing variants to repair, the one whose repair would be served first first: once it passes, the
    repairs served after it are not needed."""
    order = serving_order(config, record)
    ranks = {name: order.index(repaired) if (repaired := VariantName(name).repaired) in order else len(order)
             for name in failing}
    return sorted(failing, key=ranks.__getitem__)


def served_ahead_of(repaired: str, results: dict[str, Verdict], config: RunConfig, record: RunRecord) -> str | None:
    """A variant that passed parity (`results`, repaired ones included) and that the deployment serves ahead of
    `repaired`, which then could never be served: its repair is not needed."""
    order = serving_order(config, record)
    if repaired not in order:
        return None
    return next((v for v in order[:order.index(repaired)] if v in results and results[v].passed), None)


def repair(name: str, config: RunConfig, record: RunRecord, lab: ParityLab, results: dict[str, Verdict]) -> str | None:
    """Repair the failing variant `name` (metrics.parity.repair.<name>); the repaired variant's name when one
    passed (and, for openvino_int8, kept its speed where it is served ahead: `race_repaired`), its file recorded."""
    repaired = VariantName(name).repaired
    dest = record.run_dir / "onnx" / f"{repaired}.onnx"
    built = record.variant(name)
    path, precision = built.path, built.precision
    budget_s, budget_source = ParitySettings.of(config).repair.budget(results[name].seconds)
    record.phase(f"repairing {name}: each build keeps more of the graph in fp32 and is checked on the corpus")
    with Progress(f"repair {name}", ParitySettings.of(config).repair.max_builds, "builds") as bar:
        checker = Checker(lab.for_variant(onnxfiles.batch_dependent(path)), built, config.device, config.threads)
        problem = None
        if name == VariantName.OPENVINO_INT8:
            problem = openvino_int8_problem(path, record.artifact("onnx.original"), checker)
            always = OptimizeSettings.of(config).openvino == "always"
            problem.ceiling = None if always else ceiling(config, record, results, checker)
        outcome = repair_variant(checker, repair_plan(config, budget_s), record.artifact("onnx.fp32"),
                                 record.run_dir / "repair" / name, dest, bar, problem)
    outcome.result.budget_source = budget_source
    against = raced_against(results, record)
    if outcome.blocked is not None and precision == "int8" and served_ahead(repaired, against, record):
        race = outcome.result.race = race_repaired(repaired, dest, config, record, against)
        if not race.kept and name == VariantName.OPENVINO_INT8:
            onnxfiles.remove(dest)
            outcome.blocked = None
    record.set_metric(f"{STEP}.repair.{name}", outcome.result.recorded())
    if outcome.blocked is not None:
        record.add_artifact(f"onnx.{repaired}", dest, kind="onnx", variant=repaired, precision=precision,
                            blocked=outcome.blocked, **({"recipe": outcome.recipe} if outcome.recipe else {}))
        return repaired
    return None


def repair_failing(config: RunConfig, record: RunRecord, lab: ParityLab, results: dict[str, Verdict],
                   compare: Callable[[str], Verdict]) -> None:
    """Repair each failing repairable variant of `results` (all checked), unless a variant served ahead of its
    repair passed; each repaired one checked into `results` (`compare`: the step's check of a variant by name)."""
    failing = [name for name in REPAIRABLE if name in results and not results[name].passed]
    for name in repair_order(failing, config, record) if ParitySettings.of(config).repair.enabled else []:
        ahead = served_ahead_of(VariantName(name).repaired, results, config, record)
        if ahead:
            record.set_metric(f"{STEP}.repair.{name}", RepairOutcome(
                precision=record.variant(name).precision, units=0,
                outcome=f"not needed: {ahead} passed parity and is served ahead of {name}_repaired").recorded())
            continue
        repaired = repair(name, config, record, lab, results)
        if repaired is not None:
            results[repaired] = compare(repaired)


def ceiling(config: RunConfig, record: RunRecord, results: dict[str, Verdict], checker: Checker) -> tuple[str, float]:
    """The variant a raced repair must beat (the first of RACED_AGAINST that passed) and its median ms on the
    checker's latency batch, measured as the checker measures candidates."""
    against = raced_against(results, record)
    with open_variant(record.variant(against), config.device, config.threads) as runner:
        return against, median_ms(lambda: runner.infer(checker.batch), repeats=5, warmup=1)


def raced_against(results: dict[str, Verdict], record: RunRecord) -> str:
    """The first of RACED_AGAINST that passed parity (`results`, by variant), past a repaired one that lost its own
    race (served after the variant it lost to)."""
    lost = lost_races(record.results_of(ParityMetrics))
    return next((v for v in RACED_AGAINST if v in results and results[v].passed and v not in lost), "fp32")


def served_ahead(name: str, against: str, record: RunRecord) -> bool:
    """Whether the serving order (python-ort's, with the optimize step's int8 decision) puts `name` ahead of
    `against`: only then does its speed against it decide anything."""
    order, _ = preference(Flavor.PYTHON_ORT, int8_decision(record.results_of(OptimizeMetrics)))
    return name in order and against in order and order.index(name) < order.index(against)


def race_repaired(name: str, path: Path, config: RunConfig, record: RunRecord, against: str) -> Trial:
    """The repaired int8 (`path`) timed against `against`, the variant served after it that passed parity here
    (`raced_against`), its record: an OpenVINO one is kept only where it is clearly faster (`forms.race`) or
    optimize.openvino=always; an ONNX Runtime one that is not clearly faster is served after it."""
    openvino = VariantName(name).openvino
    if openvino and OptimizeSettings.of(config).openvino == "always":
        return Trial(against=against, ms={}, kept=True, reason="set by optimize.openvino=always")
    with open_variant(record.variant(against), config.device, config.threads) as default, \
            open_variant(Variant(name, "int8", "onnx", path), config.device, config.threads) as challenger:
        ms, kept, reason = race(against, name, {against: default, name: challenger},
                                race_bench(BenchSettings.of(config), list(config.texts()), config.device,
                                           config.threads, record.tokenizer(), record.needed(ExportMetrics)).feeds,
                                RUNTIME_ROUNDS)
    release_memory()
    lost = "not kept (its file removed)" if openvino else f"served after {against}"
    return Trial(against=against, ms=ms, kept=kept, reason=f"{'kept' if kept else lost}: {reason}")

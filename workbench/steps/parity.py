"""The parity step: every variant against PyTorch on real text at the shape corners, and precision repair."""
from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Any

from workbench.core.atomic import write_text
from workbench.core.config import RunConfig
from workbench.core.data import load_corpus
from workbench.core.errors import MissingArtifactError, ReferenceMismatchError
from workbench.core.progress import Progress, track
from workbench.core.record import RunRecord, StepEntry
from workbench.core.timing import median_ms
from workbench.graphs import onnxfiles
from workbench.graphs.variants import convert_fp16, quantize_int8_blockwise
from workbench.models.loading import LoadedModel, load_model
from workbench.precision.compare import raise_if_failed
from workbench.precision.lab import ParityLab, library_check
from workbench.precision.nodeerror import agreement_with_sensitivity, node_errors
from workbench.precision.recipes import ChosenBase, base_recipes, choose_base, measure_recipe
from workbench.precision.repair import (
    RepairProblem,
    RepairSearch,
    activation_order,
    matmul_costs,
    remove_candidates,
    run_search,
    sensitivity_order,
)
from workbench.report.page import Section, parity_section
from workbench.report.takeaways import parity_lines
from workbench.runners.onnxruntime import OrtRunner, providers_for
from workbench.steps import StepSpec

STEP = "parity"
EXACT_VARIANTS = ("original", "fp32")
HARD_TEXTS = 16  # worst texts per output whose batches the repair search checks candidates on
REPAIR_ROUNDS = 3
# Recipes tried on an int8 repair's MatMuls instead of fp32: 8-bit block-quantized weights (MatMulNBits) with these
# block sizes, accuracy level 4 (int8 compute). Smaller blocks follow the weights more closely.
BLOCKWISE_RECIPES = ((16, 4), (32, 4), (128, 4))
SMOOTHING_CALIBRATION_STRIDE = 4  # every 4th corpus batch measures the activation ranges smoothing balances


def repair_problem(precision: str, config: RunConfig, fp32: Path, lab: ParityLab,
                   base: ChosenBase | None = None) -> RepairProblem:
    """fp16: node block list, nodes ordered by activation magnitude; int8: nodes to exclude from `base`'s recipe
    (its fp32 graph, smoothed or not), by sensitivity.

    Both rank passing candidates by the matmul work they keep in fp32 (`matmul_costs`), never by a timing.
    """
    graph = onnxfiles.load(fp32, load_external_data=False)
    if precision == "fp16":
        from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST

        blocked_ops = set(DEFAULT_OP_BLOCK_LIST) | set(config.fp16_op_block_list) | {"Cast"}
        units = {n.name for n in graph.graph.node if n.op_type not in blocked_ops} - set(config.fp16_node_block_list)
        feeds = [b.feed for b in lab.sweep[:4]] + [lab.corners[-1].feed]
        ordered = activation_order(fp32, feeds, units)
        return RepairProblem("fp16", ordered, lambda blocked, dest: convert_fp16(
            fp32, dest, config.fp16_op_block_list, config.fp16_node_block_list + blocked),
            ordering="largest fp32 activation first", costs=matmul_costs(graph, ordered))
    from onnxruntime.quantization.registry import IntegerOpsRegistry

    assert base is not None, "an int8 repair starts from a chosen base recipe"
    units = [n.name for n in graph.graph.node
             if n.op_type in IntegerOpsRegistry and n.name not in config.int8_nodes_to_exclude]
    return RepairProblem("int8", units, lambda blocked, dest: base.recipe.build(
        base.source, dest, config.int8_nodes_to_exclude + blocked),
        ordering="largest parity gain per weight element when kept in fp32 alone first",
        costs=matmul_costs(graph, units))


def repair(precision: str, config: RunConfig, record: RunRecord, lab: ParityLab, bar: Progress) -> dict[str, Any]:
    """Search for nodes to keep in fp32 on the hardest batches, confirm on the full lab, write the repaired file.

    The search checks candidates on the corner batches and the corpus batches the unrepaired variant gets most
    wrong; when its winner then fails on the full set, the batches where it fails join and the search goes on
    (verdicts are re-taken, builds are budgeted). Each build is counted on `bar`.
    """
    started = time.perf_counter()
    providers = providers_for(config.device)
    hard: list[int] = []
    with _runner(precision, record.artifact(f"onnx.{precision}"), config) as runner:
        collected = lab.collect(runner, precision)
    for output in collected.values():
        hard += [i for i in output.hardest(HARD_TEXTS) if i not in hard]
    fp32 = record.artifact("onnx.fp32")
    batch = lab.latency_batch()
    checks = lab.subset(hard)

    def assess(path: Path) -> tuple[dict[str, Any], float]:
        with OrtRunner(precision, path, providers, config.threads) as runner:
            return checks.compare(runner, precision), median_ms(lambda: runner.infer(batch), repeats=5, warmup=1)

    def confirm(path: Path) -> dict[str, Any]:
        with _runner(precision, path, config) as runner:
            return lab.compare(runner, precision)

    def summarize(result: dict[str, Any]) -> dict[str, Any]:
        primary = result["outputs"][lab.primary.name]
        return {"failures": result["failures"],
                **{k: primary[k] for k in ("max_abs", "min_cosine", "agreement", "loss", "retrieval") if k in primary}}

    workdir = record.run_dir / "repair" / precision
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        base = None
        if precision == "int8":
            feeds = [b.feed for b in lab.sweep[::SMOOTHING_CALIBRATION_STRIDE]]
            base = choose_base(base_recipes(config.int8_per_channel), fp32, workdir, feeds,
                               config.int8_nodes_to_exclude, assess, confirm, summarize,
                               note=lambda text: bar.update(0, note=text))
        problem = repair_problem(precision, config, fp32, lab, base)
        search = RepairSearch(problem, assess, workdir, config.repair_max_builds, summarize, bar)
        errors: dict[str, Any] = {}
        if base is not None:
            problem.units = sensitivity_order(search, problem.costs)
            bar.update(0, note="qdq_loss_debug: int8 noise per MatMul")
            errors = node_errors(base.source, workdir, feeds, problem.units)
        for _ in range(REPAIR_ROUNDS):
            result = run_search(search)
            if search.best is None:
                break
            with _runner(precision, search.best[1], config) as runner:
                full = lab.collect(runner, precision)
            failing = [i for o in full.values() if not o.summary()["passed"] for i in o.hardest(HARD_TEXTS)]
            if not failing:
                break
            hard += [i for i in failing if i not in hard]
            checks = lab.subset(hard)
            search.reset_results()
        else:
            result["outcome"] = f"no candidate passed the full check after {REPAIR_ROUNDS} rounds"
        result["checked_batches"] = len(checks.batches)
        if base is not None:
            result["base"], result["bases"] = base.recipe.name, base.records
            agreement = agreement_with_sensitivity(errors, result["sensitivity"])
            result["node_error"] = {"tool": "onnxruntime.quantization.qdq_loss_debug", "per_node": errors,
                                    "spearman_vs_sensitivity": agreement}
        if search.best is not None:
            candidate, path = search.best
            blocked = list(candidate.blocked)
            if base is not None:
                result["recipes"] = blockwise_recipes(config, base, search, assess, confirm, summarize)
                winner = next((r for r in result["recipes"] if r["passed"]), None)
                if winner is not None:  # fewer weight elements kept in fp32 than the fp32-only repair
                    result["chosen"], path, blocked = winner, Path(winner.pop("path")), winner["blocked"]
            dest = record.run_dir / "onnx" / f"{precision}_repaired.onnx"
            onnxfiles.save(onnxfiles.load(path), dest)
            onnxfiles.remove(path)
            record.add_artifact(f"onnx.{precision}_repaired", dest, kind="onnx", variant=f"{precision}_repaired",
                                precision=precision, blocked=blocked,
                                **({"recipe": base.recipe.name} if base is not None else {}))
    finally:
        remove_candidates(workdir)  # no candidate file outlives the step, even when it is interrupted
    baseline = search.candidates.get(frozenset())
    result["before"] = baseline.record() if baseline else None
    result["latency_feed"] = list(batch.shape)
    result["seconds"] = round(time.perf_counter() - started, 2)  # the whole repair: recipes, rounds, diagnostics
    return result


def blockwise_recipes(config: RunConfig, base: ChosenBase, search: RepairSearch, assess: Any, confirm: Any,
                      summarize: Any) -> list[dict[str, Any]]:
    """The int8 repair's MatMuls as 8-bit block-quantized weights instead of fp32, one candidate per recipe: checked
    on the search's batches, then (if it passes there) on the full lab. Every recipe is recorded, lost ones too;
    passing ones come first, fewest fp32 weight elements first (from the graph), and only the first one's file is
    kept (its "path"). None when the repair kept no MatMul in fp32."""
    chosen = search.best[0]
    graph = onnxfiles.load(base.source, load_external_data=False)
    matmuls = [n.name for n in graph.graph.node if n.name in chosen.blocked and n.op_type == "MatMul"]
    if not matmuls:
        return []
    still_fp32 = tuple(u for u in chosen.blocked if u not in matmuls)
    recipes = []
    excluded = config.int8_nodes_to_exclude + list(chosen.blocked)
    for block, level in BLOCKWISE_RECIPES:
        path = search.workdir / f"candidate-blockwise-{block}.onnx"  # removed with the candidates if interrupted
        name = f"{len(matmuls)} MatMul{'s' * (len(matmuls) > 1)} as 8-bit block-{block} weights (MatMulNBits, " \
               f"accuracy level {level})"
        recipes.append({**measure_recipe(name, lambda path=path, block=block, level=level: quantize_int8_blockwise(
            base.source, path, base.recipe.per_channel, excluded, matmuls, block, level), path, assess, confirm,
            summarize), "blocked": list(still_fp32), "blockwise": matmuls, "fp32_cost": search.cost(still_fp32),
            "path": str(path)})
    recipes.sort(key=lambda r: (not r["passed"], r["fp32_cost"], r["violation"]))
    for index, recipe in enumerate(recipes):
        if index > 0 or not recipe["passed"]:
            onnxfiles.remove(Path(recipe.pop("path")))
    return recipes


def _runner(name: str, path: Path, config: RunConfig) -> OrtRunner:
    return OrtRunner(name, path, providers_for(config.device), config.threads)


def reproduce_script(record: RunRecord, inputs: Path, reference: Path, results: dict[str, Any]) -> Path:
    """A shell script that re-runs each ONNX variant against the saved PyTorch outputs with Polygraphy."""
    lines = ["#!/usr/bin/env bash",
             "# Re-run each variant on the saved corner-batch inputs and compare with the saved PyTorch outputs.",
             "# Polygraphy compares every element, padded positions included, by absolute/relative tolerance;",
             "# the workbench's cosine and label-agreement criteria (run.json metrics.parity) are not applied here.",
             'cd "$(dirname "$0")/.." || exit 1', "status=0"]
    variants = record.variants()
    for name, result in results.items():
        if name not in variants:
            continue
        outputs = result["outputs"]
        path = variants[name][0].relative_to(record.run_dir)
        command = ["polygraphy run", shlex.quote(str(path)), "--onnxrt --providers cpu",
                   "--load-inputs", str(inputs.relative_to(record.run_dir)),
                   "--load-outputs", str(reference.relative_to(record.run_dir)), "--check-error-stat max"]
        lines.append(f"echo '== {name}'")
        if all("atol" in o["tolerance"] for o in outputs.values()):
            command += ["--atol", *(f"{n}:{o['tolerance']['atol']:g}" for n, o in outputs.items()),
                        "--rtol", *(f"{n}:{o['tolerance'].get('rtol', 0):g}" for n, o in outputs.items())]
            lines.append(" ".join(command) + " || status=1")
        else:
            lines.append(f"# {name} is judged by cosine / label agreement, not an absolute tolerance: "
                         "Polygraphy shows its error statistics only")
            lines.append(" ".join(command) + " || true")
    lines.append("exit $status")
    return write_text(record.run_dir / "parity" / "reproduce.sh", "\n".join(lines) + "\n")


def check_module(config: RunConfig, record: RunRecord, loaded: LoadedModel, texts: tuple[str, ...]) -> None:
    """The PyTorch module every variant is compared with, against what the model's users run today (its own
    library); recorded, and the step fails here when they differ: every verdict after would be against the wrong
    reference."""
    with Progress("module vs the model's own library", 1, "checks") as bar:
        check = library_check(config, loaded, texts)
        bar.update(1, note="pass" if check.get("passed", True) else "FAIL")
    record.set_metric(f"{STEP}.reference", check)
    if check["checked"] and not check["passed"]:
        raise ReferenceMismatchError(
            f"the workbench's PyTorch module does not return what {check['reference']} returns on the same texts: "
            f"{'; '.join(check['failures'])}",
            "read metrics.parity.reference in run.json; check the model's sentence-transformers files (modules.json, "
            "1_Pooling/config.json) and -p pooling, or report the model: the export would not serve what its users "
            "get today")


def run(config: RunConfig, record: RunRecord) -> StepEntry:
    """Compare every variant with PyTorch; repair failing fp16/int8 variants; fp32 variants must pass."""
    with record.step(STEP):
        variants = record.variants()
        if not variants:
            raise MissingArtifactError(f"the run in {record.run_dir} has no ONNX variant to compare",
                                       "run the export and optimize steps first: --steps export,optimize,parity")
        loaded = load_model(config)
        texts = load_corpus(config.corpus)
        check_module(config, record, loaded, texts)
        lab = ParityLab.build(config, loaded, texts)
        record.set_metric(f"{STEP}.inputs", {
            "texts": len(lab.texts), "batches": [{"name": b.name, "shape": list(b.shape)} for b in lab.batches],
            "reference": lab.reference.name, "reference_seconds": round(lab.reference_seconds, 3)})
        results: dict[str, Any] = {}
        for name in track(list(variants), STEP, "variants"):
            path, precision = variants[name]
            with _runner(name, path, config) as runner:
                record.note_providers(runner.providers)
                results[name] = lab.compare(runner, precision)
            record.set_metric(f"{STEP}.variants.{name}", results[name])
        if config.repair:
            for precision in ("fp16", "int8"):
                if precision in results and not results[precision]["passed"]:
                    with Progress(f"repair {precision}", config.repair_max_builds, "candidates") as bar:
                        outcome = repair(precision, config, record, lab, bar)
                    record.set_metric(f"{STEP}.repair.{precision}", outcome)
                    repaired = f"{precision}_repaired"
                    if repaired in record.variants():
                        with _runner(repaired, record.artifact(f"onnx.{repaired}"), config) as runner:
                            results[repaired] = lab.compare(runner, precision)
                        record.set_metric(f"{STEP}.variants.{repaired}", results[repaired])
        inputs, reference = lab.save_polygraphy_data(record.run_dir / "parity")
        script = reproduce_script(record, inputs, reference, results)
        record.add_artifact("parity.inputs", inputs, kind="polygraphy-inputs")
        record.add_artifact("parity.reference", reference, kind="polygraphy-outputs")
        record.add_artifact("parity.reproduce", script, kind="script")
        for name in EXACT_VARIANTS:
            if name in results:
                raise_if_failed(name, results[name])
    return record.step_entry(STEP)


SPEC = StepSpec(
    STEP, 3, "every variant vs PyTorch on real text; fp16/int8 precision repair", run, parity_lines,
    sections=(Section("Parity against PyTorch", parity_section),),
    needs=("model",), reads=("optimize",), machine=("torch", "onnxruntime"), owns=("parity", "repair"))

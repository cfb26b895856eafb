"""Precision repair of a failing fp16 or int8 variant: for int8 the whole-graph recipe first (`recipes`), then the
search for nodes to keep in fp32 (`search`), each candidate judged by a `Checker`; for int8 also the kept MatMuls as
8-bit block-quantized weights. Rounds: a winner that fails the full lab adds its failing texts to the search's
batches and the search goes on."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from workbench.core.progress import Progress
from workbench.graphs import onnxfiles
from workbench.graphs.nncf_int8 import keep_in_float, noise_order, quantizer_costs
from workbench.graphs.variants import convert_fp16, keep_in_fp32, quantize_int8_blockwise
from workbench.precision.checker import Checker
from workbench.precision.nodeerror import agreement_with_sensitivity, node_errors
from workbench.precision.recipes import ChosenBase, base_recipes, choose_base, measure_recipe
from workbench.precision.search import (
    RANKED_BY,
    BudgetSpent,
    RepairProblem,
    RepairSearch,
    activation_order,
    matmul_costs,
    noted_metric,
    remove_candidates,
    run_search,
    sensitivity_order,
)
from workbench.precision.tables import NodeError, RecipeResult, RepairCandidate, RepairOutcome
from workbench.runners.timing import Budget

REPAIR_ROUNDS = 3
# Recipes tried on an int8 repair's MatMuls instead of fp32: 8-bit block-quantized weights (MatMulNBits) with these
# block sizes, accuracy level 4 (int8 compute). Smaller blocks follow the weights more closely.
BLOCKWISE_RECIPES = ((16, 4), (32, 4), (128, 4))
SMOOTHING_CALIBRATION_STRIDE = 4  # every 4th corpus batch measures the activation ranges smoothing balances


@dataclass(frozen=True)
class RepairPlan:
    """What the user fixed for the conversions (nodes and op types never converted) and the repair's bounds: builds
    and seconds."""

    max_builds: int
    budget_s: float
    fp16_op_block_list: list[str] = field(default_factory=list)
    fp16_node_block_list: list[str] = field(default_factory=list)
    int8_nodes_to_exclude: list[str] = field(default_factory=list)
    int8_per_channel: bool = True


@dataclass
class Repaired:
    """A repair's record (run.json metrics.parity.repair.<precision>) and, when one passed, the nodes the file
    written to the destination keeps in fp32 and the int8 recipe it was built with."""

    result: RepairOutcome
    blocked: list[str] | None = None
    recipe: str | None = None


def repair_problem(precision: str, settings: RepairPlan, fp32: Path, checker: Checker,
                   base: ChosenBase | None = None) -> RepairProblem:
    """fp16: node block list, nodes ordered by activation magnitude; int8: nodes to exclude from `base`'s recipe
    (its fp32 graph, smoothed or not), by sensitivity.

    Both rank passing candidates by the matmul work they keep in fp32 (`matmul_costs`), never by a timing.
    """
    graph = onnxfiles.skeleton(fp32)
    if precision == "fp16":
        from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST

        blocked_ops = set(DEFAULT_OP_BLOCK_LIST) | set(settings.fp16_op_block_list) | {"Cast"}
        units = ({n.name for n in graph.graph.node if n.op_type not in blocked_ops}
                 - set(settings.fp16_node_block_list))
        feeds = checker.lab.sample_feeds()
        ordered = activation_order(fp32, feeds, units)
        return RepairProblem("fp16", ordered, lambda blocked, dest: convert_fp16(
            fp32, dest, settings.fp16_op_block_list, settings.fp16_node_block_list + blocked),
            ordering="largest fp32 activation first", costs=matmul_costs(graph, ordered))
    from onnxruntime.quantization.registry import IntegerOpsRegistry

    assert base is not None, "an int8 repair starts from a chosen base recipe"
    weights = {i.name for i in graph.graph.initializer}
    units = [n.name for n in graph.graph.node  # a Gather is quantized only where it reads a table (embeddings)
             if n.op_type in IntegerOpsRegistry and n.name not in settings.int8_nodes_to_exclude
             and (n.op_type != "Gather" or n.input[0] in weights)]
    return RepairProblem("int8", units, int8_builder(base, settings.int8_nodes_to_exclude),
                         ordering="largest parity gain per weight element when kept in fp32 alone first (measured "
                                  "on the hard texts' batches)",
                         costs=matmul_costs(graph, units))


def int8_builder(base: ChosenBase, excluded: list[str]) -> Callable[[list[str], Path], None]:
    """Builds an int8 candidate keeping `blocked` nodes in fp32: `base`'s recipe quantizes the graph once (on the
    first build, into the search's folder), then each candidate splices its nodes' fp32 form into that graph
    (`variants.keep_in_fp32`), a graph edit instead of a new quantization."""
    from onnx import ModelProto

    @cache
    def graphs(folder: Path) -> tuple[ModelProto, ModelProto]:
        """The base quantized (built in `folder`, removed with the candidates if interrupted) and its source."""
        quantized = folder / "candidate-int8-base.onnx"
        base.recipe.build(base.source, quantized, excluded)
        try:
            return onnxfiles.load(quantized), onnxfiles.load(base.source)
        finally:
            onnxfiles.remove(quantized)

    def build(blocked: list[str], dest: Path) -> None:
        onnxfiles.save(keep_in_fp32(*graphs(dest.parent), blocked), dest)

    return build


def openvino_int8_problem(quantized: Path, original: Path, checker: Checker) -> RepairProblem:
    """NNCF's int8 (`graphs.nncf_int8`): quantizers to undo (`keep_in_float`), noisiest on the lab's batches first
    (`noise_order`); a quantizer costs the weights of the MatMuls it feeds in the exported graph."""
    feeds = checker.lab.sample_feeds()
    units = list(noise_order(quantized, original, feeds))
    graph = onnxfiles.skeleton(original)
    matmuls = [node.name for node in graph.graph.node if node.op_type in ("MatMul", "Gemm")]
    return RepairProblem("int8", units, lambda blocked, dest: keep_in_float(quantized, original, dest, blocked),
                         ordering="noisiest quantizer first (SQNR on the lab's batches)",
                         costs=quantizer_costs(quantized, matmul_costs(graph, matmuls)))


def repair(checker: Checker, settings: RepairPlan, fp32: Path, workdir: Path, dest: Path,
           bar: Progress, problem: RepairProblem | None = None) -> Repaired:
    """Search for nodes to keep in fp32 on the hardest batches, confirm on the full lab, write the repaired file to
    `dest` (candidates are built in `workdir`, none outlives the call, even when it is interrupted).

    The search checks candidates on the corner batches and the corpus batches the unrepaired variant gets most
    wrong; when its winner then fails on the full set, the batches where it fails join and the search goes on
    (verdicts are re-taken). Builds are bounded by `settings.max_builds` and the whole repair by
    `settings.budget_s`: when either is spent the best candidate found is confirmed on the full lab and written
    only if it passes there; otherwise the outcome names the bound and the closest candidate. Each build is
    counted on `bar`. A `problem` given (another quantizer's, `openvino_int8_problem`) is searched as it is, without
    ONNX Runtime's int8 recipes.
    """
    budget = Budget(settings.budget_s)
    precision, lab = checker.precision, checker.lab
    workdir.mkdir(parents=True, exist_ok=True)
    blocked: list[str] | None = None
    try:
        base = None
        if precision == "int8" and problem is None:
            feeds = [b.feed for b in lab.sweep[::SMOOTHING_CALIBRATION_STRIDE]]
            base = choose_base(base_recipes(settings.int8_per_channel), fp32, workdir, feeds,
                               settings.int8_nodes_to_exclude, checker, budget,
                               note=lambda text: bar.update(0, note=f"{text}; {budget.left():.0f} s left"))
        problem = problem or repair_problem(precision, settings, fp32, checker, base)
        search = RepairSearch(problem, checker, workdir, settings.max_builds, budget, bar)
        result, confirmed = search_rounds(search, checker, base)
        errors = {}
        if base is not None and not base.passed and problem.sensitivity and not budget.spent:
            bar.update(0, note="qdq_loss_debug: int8 noise per MatMul")
            errors = node_errors(base.source, workdir, feeds, problem.units)
        result.checked_batches = len(checker.checks.batches)
        result.probes = search.probes
        if base is not None:
            result.base, result.bases = base.recipe.name, base.records
        if errors:
            agreement = agreement_with_sensitivity(errors, result.sensitivity)
            result.node_error = NodeError(tool="onnxruntime.quantization.qdq_loss_debug", per_node=errors,
                                          spearman_vs_sensitivity=agreement)
        if search.best is not None and confirmed:
            candidate, path = search.best
            blocked = list(candidate.blocked)
            if base is not None and not budget.spent:
                result.recipes, kept = blockwise_recipes(settings, base, search, checker)
                if kept is not None:  # fewer weight elements kept in fp32 than the fp32-only repair
                    result.chosen, path, blocked = result.recipes[0], kept, result.recipes[0].blocked
            onnxfiles.save(onnxfiles.load(path), dest)
            onnxfiles.remove(path)
        baseline = search.candidates.get(frozenset())
        result.before = baseline.record() if baseline else None
        result.latency_feed = list(checker.batch.shape)
        result.seconds = round(budget.used(), 2)  # the whole repair: recipes, rounds, diagnostics
        result.budget_s = settings.budget_s
    finally:
        remove_candidates(workdir)  # no candidate file outlives the step, even when it is interrupted
    return Repaired(result, blocked, base.recipe.name if base is not None and blocked is not None else None)


def search_rounds(search: RepairSearch, checker: Checker, base: ChosenBase | None) -> tuple[RepairOutcome, bool]:
    """The search's rounds (a winner failing the full lab adds the texts it fails on), then the outcome: whether the
    best candidate passed the full lab (`confirmed`), else why not and how close the closest candidate came."""
    confirmed = False
    if base is not None and not base.passed:  # what each unit costs in int8: only a failing base needs it
        try:
            search.problem.units = sensitivity_order(search, search.problem.costs)
        except BudgetSpent as spent:
            return unrepaired(search, str(spent), base=base, stopped=str(spent)), False
    for _ in range(REPAIR_ROUNDS):
        result = run_search(search)
        if search.best is None:
            break
        confirmed = not checker.add_failing(checker.collect(search.best[1]))
        if confirmed or result.outcome != "repaired":
            break
        search.reset_results()
    else:
        result.outcome = f"no candidate passed the full check after {REPAIR_ROUNDS} rounds"
    if not confirmed and (search.best is not None or result.stopped):
        if search.best is not None:
            search.discard()
        return unrepaired(search, result.outcome, result, base, result.stopped), False
    if confirmed and result.stopped:  # a bound ended the search: its best passed the full lab
        result.outcome = "repaired"
    return result, confirmed


def unrepaired(search: RepairSearch, why: str, result: RepairOutcome | None = None,
               base: ChosenBase | None = None, stopped: str | None = None) -> RepairOutcome:
    """The record of a repair that wrote nothing: why (a bound spent, `stopped`, or no candidate passing the full
    lab) and the closest candidate's numbers (the chosen whole-graph recipe's, when the search built none)."""
    closest = search.closest()
    found: RepairCandidate | None = search.describe(closest) if closest else next(
        (r for r in (base.records if base else []) if r.chosen), None)
    reached = ""
    if found is not None:
        metric = noted_metric(found) or f"violation {found.violation:.3g}"
        recipe = next((r.recipe for r in (base.records if base else []) if r.chosen), None)
        what = f"recipe: {found.recipe}" if isinstance(found, RecipeResult) else \
            ", ".join([*([f"recipe: {recipe}"] if recipe else []), f"{len(found.blocked)} units in fp32"])
        reached = f": the closest candidate ({what}) reached {metric}"
    outcome = f"not repaired: {why}{reached}"
    if result is None:
        result = RepairOutcome(precision=search.problem.precision, ordering=search.problem.ordering,
                               ranked_by=RANKED_BY, units=len(search.problem.units), chosen=None,
                               candidates=search.history, sensitivity=search.problem.sensitivity, outcome=outcome)
    else:
        result = result.model_copy(update={"chosen": None, "outcome": outcome})
    result.closest, result.stopped = found, stopped
    return result


def blockwise_recipes(settings: RepairPlan, base: ChosenBase, search: RepairSearch,
                      checker: Checker) -> tuple[list[RecipeResult], Path | None]:
    """The int8 repair's MatMuls as 8-bit block-quantized weights instead of fp32, one candidate per recipe, measured
    as a whole-graph recipe is (`recipes.measure_recipe`). Every recipe is recorded, lost ones too;
    passing ones come first, fewest fp32 weight elements first (from the graph), and only the first one's file is
    kept (returned with them where it passed). None when the repair kept no MatMul in fp32."""
    assert search.best is not None, "block-quantized recipes replace a repair's fp32 MatMuls"
    chosen = search.best[0]
    graph = onnxfiles.skeleton(base.source)
    matmuls = [n.name for n in graph.graph.node if n.name in chosen.blocked and n.op_type == "MatMul"]
    if not matmuls:
        return [], None
    still_fp32 = tuple(u for u in chosen.blocked if u not in matmuls)
    recipes: list[tuple[RecipeResult, Path]] = []
    excluded = settings.int8_nodes_to_exclude + list(chosen.blocked)
    for block, level in BLOCKWISE_RECIPES:
        path = search.workdir / f"candidate-blockwise-{block}.onnx"  # removed with the candidates if interrupted
        name = f"{len(matmuls)} MatMul{'s' * (len(matmuls) > 1)} as 8-bit block-{block} weights (MatMulNBits, " \
               f"accuracy level {level})"
        measured = measure_recipe(name, lambda path=path, block=block, level=level: quantize_int8_blockwise(
            base.source, path, base.recipe.per_channel, excluded, matmuls, block, level), path, checker)
        recipes.append((measured.model_copy(update={"blocked": list(still_fp32), "blockwise": matmuls,
                                                    "fp32_cost": search.cost(still_fp32)}), path))
    recipes.sort(key=lambda r: (not r[0].passed, r[0].fp32_cost or 0.0, r[0].violation))
    for index, (recipe, path) in enumerate(recipes):
        if index > 0 or not recipe.passed:
            onnxfiles.remove(path)
    return [recipe for recipe, _ in recipes], recipes[0][1] if recipes[0][0].passed else None

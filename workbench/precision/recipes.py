"""Whole-graph int8 recipes the repair measures before its node search: weights per channel or per tensor,
activations smoothed first (SmoothQuant-style, at several strengths) or not, and smoothed except for the down
projections, whose activations get per-token scales instead. Each is built from the fp32 graph,
checked on the hard texts' batches and timed (then, while it passes, with the corner batches and on the full lab); the
most accurate one is the base the search keeps nodes in fp32 from. Every recipe is recorded, lost ones too."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from workbench.graphs import onnxfiles
from workbench.graphs.variants import (
    activation_ranges,
    down_projections,
    per_token_scales,
    quantize_int8,
    smooth_activations,
)
from workbench.models.batches import Feed
from workbench.precision.tables import RecipeResult
from workbench.runners.timing import Budget, elapsed

if TYPE_CHECKING:
    from workbench.precision.checker import Checker

SMOOTHING_ALPHAS = (0.7, 0.85, 0.5)  # how much of an outlier channel's range moves from activation to weight
# Where a recipe is checked, each while it passes the one before: its record's `checked_on` names the last.
STAGES = ("the hard texts' batches", "the same with the corner batches", "full lab")


@dataclass(frozen=True)
class BaseRecipe:
    """How the whole graph is quantized: per-channel or per-tensor weights; activations smoothed with `alpha`;
    with `per_token`, the down projections are not smoothed but get per-token activation scales
    (graphs.variants.per_token_scales)."""

    per_channel: bool
    alpha: float | None = None
    per_token: bool = False

    @property
    def name(self) -> str:
        weights = "per-channel" if self.per_channel else "per-tensor"
        return (f"{weights} weights" + (f", smoothed (alpha {self.alpha})" if self.alpha is not None else "")
                + (", down projections scaled per token instead" if self.per_token else ""))

    def source(self, fp32: Path, workdir: Path, ranges: Callable[[], Feed]) -> Path:
        """The fp32 graph to quantize: `fp32` itself, or a smoothed (and per-token-scaled) copy in `workdir` (a
        candidate file, removed with the search's candidates), from the activation `ranges` (measured once)."""
        if self.alpha is None:
            return fp32
        dest = workdir / f"candidate-smoothed-{self.alpha}{'-per-token' * self.per_token}.onnx"
        if not self.per_token:
            smooth_activations(fp32, dest, ranges(), self.alpha)
            return dest
        smoothed = dest.with_name(f"{dest.stem}-smoothed.onnx")
        down = {n.name for n in down_projections(onnxfiles.skeleton(fp32))}
        smooth_activations(fp32, smoothed, ranges(), self.alpha, exclude=down)
        per_token_scales(smoothed, dest)
        onnxfiles.remove(smoothed)
        return dest

    def build(self, source: Path, dest: Path, nodes_to_exclude: list[str]) -> None:
        quantize_int8(source, dest, self.per_channel, nodes_to_exclude)


def base_recipes(per_channel: bool) -> list[BaseRecipe]:
    """The configured weight granularity alone first (the fewest operators; it wins ties), then smoothing with
    per-token scales on the down projections at each strength, smoothing alone at each, and the other granularity
    last: the order they passed in on trained models (all-MiniLM-L6-v2 and all-mpnet-base-v2 both passed first with
    per-token scales at alpha 0.7; plain per-channel weights reached min cosine 0.95 and 0.61, per-tensor 0.48 on
    MPNet), so a repair stops at its first passing recipe after two builds, not seven."""
    return [BaseRecipe(per_channel),
            *(BaseRecipe(per_channel, alpha, per_token=True) for alpha in SMOOTHING_ALPHAS),
            *(BaseRecipe(per_channel, alpha) for alpha in SMOOTHING_ALPHAS), BaseRecipe(not per_channel)]


def measure_recipe(name: str, build: Callable[[], object], path: Path, checker: Checker) -> RecipeResult:
    """A recipe's record: `build` it to `path` (timed), check it on the hard texts' batches (parity result, latency
    ms) and, as long as it passes, on the search's batches (the corners too) and on the full lab (`STAGES`)."""
    seconds = elapsed(build)
    result, latency_ms = checker.assess(path, checker.probe_lab)
    checked_on = STAGES[0]
    for stage, lab in zip(STAGES[1:], (checker.with_corners, checker.lab), strict=True):
        if not result.passed:
            break
        result, checked_on = checker.check(path, lab), stage
    return RecipeResult(recipe=name, checked_on=checked_on, latency_ms=round(latency_ms, 3),
                        build_seconds=round(seconds, 3), **checker.summarize(result).recorded())


def rank(record: RecipeResult, index: int) -> tuple[bool, int, float, float, int]:
    """How close a recipe came to the gate: passed, then the furthest stage reached, then the violation and loss
    measured there (so recipes are compared on the same batches), then the order tried."""
    return (not record.passed, -STAGES.index(record.checked_on), record.violation, record.loss or 0.0, index)


@dataclass
class ChosenBase:
    recipe: BaseRecipe
    source: Path  # the fp32 graph (smoothed or not) the repair quantizes
    records: list[RecipeResult]

    @property
    def passed(self) -> bool:
        """The base passed the full lab with nothing kept in fp32."""
        return any(r.chosen and r.passed for r in self.records)


def choose_base(recipes: list[BaseRecipe], fp32: Path, workdir: Path, feeds: list[Feed],
                excluded: list[str], checker: Checker, budget: Budget, note: Callable[[str], None]) -> ChosenBase:
    """Build every recipe with nothing but `excluded` kept in fp32 and measure it (`measure_recipe`, `checker`),
    until one passes the full lab or `budget` is spent (one recipe at least). The base is the recipe that passed,
    else the one closest to the gate (`rank`): accuracy decides, never a timing. `note` hears which recipe is being
    built."""
    records: list[RecipeResult] = []
    sources: list[Path] = []
    measured: list[Feed] = []

    def ranges() -> Feed:
        """The fp32 activation ranges smoothing balances, measured on `feeds` the first time a recipe asks."""
        if not measured:
            measured.append(activation_ranges(fp32, feeds))
        return measured[0]

    for index, recipe in enumerate(recipes):
        if records and (records[-1].passed or budget.spent):
            break
        note(f"whole-graph recipe {index + 1} of {len(recipes)}: {recipe.name}")
        path = workdir / f"candidate-base-{index}.onnx"

        def build(recipe: BaseRecipe = recipe, path: Path = path) -> None:
            sources.append(recipe.source(fp32, workdir, ranges))
            recipe.build(sources[-1], path, excluded)

        records.append(measure_recipe(recipe.name, build, path, checker).model_copy(update={
            "per_channel": recipe.per_channel, "smoothing_alpha": recipe.alpha, "per_token": recipe.per_token}))
        onnxfiles.remove(path)
    best = min(range(len(records)), key=lambda i: rank(records[i], i))
    for index, record in enumerate(records):
        record.chosen = index == best
        if index != best and sources[index] != fp32:
            onnxfiles.remove(sources[index])
    return ChosenBase(recipes[best], sources[best], records)

"""The parity step's figures: error quantiles, worst texts, and what each repair tried."""
from __future__ import annotations

import plotly.graph_objects as go

from workbench.core.results import Verdict
from workbench.precision.tables import RecipeResult, RepairCandidate, RepairOutcome
from workbench.report.figures import formatted, table


def error_distribution(results: dict[str, Verdict]) -> go.Figure:
    """Absolute-error quantiles of the main output per variant (log scale)."""
    figure = go.Figure()
    for variant, result in results.items():
        out = result.outputs[result.primary]
        labels = [*out.quantiles, "max"]
        values = [*out.quantiles.values(), out.max_abs or 0.0]
        figure.add_scatter(name=variant, x=labels, y=[max(v, 1e-12) for v in values], mode="lines+markers")
    name = next(iter(results.values())).primary if results else ""
    figure.update_layout(title=f"Absolute error quantiles of {name} vs PyTorch", yaxis_type="log",
                         xaxis_title="quantile over every compared value",
                         yaxis_title="absolute error |variant - PyTorch| (output units)")
    return figure


def worst_texts(results: dict[str, Verdict], variant: str) -> go.Figure:
    """The texts a variant gets most wrong (1 - cosine of the main output, or its max abs error)."""
    texts = results[variant].worst_texts[::-1]
    figure = go.Figure(go.Bar(x=[t.error for t in texts], y=[f"#{t.text_id}: {_opening(t.text)}" for t in texts],
                              orientation="h", hovertext=[t.text for t in texts]))
    figure.update_layout(title=f"Worst texts for {variant}", xaxis_title=texts[0].metric if texts else "",
                         yaxis_title="text (corpus id)",
                         height=200 + 30 * len(texts), margin={"l": 380})
    return figure


def _opening(text: str, limit: int = 50) -> str:
    """`text` up to `limit` characters, cut after a whole word (`...` where cut)."""
    if len(text) <= limit:
        return text
    cut = text[:limit + 1].rsplit(" ", 1)[0] if " " in text[:limit + 1] else text[:limit]
    return f"{cut.rstrip(' ,.;:')}..."


def repair_tradeoff(repair: RepairOutcome) -> go.Figure:
    """Every candidate the repair built: latency against accuracy; the chosen one and the unrepaired one marked."""
    candidates = repair.candidates
    metric = "min_cosine" if candidates and candidates[0].min_cosine is not None else "max_abs"
    figure = go.Figure()
    for passed in (True, False):
        group = [c for c in candidates if c.passed is passed]
        figure.add_scatter(name="passes" if passed else "fails", mode="markers",
                           x=[c.latency_ms for c in group], y=[getattr(c, metric) for c in group],
                           marker={"size": [6 + len(c.blocked) for c in group]},
                           hovertext=[f"{len(c.blocked)} nodes kept in fp32{_retrieval_note(c)}" for c in group])
    for label, symbol, recipes in (("whole-graph recipes (weights, smoothing)", "square", repair.bases),
                                   ("8-bit block-wise MatMuls", "diamond", repair.recipes)):
        if recipes:
            figure.add_scatter(name=label, mode="markers", marker={"symbol": symbol, "size": 12},
                               x=[r.latency_ms for r in recipes], y=[getattr(r, metric) for r in recipes],
                               hovertext=[f"{r.recipe}: {'passes' if r.passed else 'fails'}"
                                          f"{' (the base)' if r.chosen else ''}{_retrieval_note(r)}"
                                          for r in recipes])
    before, chosen = before_and_after(repair)
    star = {"symbol": "star", "size": 20, "line": {"width": 1.5, "color": "black"}}
    for label, entry, marker in ((f"before repair{_recipe_of(before)}", before if before is not chosen else None,
                                  {"symbol": "x", "size": 14, "line": {"width": 2}}),
                                 (f"chosen{_recipe_of(chosen)}" + (" (passed as it was: nothing to repair)"
                                                                   if before is chosen else ""), chosen, star)):
        if entry:
            figure.add_scatter(name=label, mode="markers", x=[entry.latency_ms], y=[getattr(entry, metric)],
                               marker=marker)
    figure.update_layout(title=f"{repair.precision} repair: accuracy vs latency ({repair.outcome})",
                         xaxis_title="latency (ms)" + (" at batch {} x sequence {}".format(*repair.latency_feed)
                                                       if repair.latency_feed else ""),
                         yaxis_title=f"{metric.replace('_', ' ')} on the hard texts (marker size: nodes kept in fp32)")
    return figure


def before_and_after(repair: RepairOutcome) -> tuple[RepairCandidate | None, RepairCandidate | None]:
    """The quantization as the variant had it (the first whole-graph recipe: the configured granularity alone) and
    what the repair chose, each with the numbers the recipes table shows where it is one of its recipes (the same
    object where the repair chose that recipe as it was)."""
    before = repair.bases[0] if repair.bases else repair.before
    chosen = repair.chosen
    if chosen is not None and not chosen.blocked:  # a whole-graph recipe passed as it is: that recipe's row
        chosen = next((r for r in repair.bases if r.chosen), chosen)
    return before, chosen


def _recipe_of(entry: RepairCandidate | None) -> str:
    return f" ({entry.recipe})" if isinstance(entry, RecipeResult) else ""


def _retrieval_note(entry: RepairCandidate) -> str:
    retrieval = entry.retrieval
    return (f"; agreement@1 {retrieval['agreement_at_1']:.3f}, recall@10 {retrieval['recall_at_10']:.3f}"
            if retrieval else "")


def sensitivity_figure(repair: RepairOutcome) -> go.Figure:
    """Per-node gain in mean error when that node alone stays in fp32."""
    items = sorted(repair.sensitivity.items(), key=lambda kv: kv[1])
    figure = go.Figure(go.Bar(x=[v for _, v in items], y=[k for k, _ in items], orientation="h"))
    figure.update_layout(title=f"{repair.precision}: error reduction when one node stays fp32",
                         xaxis_title="loss removed (1 - mean cosine, or mean absolute error)", yaxis_title="node",
                         height=200 + 22 * len(items), margin={"l": 380})
    return figure


def recipes_table(repair: RepairOutcome) -> go.Figure:
    """The int8 recipes the repair measured, won and lost: whole-graph ones first (the base marked), then the
    block-wise MatMul ones on top of the node search's result."""
    rows = [[("base: " if r.chosen else "") + r.recipe, "whole graph, nothing in fp32", *_recipe_cells(r)]
            for r in repair.bases]
    rows += [[r.recipe, f"{len(r.blocked)} other units in fp32", *_recipe_cells(r)] for r in repair.recipes]
    header = ["recipe", "applied to", "verdict", "min cosine", "recall@10", "latency (ms)", "checked on"]
    return table(f"{repair.precision} recipes measured by the repair", header, rows)


def _recipe_cells(recipe: RecipeResult) -> list[str]:
    recall = f"{recipe.retrieval['recall_at_10']:.3f}" if recipe.retrieval else ""
    return ["pass" if recipe.passed else "fail", formatted(recipe.min_cosine, ".4f"), recall,
            formatted(recipe.latency_ms, ".2f"), recipe.checked_on]


def node_error_figure(repair: RepairOutcome) -> go.Figure:
    """qdq_loss_debug's quantization noise per MatMul (input activation and weight SQNR, lower is worse)."""
    errors = repair.node_error
    items = sorted(errors.per_node.items(), key=lambda kv: -(kv[1]["input_sqnr_db"] or 0))
    figure = go.Figure()
    for key, label in (("input_sqnr_db", "input activation"), ("weight_sqnr_db_per_channel", "weight per channel"),
                       ("weight_sqnr_db_per_tensor", "weight per tensor")):
        figure.add_bar(name=label, orientation="h", x=[e[key] for _, e in items], y=[n for n, _ in items])
    rho = errors.spearman_vs_sensitivity
    agreement = f"; Spearman vs measured sensitivity {rho:.2f}" if rho is not None else ""
    figure.update_layout(title=f"{repair.precision}: int8 noise per MatMul (qdq_loss_debug){agreement}",
                         xaxis_title="signal-to-quantization-noise ratio (dB, lower is worse)", yaxis_title="node",
                         barmode="group", height=200 + 36 * len(items), margin={"l": 380})
    return figure

"""Plotly figures built from run.json metrics; notebooks and the report show the same ones."""
from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass

import plotly.graph_objects as go

from workbench.core.measured import BatchingSearch, BatchingSweeps, Efficiency, LatencyGrid, Levels, ServedBenchmark
from workbench.core.results import (
    BatchingBurst,
    ExportMetrics,
    GraphStats,
    Histogram,
    OptimizeMetrics,
    RecipeResult,
    RepairCandidate,
    RepairOutcome,
    TensorrtMetrics,
    Verdict,
)
from workbench.measure.capacity import Capacity
from workbench.runners.onnxruntime import SessionSettings
from workbench.serving.deploy import Scaling

_ROW_PX = 28
_LINE_PX = 18  # one more line of a wrapped cell
_LINE_CHARS = 150  # about how many characters of a table's cells fit across a notebook or report.html
_WIDEST = 48  # a column's share of the width, in characters, at most: a long cell wraps, the headers beside it stay


@dataclass(frozen=True)
class Snippet:
    """Lines of code a report section shows as they are, beside its figures."""

    lines: tuple[str, ...]

    def to_html(self) -> str:
        return f"<pre class=\"snippet\"><code>{html.escape(chr(10).join(self.lines))}</code></pre>"

    def show(self) -> None:
        print("\n".join(self.lines))


def table(title: str, header: list[str], rows: Sequence[Sequence[object]]) -> go.Figure:
    """A table sized to its content: columns as wide as their longest cell, one line per row, tight margins."""
    texts = [[str(v) for v in row] for row in rows]
    widths = [min(_WIDEST, max([len(h)] + [len(row[i]) for row in texts]) + 2) for i, h in enumerate(header)]
    shrink = min(1.0, _LINE_CHARS / sum(widths))  # plotly narrows the columns to the page, in proportion
    lines = [max(math.ceil(len(cell) / max(1.0, width * shrink - 2)) for cell, width in zip(row, widths))
             for row in texts]  # a long cell wraps: its row grows, and so must the figure, or the last row is cut
    figure = go.Figure(go.Table(columnwidth=widths, header={"values": header, "height": _ROW_PX},
                                cells={"values": list(zip(*texts)) if texts else [], "height": _ROW_PX}))
    figure.update_layout(title=title, height=70 + _ROW_PX * 2 + _LINE_PX * sum(max(1, n) for n in lines)
                         + (_ROW_PX - _LINE_PX) * len(lines), margin={"t": 50, "b": 10, "l": 20, "r": 20})
    return figure


def io_table(export: ExportMetrics) -> go.Figure:
    """Graph inputs and outputs with their symbolic shapes."""
    sides = (("input", export.io.inputs), ("output", export.io.outputs))
    rows = [(kind, name, " x ".join(map(str, shape))) for kind, found in sides for name, shape in found.items()]
    return table(f"{export.architecture} exported with {export.exporter} (opset {export.opset}): {export.nodes} nodes",
                 ["", "name", "shape"], rows)


def variants_table(optimized: OptimizeMetrics, megabytes: dict[str, float]) -> go.Figure:
    """Every variant the run holds: the runtime that runs it, its graph's nodes and fused operators (ONNX Runtime's),
    its file size, and what its trial found (OpenVINO's)."""
    trials = {"openvino": optimized.openvino, "openvino_bf16": optimized.openvino_bf16,
              "openvino_int8": optimized.openvino_int8}
    rows = []
    for variant, size in megabytes.items():
        stats, trial = optimized.variants.get(variant), trials.get(variant)
        fused = ", ".join(f"{op} {n}" for op, n in stats.fused.items()) if stats else "at compile time (OpenVINO)"
        note = (trial.reason if trial else stats.warning if stats else "") or ""
        rows.append((variant, "OpenVINO" if variant in trials else "ONNX Runtime", stats.nodes if stats else "",
                     fused, f"{size:.1f}", note))
    return table(f"{len(rows)} variants in this run", ["variant", "runs on", "nodes", "fused operators", "MB", "note"],
                 rows)


def fusion_figure(fusions: dict[str, GraphStats]) -> go.Figure:
    """Fused-operator counts per ONNX Runtime variant (bars) and node counts (in the legend names)."""
    ops = sorted({op for stats in fusions.values() for op in stats.fused})
    figure = go.Figure()
    for variant, stats in fusions.items():
        figure.add_bar(name=f"{variant} ({stats.nodes} nodes)", x=ops, y=[stats.fused.get(op, 0) for op in ops])
    figure.update_layout(title="ONNX Runtime's fused operators per variant (OpenVINO fuses when it compiles)",
                         barmode="group", xaxis_title="fused operator", yaxis_title="fused nodes (count)",
                         legend_title="variant (nodes in the graph)")
    return figure


def size_figure(megabytes: dict[str, float]) -> go.Figure:
    """The file size of every variant the run holds."""
    figure = go.Figure(go.Bar(x=list(megabytes), y=list(megabytes.values()),
                              text=[f"{mb:.1f} MB" for mb in megabytes.values()]))
    figure.update_layout(title="File size per variant", xaxis_title="variant", yaxis_title="file size (MB)")
    return figure


def parity_table(results: dict[str, Verdict], against: str = "PyTorch fp32") -> go.Figure:
    """One row per variant and output compared with `against`: verdict and the numbers behind it."""
    rows = []
    for variant, result in results.items():
        for name, out in result.outputs.items():
            shown = ("pass" if out.passed else "FAIL") if out.gated else \
                f"{'within' if out.passed else 'past'} its gate (not served: not gated)"
            rows.append([variant, result.precision, name, shown,
                         _number(out.max_abs, ".2e"), _number(out.mean_abs, ".2e"), _number(out.min_cosine, ".6f"),
                         _number(out.agreement, ".4f"), _retrieval_cell(out.retrieval), "; ".join(out.failures)])
    header = ["variant", "precision", "output", "verdict", "max abs", "mean abs", "min cosine", "agreement",
              "neighbours (agreement@1 / recall@10 / Spearman)", "why"]
    return table(f"Parity against {against} (padded positions excluded)", header, rows)


def _number(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _retrieval_cell(retrieval: dict[str, float | int] | None) -> str:
    if not retrieval:
        return ""
    return f"{retrieval['agreement_at_1']:.3f} / {retrieval['recall_at_10']:.3f} / {retrieval['spearman']:.4f}"


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
    figure = go.Figure(go.Bar(x=[t.error for t in texts], y=[f"#{t.text_id}: {t.text[:50]}" for t in texts],
                              orientation="h", hovertext=[t.text for t in texts]))
    figure.update_layout(title=f"Worst texts for {variant}", xaxis_title=texts[0].metric if texts else "",
                         yaxis_title="text (corpus id)",
                         height=200 + 30 * len(texts), margin={"l": 380})
    return figure


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
    for label, entry, marker in (("before repair", repair.before, {"symbol": "x", "size": 12}),
                                 ("chosen", repair.chosen, {"symbol": "star", "size": 20,
                                                            "line": {"width": 1.5, "color": "black"}})):
        if entry:  # the chosen star drawn last: on top where the two meet
            figure.add_scatter(name=label, mode="markers", x=[entry.latency_ms], y=[getattr(entry, metric)],
                               marker=marker)
    figure.update_layout(title=f"{repair.precision} repair: accuracy vs latency ({repair.outcome})",
                         xaxis_title=f"latency (ms) at batch x sequence {repair.latency_feed}",
                         yaxis_title=f"{metric.replace('_', ' ')} on the hard texts (marker size: nodes kept in fp32)")
    return figure


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
    return ["pass" if recipe.passed else "fail", _number(recipe.min_cosine, ".4f"), recall,
            _number(recipe.latency_ms, ".2f"), recipe.checked_on]


def runners_table(latency: LatencyGrid) -> go.Figure:
    """Every row of the grid: where and how it ran, its peak device memory (CUDA), and the parity verdict of rows
    only the bench step checks (torch.compile, PyTorch fp16)."""
    rows = []
    for name, row in latency.runners.items():
        parity = row.parity
        if row.reference:
            verdict = "the reference"
        elif parity:
            verdict = "pass (checked here)" if parity.passed else f"FAIL: {parity.failures[0]}"
        else:
            verdict = f"{'pass' if latency.passed.get(name) else 'FAIL'} ({row.variant or name}, parity step)"
        memory = f"{row.peak_memory_mb:.0f} MiB" if row.peak_memory_mb is not None else "n/a (CPU)"
        rows.append([name, row.label, row.precision, ", ".join(row.providers), row.io, memory, verdict])
    header = ["row", "runner", "precision", "providers", "I/O", "peak device memory", "parity"]
    return table("What each row ran on", header, rows)


def sessions_table(latency: LatencyGrid) -> go.Figure:
    """Per ONNX variant: the session settings the grid ran with, why, and what spinning would have given."""
    rows = [[name, SessionSettings.from_record(tuned.chosen).label(), tuned.reason,
             f"spinning alone (never applied) {tuned.spinning_gain:.2f}x" if tuned.spinning_gain is not None else
             f"I/O binding {tuned.io_binding_gain or 0:.2f}x numpy in and out"]
            for name, tuned in latency.sessions.items()]
    header = ["variant", "settings the grid ran", "why", "measured beside"]
    return table("ONNX Runtime session settings, measured at the smallest cell", header, rows)


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


def length_histogram(tensorrt: TensorrtMetrics) -> go.Figure:
    """Token lengths of the corpus with the chosen profiles' sequence ranges and opt points."""
    hist = tensorrt.lengths.histogram if tensorrt.lengths else Histogram(counts=[], edges=[])
    edges = hist.edges
    figure = go.Figure(go.Bar(x=[(a + b) / 2 for a, b in zip(edges, edges[1:])], y=hist.counts,
                              width=[b - a for a, b in zip(edges, edges[1:])], name="texts"))
    for index, profile in enumerate(tensorrt.profiles):
        low, opt, high = profile.sequence
        figure.add_vrect(x0=low, x1=high, opacity=0.08, line_width=0, fillcolor="green" if index % 2 else "blue",
                         annotation_text=f"profile {index}: {low}-{high}", annotation_position="top left")
        figure.add_vline(x=opt, line_dash="dot", annotation_text=f"opt {opt}")
    figure.update_layout(title="Token lengths (special tokens included) and the TensorRT profiles",
                         xaxis_title="text length (tokens)", yaxis_title="texts (count)", showlegend=False)
    return figure


def padding_figure(tensorrt: TensorrtMetrics) -> go.Figure:
    """Share of padded token slots with one profile vs the length buckets."""
    waste = tensorrt.padding_waste
    figure = go.Figure()
    for label, share in (("batch padded to its longest", lambda w: w.dynamic),
                         ("padded to profile max", lambda w: w.to_profile_max)):
        figure.add_bar(name=label, x=[f"{k} profile(s)" for k in waste], y=[share(w) * 100 for w in waste.values()])
    figure.update_layout(title="Padding waste", xaxis_title="TensorRT profiles (length buckets)",
                         yaxis_title="padding (% of token slots)", barmode="group")
    return figure


def batch_size_figure(burst: BatchingBurst) -> go.Figure:
    """How many executions each model ran at each batch size for a burst of one-text requests."""
    figure = go.Figure()
    for model, sizes in burst.batch_sizes.items():
        ordered = sorted(sizes.items())
        figure.add_bar(name=model, x=[str(k) for k, _ in ordered], y=[v for _, v in ordered])
    figure.update_layout(title=f"Dynamic batching: {burst.requests} concurrent one-text requests",
                         xaxis_title="batch size executed (texts)", yaxis_title="executions (count)",
                         barmode="group")
    return figure


def latency_figure(latency: LatencyGrid) -> go.Figure:
    """Median latency per runner for every batch x sequence cell (log scale), p90 as the error bar."""
    figure = go.Figure()
    for name in latency.rows():  # CUDA-graph rows exist per cell: a row shows where it was measured
        measured = [(c, stats[name]) for c, stats in latency.cells.items() if name in stats]
        label = latency.label(name) + ("" if latency.passed.get(name) else " (fails parity)")
        figure.add_bar(name=label, x=[c for c, _ in measured], y=[s.p50 for _, s in measured],
                       error_y={"type": "data", "array": [(s.p90 or s.p50) - s.p50 for _, s in measured],
                                "visible": True})
    figure.update_layout(title="In-process latency (median, error bar to p90)", yaxis_type="log",
                         yaxis_title="latency per call (ms)", xaxis_title="batch x sequence (texts x tokens)",
                         barmode="group")
    return figure


def speedup_figure(latency: LatencyGrid) -> go.Figure:
    """Speedup over PyTorch eager fp32 on the same device (and the same I/O) per runner and cell, coloured on log2
    of the ratio centred on 1x: red is slower than PyTorch, blue faster, equally far either way for halving and
    doubling. A row without a PyTorch baseline on its device stays blank."""
    cells, runners = list(latency.cells), latency.rows()
    ratios = [[timing.speedup if (timing := latency.cells[c].get(n)) else None for c in cells] for n in runners]
    z = [[math.log2(v) if v else None for v in row] for row in ratios]
    reach = max([1, *(math.ceil(abs(v)) for row in z for v in row if v is not None)])
    ticks = list(range(-reach, reach + 1))
    figure = go.Figure(go.Heatmap(
        z=z, x=cells, y=[latency.label(n) for n in runners], colorscale="RdBu", zmid=0, zmin=-reach, zmax=reach,
        text=[[f"{v:.2f}x" if v else "" for v in row] for row in ratios], texttemplate="%{text}",
        hovertemplate="%{y} at %{x}: %{text} PyTorch<extra></extra>",
        colorbar={"title": {"text": "speedup over PyTorch (x)"}, "tickvals": ticks,
                  "ticktext": [f"{2.0 ** t:g}x" for t in ticks]}))
    figure.update_layout(title="Speedup over PyTorch eager fp32 on the same device (ratio of medians)",
                         height=200 + 40 * len(runners), xaxis_title="batch x sequence (texts x tokens)",
                         yaxis_title="runner", margin={"l": 320})
    return figure


def throughput_figure(served: ServedBenchmark) -> go.Figure:
    """Throughput and p99 against concurrency, with and without dynamic batching."""
    from plotly.subplots import make_subplots

    figure = make_subplots(rows=1, cols=2, subplot_titles=("throughput", "p99 latency"))
    for label, sweeps in served.sweeps().items():
        levels = sweeps.text
        x = [int(c) for c in levels]
        figure.add_scatter(name=label.replace("_", " "), x=x, y=[v.throughput for v in levels.values()],
                           mode="lines+markers", row=1, col=1)
        figure.add_scatter(name=f"{label.replace('_', ' ')} p99", x=x, y=[v.p99 for v in levels.values()],
                           mode="lines+markers", row=1, col=2)
    figure.update_xaxes(title_text="concurrency (requests in flight)", type="log")
    figure.update_yaxes(title_text="throughput (requests/s)", row=1, col=1)
    figure.update_yaxes(title_text="p99 latency (ms)", row=1, col=2)
    figure.update_layout(title="Served: throughput and latency vs concurrency")
    return figure


def breakdown_figure(batching_on: BatchingSweeps) -> go.Figure:
    """Triton's own per-request time in each stage, per model, with batching on."""
    figure = go.Figure()
    levels = batching_on.text
    for stage in ("queue", "compute_input", "compute_infer", "compute_output"):
        for model in next(iter(levels.values())).server:
            figure.add_bar(name=f"{model.rsplit('_', 1)[-1]} {stage}", x=[int(c) for c in levels],
                           y=[v.server[model][stage] for v in levels.values()], offsetgroup=model)
    figure.update_layout(title="Server-side time per request by stage (batching on)", barmode="stack",
                         xaxis_title="concurrency (requests in flight)", yaxis_title="time per request (ms)")
    return figure


def search_figure(search: BatchingSearch) -> go.Figure:
    candidates = search.candidates
    figure = go.Figure(go.Scatter(
        x=[c.p99 for c in candidates], y=[c.throughput for c in candidates], mode="markers+text",
        text=[f"delay {c.max_queue_delay_us}us, x{c.instances}" for c in candidates],
        textposition="top center", marker={"size": 12}))
    if search.chosen:
        figure.add_scatter(x=[search.chosen.p99], y=[search.chosen.throughput], mode="markers",
                           marker={"symbol": "star", "size": 20}, name="chosen")
    figure.add_vline(x=search.p99_limit_ms, line_dash="dash", annotation_text="p99 limit")
    figure.update_layout(title=f"Batching settings at concurrency {search.concurrency}", showlegend=False,
                         xaxis_title="p99 latency (ms)", yaxis_title="throughput (requests/s)")
    return figure


def tokenization_figure(batching_on: BatchingSweeps) -> go.Figure:
    text = batching_on.text_asyncio or batching_on.text
    figure = go.Figure()
    for label, levels in (("tokenizer in Triton (text in)", text), ("tokenized in the client (ids in)",
                                                                    batching_on.client_tokenization)):
        figure.add_scatter(name=label, x=[int(c) for c in levels], y=[v.throughput for v in levels.values()],
                           mode="lines+markers")
    figure.update_layout(title="Where tokenization runs (batching on)", xaxis_title="concurrency (requests in flight)",
                         yaxis_title="throughput (requests/s)", xaxis_type="log")
    return figure


def layouts_figure(layouts: dict[str, Levels]) -> go.Figure:
    """Throughput of each repository layout against concurrency (batching on, same texts)."""
    figure = go.Figure()
    for layout, levels in layouts.items():
        figure.add_scatter(name=layout, x=[int(c) for c in levels], y=[v.throughput for v in levels.values()],
                           mode="lines+markers", hovertext=[f"p50 {v.p50:.1f} ms" for v in levels.values()])
    figure.update_layout(title="Repository layouts: ensemble (tokenizer -> model) vs fused (one Python model)",
                         xaxis_title="concurrency (requests in flight)", xaxis_type="log",
                         yaxis_title="throughput (requests/s)")
    return figure


def efficiency_table(efficiency: Efficiency) -> go.Figure:
    """Served against in process on the same texts and threads."""
    rates = efficiency.in_process
    rows = [[f"throughput at concurrency {efficiency.concurrency}, batching {label.split('_')[1]}",
             f"in process at batch {rates.best_batch}: {rates.best:.1f} seq/s", f"{ratio:.2f}"]
            for label, ratio in efficiency.throughput_ratio.items()]
    if efficiency.p50_ratio_c1 is not None:
        rows.append(["p50 at concurrency 1", f"in process at batch 1: {rates.p50_ms:.2f} ms",
                     f"{efficiency.p50_ratio_c1:.2f}"])
    return table("Serving efficiency: served / in process, same texts", ["served", "against", "ratio"], rows)


def rerank_table(rerank: dict[str, Levels]) -> go.Figure:
    """A served reranker per documents per request and concurrency: requests/s, pairs/s, p50 and p99."""
    rows = [[f"{level.documents} documents, concurrency {level.concurrency}", f"{level.throughput:.1f}",
             f"{level.pairs_per_s or 0:.0f}", f"{level.p50:.1f}", f"{level.p99:.1f}"]
            for levels in rerank.values() for level in levels.values()]
    return table("Served reranker: one query and its documents per request",
                 ["load", "requests/s", "pairs/s", "p50 ms", "p99 ms"], rows)


def capacity_table(capacity: Capacity, scaling: Scaling) -> go.Figure:
    """The capacity on paper and what each autoscaler keeps, with the reasons."""
    per = capacity.per_replica_rps
    rows = [["target load", f"{capacity.target_rps:g} req/s", "triton.target_rps"],
            ["one replica sustains", "not measured" if per is None else f"{per:.1f} req/s",
             capacity.replicas_reason],
            ["replicas (HPA / KServe)", f"{scaling.min_replicas} to {scaling.max_replicas}",
             "minimum for the target load; maximum = minimum x triton.burst_factor"],
            ["HPA: queue time per request", f"{scaling.queue_target_us} us", capacity.queue_reason],
            ["KServe: requests in flight per replica", str(scaling.concurrency),
             "the load level that throughput was measured at"]]
    return table("Capacity on paper (one GPU per pod)", ["", "value", "why"], rows)

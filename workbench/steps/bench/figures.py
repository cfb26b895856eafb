"""The bench step's figures: the in-process grid and its rows, the served sweeps, the batching
search, layouts and efficiency."""
from __future__ import annotations

import math

import plotly.graph_objects as go

from workbench.measure.tables import BatchingSearch, BatchingSweeps, Efficiency, LatencyGrid, Levels, ServedBenchmark
from workbench.report.figures import CONCURRENCY, concurrency_axis, table
from workbench.runners.onnxruntime import SessionSettings


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
    concurrency_axis(figure, [sweeps.text for sweeps in served.sweeps().values()])
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
                         xaxis_title=CONCURRENCY, xaxis_type="category", yaxis_title="time per request (ms)")
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
    figure.update_layout(title="Where tokenization runs (batching on)", yaxis_title="throughput (requests/s)")
    concurrency_axis(figure, [text, batching_on.client_tokenization])
    return figure


def layouts_figure(layouts: dict[str, Levels]) -> go.Figure:
    """Throughput of each repository layout against concurrency (batching on, same texts)."""
    figure = go.Figure()
    for layout, levels in layouts.items():
        figure.add_scatter(name=layout, x=[int(c) for c in levels], y=[v.throughput for v in levels.values()],
                           mode="lines+markers", hovertext=[f"p50 {v.p50:.1f} ms" for v in levels.values()])
    figure.update_layout(title="Repository layouts: ensemble (tokenizer -> model) vs fused (one Python model)",
                         yaxis_title="throughput (requests/s)")
    concurrency_axis(figure, list(layouts.values()))
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

"""The optimize step's figures: the variants it built, their fused operators and file sizes."""
from __future__ import annotations

import plotly.graph_objects as go

from workbench.graphs.names import VariantName
from workbench.graphs.tables import GraphStats, OptimizeMetrics
from workbench.report.figures import table


def variants_table(optimized: OptimizeMetrics, megabytes: dict[str, float]) -> go.Figure:
    """Every variant the run holds: the runtime that runs it, its graph's nodes and fused operators (ONNX Runtime's),
    its file size, and what its trial found (OpenVINO's)."""
    trials = {VariantName.OPENVINO: optimized.openvino, VariantName.OPENVINO_BF16: optimized.openvino_bf16,
              VariantName.OPENVINO_INT8: optimized.openvino_int8}
    rows = []
    for variant, size in megabytes.items():
        stats, trial = optimized.variants.get(variant), trials.get(variant)
        fused = ", ".join(f"{op} {n}" for op, n in stats.fused.items()) if stats else "at compile time (OpenVINO)"
        note = (trial.reason if trial else stats.warning if stats else "") or ""
        rows.append((variant, "OpenVINO" if variant in trials else "ONNX Runtime", stats.nodes if stats else "",
                     fused, f"{size:.3g}", note))
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

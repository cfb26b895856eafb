"""Plotly figures built from run.json metrics; notebooks and the report show the same ones."""
from __future__ import annotations

from typing import Any

import plotly.graph_objects as go


def io_table(export: dict[str, Any]) -> go.Figure:
    """Graph inputs and outputs with their symbolic shapes."""
    rows = [(kind[:-1], name, " x ".join(map(str, shape)))
            for kind in ("inputs", "outputs") for name, shape in export["io"][kind].items()]
    columns = list(zip(*rows))
    figure = go.Figure(go.Table(header={"values": ["", "name", "shape"]}, cells={"values": columns}))
    figure.update_layout(title=f"{export['architecture']} exported with {export['exporter']} "
                               f"(opset {export['opset']}): {export['nodes']} nodes", height=120 + 30 * len(rows))
    return figure


def fusion_figure(fusions: dict[str, Any]) -> go.Figure:
    """Fused-operator counts per variant (bars) and node counts (in the legend names)."""
    ops = sorted({op for stats in fusions.values() for op in stats["fused"]})
    figure = go.Figure()
    for variant, stats in fusions.items():
        figure.add_bar(name=f"{variant} ({stats['nodes']} nodes)", x=ops, y=[stats["fused"].get(op, 0) for op in ops])
    figure.update_layout(title="Fused operators per variant", barmode="group", yaxis_title="count",
                         legend_title="variant")
    return figure


def size_figure(fusions: dict[str, Any]) -> go.Figure:
    variants = [v for v, s in fusions.items() if "megabytes" in s]
    figure = go.Figure(go.Bar(x=variants, y=[fusions[v]["megabytes"] for v in variants],
                              text=[f"{fusions[v]['megabytes']:.1f} MB" for v in variants]))
    figure.update_layout(title="File size per variant", yaxis_title="MB")
    return figure

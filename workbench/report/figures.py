"""What the steps' figures share: a table sized to its content, the parity table (parity, tensorrt and triton draw
it), a code snippet; each step draws its own charts from its metrics (its module, or `steps/<step>/figures.py`), and
notebooks and the report show the same ones."""
from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass

import plotly.graph_objects as go

from workbench.core.results import Verdict

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


CONCURRENCY = "concurrency (requests in flight)"


def concurrency_axis(figure: go.Figure, levels: Sequence[Sequence[str | int]], **where: int) -> None:
    """`figure`'s x axis (`where`: row and col of a subplot) as concurrency on a log scale, ticked only at the
    `levels` measured (each a sweep's concurrencies): no 2, 3 or 5 between them."""
    figure.update_xaxes(title_text=CONCURRENCY, type="log", tickvals=sorted({int(c) for sweep in levels
                                                                             for c in sweep}), **where)


def table(title: str, header: list[str], rows: Sequence[Sequence[object]]) -> go.Figure:
    """A table sized to its content: columns as wide as their longest cell, one line per row, tight margins."""
    texts = [[str(v) for v in row] for row in rows]
    wanted = [min(_WIDEST, max([len(h)] + [len(row[i]) for row in texts]) + 2) for i, h in enumerate(header)]
    words = [max(len(word) for cell in [h, *(row[i] for row in texts)] for word in [*cell.split(), ""]) + 2
             for i, h in enumerate(header)]
    widths = _fitted(wanted, words)
    shrink = min(1.0, _LINE_CHARS / sum(widths))  # plotly narrows the columns to the page, in proportion
    lines = [max(math.ceil(len(cell) / max(1.0, width * shrink - 2)) for cell, width in zip(row, widths))
             for row in texts]  # a long cell wraps: its row grows, and so must the figure, or the last row is cut
    figure = go.Figure(go.Table(columnwidth=widths, header={"values": header, "height": _ROW_PX},
                                cells={"values": list(zip(*texts)) if texts else [], "height": _ROW_PX}))
    figure.update_layout(title=title, height=70 + _ROW_PX * 2 + _LINE_PX * sum(max(1, n) for n in lines)
                         + (_ROW_PX - _LINE_PX) * len(lines), margin={"t": 50, "b": 10, "l": 20, "r": 20})
    return figure


def _fitted(wanted: list[int], words: list[int]) -> list[float]:
    """Column widths that fit the page by narrowing the columns with room to wrap, never one below its longest word
    (plotly cuts a word wider than its column: `sentence_embeddin`)."""
    if sum(wanted) <= _LINE_CHARS:
        return [float(w) for w in wanted]
    floors = [min(word, w) for w, word in zip(wanted, words)]
    slack = [w - f for w, f in zip(wanted, floors)]
    excess = sum(wanted) - _LINE_CHARS
    if sum(slack) <= excess:  # the longest words alone fill the page: each column at its longest word
        return [float(f) for f in floors]
    return [w - s * excess / sum(slack) for w, s in zip(wanted, slack)]


def parity_table(results: dict[str, Verdict], against: str = "PyTorch fp32") -> go.Figure:
    """One row per variant and output compared with `against`: verdict and the numbers behind it."""
    rows = []
    for variant, result in results.items():
        for name, out in result.outputs.items():
            shown = ("pass" if out.passed else "FAIL") if out.gated else \
                f"{'within' if out.passed else 'past'} its gate (not served: not gated)"
            numbers = [formatted(out.max_abs, ".2e"), formatted(out.mean_abs, ".2e"),
                       formatted(out.min_cosine, ".6f"), formatted(out.agreement, ".4f")]
            rows.append([variant, result.precision, name, shown, *numbers, _retrieval_cell(out.retrieval),
                         "; ".join(out.failures)])
    header = ["variant", "precision", "output", "verdict", "max abs", "mean abs", "min cosine", "agreement",
              "neighbours (agreement@1 / recall@10 / Spearman)", "why"]
    shown = [i for i in range(len(header)) if i < 4 or any(row[i] for row in rows)]  # no column of empty cells
    return table(f"Parity against {against} (padded positions excluded)", [header[i] for i in shown],
                 [[row[i] for i in shown] for row in rows])


def formatted(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _retrieval_cell(retrieval: dict[str, float | int] | None) -> str:
    if not retrieval:
        return ""
    return f"{retrieval['agreement_at_1']:.3f} / {retrieval['recall_at_10']:.3f} / {retrieval['spearman']:.4f}"



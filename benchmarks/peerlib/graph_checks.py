"""What benchmarks/graphs.py concludes from its rows: accuracy against `SentenceTransformer.encode()`, the PASS/MISS
lines of issues #26 (each of ours against its Optimum counterpart) and #39 (ours against the fastest peer at each
precision; the fastest accurate int8), and the markdown table. Never an assertion: a MISS is a finding."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

import numpy as np

from peerlib.graphs import GraphRow
from workbench.precision.compare import cosine

MIN_COSINE = 0.99
SAME_SPEED = 1.03  # "at least as fast": within 3%
PEERS = ("optimum", "openvino")


class Control(TypedDict):
    """A precision class's A/A control: the graph timed twice and, per cell, the slower over the faster median."""

    graph: str
    spread: dict[str, float]


def accuracy(got: np.ndarray, want: np.ndarray, limit: float = MIN_COSINE) -> dict[str, float]:
    """Cosine per text against encode(): min, mean, and how many texts fall below `limit`."""
    cosines = cosine(got.astype(np.float64), want.astype(np.float64))
    return {"min_cosine": float(cosines.min()), "mean_cosine": float(cosines.mean()),
            "below": int((cosines < limit).sum()), "texts": len(want)}


def measured(rows: Sequence[GraphRow]) -> list[GraphRow]:
    return [row for row in rows if row.problem is None and row.ms]


def accurate(row: GraphRow) -> bool:
    return bool(row.accuracy) and row.accuracy["min_cosine"] >= MIN_COSINE


def shown(ratio: float) -> str:
    """Two decimals; three for a ratio that misses the target yet rounds to it."""
    return f"{ratio:.3f}" if ratio > SAME_SPEED and round(ratio, 2) <= SAME_SPEED else f"{ratio:.2f}"


def miss(ratios: dict[str, float], target: float, spread: dict[str, float] | None) -> str:
    """"MISS", and where every ratio stays within `target` times this run's A/A `spread` at its cell, that the run
    cannot tell it from a PASS."""
    unresolved = spread is not None and all(ratio <= target * spread.get(cell, 1.0) for cell, ratio in ratios.items())
    return "MISS within this run's A/A spread (not resolved)" if unresolved else "MISS"


def ratios_line(ratios: dict[str, float], spread: dict[str, float] | None = None) -> str:
    """The ratios per cell and PASS or `miss`."""
    fast = max(ratios.values()) <= SAME_SPEED
    return (", ".join(f"{cell} {shown(ratio)}" for cell, ratio in ratios.items())
            + f" (target <= {SAME_SPEED}) {'PASS' if fast else miss(ratios, SAME_SPEED, spread)}")


def control_lines(controls: dict[str, Control]) -> list[str]:
    """Per precision class, how far apart its A/A control (one graph opened twice, both timed) timed."""
    return [f"A/A control, {precision}: {control['graph']} opened twice timed "
            + ", ".join(f"{cell} {ratio:.3f}" for cell, ratio in control["spread"].items())
            + " apart (this run's noise: ratios within it are not resolved)"
            for precision, control in controls.items()]


def fastest(rows: Sequence[GraphRow], cell: str) -> GraphRow:
    return min(rows, key=lambda row: row.ms[cell])


def verdicts(rows: Sequence[GraphRow], pairs: Sequence[tuple[str, str]], repaired: str,
             spreads: dict[str, dict[str, float]] | None = None) -> list[str]:
    """Issue #26: each (ours, Optimum's) pair measured within `SAME_SPEED` at every cell; `repaired` within it of
    Optimum's fastest int8 at every cell, with no text below `MIN_COSINE`. A pair missing a row is left out.
    `spreads`: each precision class's A/A spread (`ratios_line`)."""
    spreads = spreads or {}
    by_name = {row.name: row for row in measured(rows)}
    lines = []
    for ours, theirs in pairs:
        if ours in by_name and theirs in by_name:
            mine, peer = by_name[ours], by_name[theirs]
            lines.append(f"{ours} / {theirs} time: " + ratios_line(
                {cell: mine.ms[cell] / peer.ms[cell] for cell in mine.ms}, spreads.get(mine.precision)))
    theirs_int8 = [row for row in by_name.values() if row.family == "optimum" and row.precision == "int8"]
    if repaired in by_name and theirs_int8:
        mine = by_name[repaired]
        below = mine.accuracy["below"]
        verdict = "PASS" if accurate(mine) and below == 0 else "MISS"
        lines.append(f"{repaired} / Optimum's fastest int8 per cell, time: "
                     + ratios_line({cell: mine.ms[cell] / fastest(theirs_int8, cell).ms[cell] for cell in mine.ms},
                                   spreads.get("int8"))
                     + f"; min cosine {mine.accuracy['min_cosine']:.4f}, {below} text{'s' * (below != 1)} below "
                     f"{MIN_COSINE} (target: none) {verdict}")
    return lines


def targets(rows: Sequence[GraphRow], spreads: dict[str, dict[str, float]] | None = None) -> list[str]:
    """Issue #39, per precision: the workbench's fastest graph with min cosine >= `MIN_COSINE` within `SAME_SPEED`
    of the fastest of Optimum's and OpenVINO's graphs at every cell (a peer precision the workbench builds no graph
    at is named, not judged); int8: the fastest graph with min cosine >= `MIN_COSINE` is the workbench's at every
    cell, judged where int8 pays (its fastest graph beats the fastest fp32 at every cell). `spreads`: each precision
    class's A/A spread (`ratios_line`)."""
    spreads = spreads or {}
    done = measured(rows)
    cells = list(done[0].ms) if done else []
    lines = []
    for precision in dict.fromkeys(row.precision for row in done):
        ours = [row for row in done if row.family == "workbench" and row.precision == precision]
        theirs = [row for row in done if row.family in PEERS and row.precision == precision]
        passing = [row for row in ours if accurate(row)]
        if not theirs:
            continue
        head = f"{precision}: the workbench's fastest passing graph / the fastest peer graph per cell, "
        if not ours:
            lines.append(f"{precision}: not judged, this run has no workbench {precision} graph (its optimize step "
                         "says why); the fastest peer graph per cell: " + ", ".join(
                             f"{c} {fastest(theirs, c).name} {fastest(theirs, c).ms[c]:.2f} ms" for c in cells))
        elif not passing:
            lines.append(head + f"no workbench {precision} graph reaches min cosine {MIN_COSINE} MISS")
        else:
            lines.append(head + "time: " + ratios_line({c: fastest(passing, c).ms[c] / fastest(theirs, c).ms[c]
                                                        for c in cells}, spreads.get(precision))
                         + gate_note(passing, theirs, cells))
    lines.extend(int8_target(done, cells, spreads.get("int8")))
    return lines


def gate_note(passing: Sequence[GraphRow], theirs: Sequence[GraphRow], cells: Sequence[str]) -> str:
    """Where a fastest peer graph misses the accuracy gate, which one and by how much, and the same ratios against
    the peer graphs that reach it (none: said so)."""
    below = list({row.name: row for row in (fastest(theirs, c) for c in cells) if not accurate(row)}.values())
    if not below:
        return ""
    said = ", ".join(f"{row.name} (min cosine {row.accuracy['min_cosine']:.3f}, {row.accuracy['below']} texts below "
                     f"{MIN_COSINE})" for row in below)
    good = [row for row in theirs if accurate(row)]
    against = ("against the peer graphs that reach it: " + ratios_line(
        {c: fastest(passing, c).ms[c] / fastest(good, c).ms[c] for c in cells})) if good else "no peer graph reaches it"
    return f"; the fastest peer graph misses the {MIN_COSINE} gate: {said}; {against}"


def int8_target(done: Sequence[GraphRow], cells: Sequence[str], spread: dict[str, float] | None = None) -> list[str]:
    """int8 where it pays: the fastest graph with min cosine >= `MIN_COSINE` is the workbench's at every cell; a MISS
    whose peer winners are faster than the workbench's fastest passing int8 by no more than this run's A/A `spread`
    says that the run cannot tell it from a PASS."""
    int8 = [row for row in done if row.precision == "int8"]
    fp32 = [row for row in done if row.precision == "fp32"]
    if not int8 or not fp32:
        return []
    gain = {c: fastest(fp32, c).ms[c] / fastest(int8, c).ms[c] for c in cells}
    pays = min(gain.values()) > 1.0
    line = ("int8 pays (fastest fp32 / fastest int8): " + ", ".join(f"{c} {g:.2f}x" for c, g in gain.items())
            + f"; the fastest int8 with min cosine >= {MIN_COSINE}, per cell: ")
    unjudged = "; int8 does not pay here at every cell, so this is not judged"
    good = [row for row in int8 if accurate(row)]
    if not good:
        return [line + ("none reaches it" + unjudged if not pays else "none reaches it MISS")]
    winners = {c: fastest(good, c) for c in cells}
    mine = [row for row in good if row.family == "workbench"]
    verdict = ("PASS" if all(row.family == "workbench" for row in winners.values()) else
               miss({c: fastest(mine, c).ms[c] / row.ms[c] for c, row in winners.items()}, 1.0, spread) if mine else
               "MISS")
    return [line + ", ".join(f"{c} {row.name} {row.ms[c]:.2f} ms" for c, row in winners.items())
            + (f" (target: the workbench's) {verdict}" if pays else unjudged)]


def table(rows: Sequence[GraphRow], torch_ms: dict[str, float]) -> str:
    """Markdown: ms per cell with the speedup over PyTorch eager, and accuracy against encode(); a row that could
    not be built or run says why."""
    cells = list(torch_ms)
    lines = ["| graph | " + " | ".join(cells) + f" | min / mean cosine, texts below {MIN_COSINE} |",
             "|---|" + "---|" * (len(cells) + 1),
             "| PyTorch eager fp32 (SentenceTransformer forward) | " + " | ".join(
                 f"{torch_ms[c]:.2f}" for c in cells) + " | reference |"]
    for row in rows:
        if row.problem is not None or not row.ms:
            why = row.problem or "no timing came back"
            lines.append(f"| {row.name} | " + " | ".join("-" for _ in cells) + f" | not measured: {why} |")
            continue
        shown = " | ".join(f"{row.ms[c]:.2f} ({torch_ms[c] / row.ms[c]:.2f}x)" for c in cells)
        a = row.accuracy
        lines.append(f"| {row.name} | {shown} | {a['min_cosine']:.3f} / {a['mean_cosine']:.4f}, {a['below']} |")
    return "\n".join(lines)

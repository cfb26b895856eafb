"""The workbench's ONNX graphs beside Optimum's of the same model, in one process: the same ONNX Runtime, the same
session settings, the same real-text cells, interleaved rounds; PyTorch eager (what users run today) in phases
of its own, as the speedup's reference. Accuracy of every graph against `SentenceTransformer.encode()`.
benchmarks/graphs.py runs it."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from workbench.core.data import encode
from workbench.core.timing import cell_medians_ms
from workbench.precision.compare import cosine
from workbench.runners.onnxruntime import SessionSettings, session

CPU = ["CPUExecutionProvider"]
MIN_COSINE = 0.99
SAME_SPEED = 1.03  # "at least as fast": within 3%


@dataclass
class GraphRow:
    """One graph: who built it, its precision, its file and the output its users read. An Optimum graph answers
    `last_hidden_state`, which its users mean-pool and normalize themselves (done here outside the timed call)."""

    name: str
    family: str  # "workbench" or "optimum"
    precision: str
    path: Path
    output: str
    ms: dict[str, float] = field(default_factory=dict)  # cell -> median ms
    accuracy: dict[str, float] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "family": self.family, "precision": self.precision, "path": str(self.path),
                "output": self.output, "ms": self.ms, "accuracy": self.accuracy}


def sessions(rows: Sequence[GraphRow], threads: int) -> dict[str, Any]:
    """One CPU session per graph with the same settings (threads that sleep when idle, every graph optimization;
    a workbench file's own disabled optimizers)."""
    return {row.name: session(row.path, CPU, settings=SessionSettings(threads)) for row in rows}


def time_graphs(rows: Sequence[GraphRow], opened: dict[str, Any], feeds: dict[str, dict[str, Any]], rounds: int,
                block: int = 3) -> None:
    """Median ms of one call of each graph per cell into `row.ms`: all graphs interleaved, rotating, per cell."""
    def calls(cell: str) -> dict[str, Callable[[], object]]:
        found: dict[str, Callable[[], object]] = {}
        for row in rows:
            names = {i.name for i in opened[row.name].get_inputs()}
            found[row.name] = (lambda s=opened[row.name], f={k: v for k, v in feeds[cell].items() if k in names},
                               o=[row.output]: s.run(o, f))
        return found
    medians = cell_medians_ms(calls, list(feeds), rounds, warmup=2, block=block)
    for row in rows:
        row.ms = medians[row.name]


def mean_pooled(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Mean over the unmasked tokens, L2-normalized: what sentence-transformers does after all-MiniLM-L6-v2's
    transformer, and what an Optimum user writes after `last_hidden_state`."""
    weights = mask[..., None].astype(np.float32)
    pooled = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
    return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)


def embeddings(row: GraphRow, opened: Any, tokenizer: Any, texts: Sequence[str], max_length: int,
               batch: int = 32) -> np.ndarray:
    """The sentence embedding `row`'s graph gives for every text, truncated at `max_length` tokens as encode()
    truncates (batches padded to their longest text)."""
    names = tuple(i.name for i in opened.get_inputs())
    found = []
    for start in range(0, len(texts), batch):
        feed = encode(tokenizer, list(texts[start:start + batch]), names, max_length=max_length)
        out = opened.run([row.output], feed)[0]
        found.append(out if row.output == "sentence_embedding" else mean_pooled(out, feed["attention_mask"]))
    return np.concatenate(found)


def accuracy(got: np.ndarray, want: np.ndarray, limit: float = MIN_COSINE) -> dict[str, float]:
    """Cosine per text against encode(): min, mean, and how many texts fall below `limit`."""
    cosines = cosine(got.astype(np.float64), want.astype(np.float64))
    return {"min_cosine": float(cosines.min()), "mean_cosine": float(cosines.mean()),
            "below": int((cosines < limit).sum()), "texts": len(want)}


def verdicts(rows: Sequence[GraphRow], pairs: Sequence[tuple[str, str]], repaired: str | None) -> list[str]:
    """PASS/MISS lines: each (ours, theirs) pair within `SAME_SPEED` at every cell; `repaired` within it of
    Optimum's fastest int8 at every cell, with min cosine >= `MIN_COSINE` and no text below it."""
    by_name = {row.name: row for row in rows}
    lines = []
    for ours, theirs in pairs:
        mine, peer = by_name[ours], by_name[theirs]
        ratios = {cell: mine.ms[cell] / peer.ms[cell] for cell in mine.ms}
        verdict = "PASS" if max(ratios.values()) <= SAME_SPEED else "MISS"
        lines.append(f"{ours} / {theirs} time: " + ", ".join(f"{c} {r:.2f}" for c, r in ratios.items())
                     + f" (target <= {SAME_SPEED}) {verdict}")
    if repaired in by_name:
        mine = by_name[repaired]
        theirs = [row for row in rows if row.family == "optimum" and row.precision == "int8"]
        ratios = {cell: mine.ms[cell] / min(row.ms[cell] for row in theirs) for cell in mine.ms}
        fast = max(ratios.values()) <= SAME_SPEED
        accurate = mine.accuracy["min_cosine"] >= MIN_COSINE and mine.accuracy["below"] == 0
        below = mine.accuracy["below"]
        lines.append(f"{repaired} / Optimum's fastest int8 per cell, time: "
                     + ", ".join(f"{c} {r:.2f}" for c, r in ratios.items())
                     + f" (target <= {SAME_SPEED}) {'PASS' if fast else 'MISS'}; min cosine "
                     f"{mine.accuracy['min_cosine']:.4f}, {below} text{'s' * (below != 1)} below {MIN_COSINE} "
                     f"(target: none) {'PASS' if accurate else 'MISS'}")
    return lines


def table(rows: Sequence[GraphRow], torch_ms: dict[str, float]) -> str:
    """Markdown: ms per cell with the speedup over PyTorch eager, and accuracy against encode()."""
    cells = list(torch_ms)
    lines = ["| graph | " + " | ".join(cells) + f" | min / mean cosine, texts below {MIN_COSINE} |",
             "|---|" + "---|" * (len(cells) + 1),
             "| PyTorch eager fp32 (SentenceTransformer forward) | " + " | ".join(
                 f"{torch_ms[c]:.2f}" for c in cells) + " | reference |"]
    for row in rows:
        shown = " | ".join(f"{row.ms[c]:.2f} ({torch_ms[c] / row.ms[c]:.2f}x)" for c in cells)
        a = row.accuracy
        lines.append(f"| {row.name} | {shown} | {a['min_cosine']:.3f} / {a['mean_cosine']:.4f}, {a['below']} |")
    return "\n".join(lines)

"""The form of the fused fp32 graph, chosen by measurement on the host.

For a family ONNX Runtime has fusion rules for, the layer-norm form (`variants.GRAPH_FORMS`): both forms are built,
timed in rotating rounds at the bench's smallest and largest cell with the run's device and threads, and the
separate form replaces ONNX Runtime's fused default only when it is clearly faster. For a family without rules, the
graph fused with borrowed rules (`variants.borrowed_fp32`) beside the basic one: it must first give the basic
graph's outputs on the same real text within the fp32 gate, then be clearly faster, to be kept. The fp16 and int8
variants are built from the chosen file, so they inherit its form; the parity step checks every variant."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from workbench.core.timing import cell_medians_ms
from workbench.measure.sessions import call_for
from workbench.precision.compare import DEFAULT_TOLERANCES
from workbench.runners.onnxruntime import session

CELL_SECONDS = 8.0  # rounds of one cell stop after this long (two rounds at least)
MIN_GAIN = 1.03  # the separate form must be 3% faster at one of the cells
MAX_LOSS = 1.02  # and no more than 2% slower at the other
RULE = f"needs {MIN_GAIN:.2f}x at one cell and no loss over {MAX_LOSS:.2f}x at the other"


@dataclass(frozen=True)
class FormChoice:
    chosen: str
    reason: str
    ms: dict[str, dict[str, float]]  # form -> cell name -> median ms

    def record(self) -> dict[str, Any]:
        return {"chosen": self.chosen, "reason": self.reason, "ms": self.ms}


@dataclass(frozen=True)
class Borrowed:
    """Borrowed fusion rules tried on a family without its own: what fused, the check of its outputs against the
    basic graph's, the timing, and whether it was kept and why."""

    rules: str
    fused: dict[str, int]
    attention: str  # how attention fused, or why it did not
    max_abs: float  # largest difference from the basic graph's outputs on the same text
    matches: bool  # within the fp32 gate
    ms: dict[str, dict[str, float]]  # "basic" / "borrowed" -> cell -> median ms; empty when not timed
    kept: bool
    reason: str

    def record(self) -> dict[str, Any]:
        return {"rules": self.rules, "fused": self.fused, "attention": self.attention, "max_abs": self.max_abs,
                "matches_basic": self.matches, "ms": self.ms, "kept": self.kept, "reason": self.reason}


def clearly_faster(ms: dict[str, dict[str, float]], default: str, challenger: str) -> tuple[bool, str]:
    """Whether `challenger` is `MIN_GAIN` faster than `default` at one cell and at most `MAX_LOSS` slower at the
    other (median ms per graph and cell), and the gains as text."""
    gains = {cell: ms[default][cell] / ms[challenger][cell] for cell in ms[default]}
    shown = ", ".join(f"{gain:.2f}x at {cell}" for cell, gain in gains.items())
    return max(gains.values()) >= MIN_GAIN and min(gains.values()) >= 1 / MAX_LOSS, shown


def decide(ms: dict[str, dict[str, float]]) -> tuple[str, str]:
    """The form to keep from median ms per form and cell: "separate" when it is clearly faster than "fused"
    (`clearly_faster`), else "fused" (ONNX Runtime's default)."""
    faster, shown = clearly_faster(ms, "fused", "separate")
    if faster:
        return "separate", f"Add + LayerNormalization ran faster than the fused layer norms: {shown}"
    return "fused", f"the separate layer norms were not clearly faster ({shown}; {RULE})"


def _timed(files: dict[str, Path], feeds: dict[str, dict[str, np.ndarray]], providers: list[Any],
           threads: int | None, device: str, rounds: int) -> dict[str, dict[str, float]]:
    """Median ms per file (by name) and cell, interleaved (at most `rounds`, or CELL_SECONDS a cell: a base-size
    model's largest cell takes seconds a call)."""
    sessions = {name: session(path, providers, threads) for name, path in files.items()}

    def calls(cell: str) -> dict[str, Callable[[], object]]:
        return {name: call_for(s, {i.name: feeds[cell][i.name] for i in s.get_inputs()}, device)
                for name, s in sessions.items()}
    return cell_medians_ms(calls, list(feeds), rounds, block=3, budget_s=CELL_SECONDS, min_rounds=2)


def largest_difference(files: dict[str, Path], feeds: dict[str, dict[str, np.ndarray]], providers: list[Any],
                       threads: int | None) -> tuple[float, bool]:
    """The largest absolute difference between the two files' outputs on every feed, and whether every element is
    within the fp32 gate (atol + rtol x |basic|) of the first file's."""
    gate = DEFAULT_TOLERANCES["fp32"]["hidden"]
    first, second = (session(path, providers, threads) for path in files.values())
    largest, within = 0.0, True
    for feed in feeds.values():
        inputs = {i.name: feed[i.name] for i in first.get_inputs()}
        for want, got in zip(first.run(None, inputs), second.run(None, inputs)):
            diff = np.abs(got.astype(np.float64) - want)
            largest = max(largest, float(np.nan_to_num(diff, nan=np.inf).max()))
            within = within and bool(np.all(diff <= (gate.atol or 0.0) + (gate.rtol or 0.0) * np.abs(want)))
    return largest, within


def choose_borrowed(files: dict[str, Path], feeds: dict[str, dict[str, np.ndarray]], providers: list[Any],
                    threads: int | None, device: str, fused: dict[str, int], attention: str, rules: str,
                    untimed: str | None = None, rounds: int = 5) -> Borrowed:
    """Keep the graph fused with borrowed `rules` (`files["borrowed"]`) over `files["basic"]`: never when its outputs
    differ beyond the fp32 gate; when they match, if it is also clearly faster here, or without timing where
    `untimed` says why not."""
    largest, matches = largest_difference(files, feeds, providers, threads)
    if not matches:
        return Borrowed(rules, fused, attention, largest, False, {}, False,
                        f"its outputs differ from the basic graph's by up to {largest:.2g} on the same text, beyond "
                        "the fp32 gate")
    if untimed:
        return Borrowed(rules, fused, attention, largest, True, {}, True, untimed)
    ms = _timed(files, feeds, providers, threads, device, rounds)
    faster, shown = clearly_faster(ms, "basic", "borrowed")
    reason = (f"ran faster than the basic graph: {shown}" if faster else
              f"not clearly faster than the basic graph ({shown}; {RULE})")
    return Borrowed(rules, fused, attention, largest, True, ms, faster, reason)


def choose_form(files: dict[str, Path], feeds: dict[str, dict[str, np.ndarray]], providers: list[Any],
                threads: int | None, device: str, rounds: int = 5) -> FormChoice:
    """Time each form's file (`files`, by form) on every feed of `feeds` (by cell name), interleaved, and decide."""
    ms = _timed(files, feeds, providers, threads, device, rounds)
    chosen, reason = decide(ms)
    return FormChoice(chosen, reason, ms)

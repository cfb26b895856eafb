"""The layer-norm form of the fused fp32 graph (`variants.GRAPH_FORMS`), chosen by measurement on the host: both
forms are built, timed in rotating rounds at the bench's smallest and largest cell with the run's device and
threads, and the separate form replaces ONNX Runtime's fused default only when it is clearly faster. The fp16 and
int8 variants are built from the chosen file, so they inherit its form. Only speed follows this measurement: the two
forms compute the same, and the parity step checks every variant built from either."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from workbench.core.timing import cell_medians_ms
from workbench.measure.sessions import call_for
from workbench.runners.onnxruntime import session

CELL_SECONDS = 8.0  # rounds of one cell stop after this long (two rounds at least)
MIN_GAIN = 1.03  # the separate form must be 3% faster at one of the cells
MAX_LOSS = 1.02  # and no more than 2% slower at the other


@dataclass(frozen=True)
class FormChoice:
    chosen: str
    reason: str
    ms: dict[str, dict[str, float]]  # form -> cell name -> median ms

    def record(self) -> dict[str, Any]:
        return {"chosen": self.chosen, "reason": self.reason, "ms": self.ms}


def decide(ms: dict[str, dict[str, float]]) -> tuple[str, str]:
    """The form to keep from median ms per form and cell: "separate" when it is `MIN_GAIN` faster than "fused" at
    one cell and at most `MAX_LOSS` slower at the other, else "fused" (ONNX Runtime's default)."""
    gains = {cell: ms["fused"][cell] / ms["separate"][cell] for cell in ms["fused"]}
    shown = ", ".join(f"{gain:.2f}x at {cell}" for cell, gain in gains.items())
    if max(gains.values()) >= MIN_GAIN and min(gains.values()) >= 1 / MAX_LOSS:
        return "separate", f"Add + LayerNormalization ran faster than the fused layer norms: {shown}"
    return "fused", (f"the separate layer norms were not clearly faster ({shown}; needs {MIN_GAIN:.2f}x at one cell "
                     f"and no loss over {MAX_LOSS:.2f}x at the other)")


def choose_form(files: dict[str, Path], feeds: dict[str, dict[str, np.ndarray]], providers: list[Any],
                threads: int | None, device: str, rounds: int = 5) -> FormChoice:
    """Time each form's file (`files`, by form) on every feed of `feeds` (by cell name), interleaved (at most
    `rounds`, or CELL_SECONDS a cell: a base-size model's largest cell takes seconds a call), and decide."""
    sessions = {form: session(path, providers, threads) for form, path in files.items()}

    def calls(cell: str) -> dict[str, Callable[[], object]]:
        return {form: call_for(s, {i.name: feeds[cell][i.name] for i in s.get_inputs()}, device)
                for form, s in sessions.items()}
    ms = cell_medians_ms(calls, list(feeds), rounds, block=3, budget_s=CELL_SECONDS, min_rounds=2)
    chosen, reason = decide(ms)
    return FormChoice(chosen, reason, ms)

"""The layer-norm form of the fused fp32 graph (`variants.GRAPH_FORMS`), chosen by measurement on the host: both
forms are built, timed in rotating rounds at the bench's smallest and largest cell with the run's device and
threads, and the separate form replaces ONNX Runtime's fused default only when it is clearly faster. The fp16 and
int8 variants are built from the chosen file, so they inherit its form. Only speed follows this measurement: the two
forms compute the same, and the parity step checks every variant built from either."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from workbench.measure.sessions import file_medians_ms

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
    """Time each form's file (`files`, by form) on every feed of `feeds` (by cell name), interleaved, and decide."""
    ms = file_medians_ms(files, feeds, providers, threads, device, rounds)
    chosen, reason = decide(ms)
    return FormChoice(chosen, reason, ms)

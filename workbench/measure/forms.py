"""The form of the fused fp32 graph, chosen by measurement on the host.

For a family ONNX Runtime has fusion rules for, the layer-norm form (`variants.GRAPH_FORMS`): both forms are built,
timed in rotating rounds at the bench's smallest and largest cell with the run's device and threads, and the
separate form replaces ONNX Runtime's fused default only when it is clearly faster. For a family without rules, the
graph fused with borrowed rules (`variants.borrowed_fp32`) beside the basic one: it must first give the basic
graph's outputs on the same real text within the fp32 gate, then be clearly faster, to be kept. The fp16 and int8
variants are built from the chosen file, so they inherit its form; the parity step checks every variant."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from workbench.graphs.tables import Borrowed, ExportMetrics, FormChoice, Timings, Trial
from workbench.measure.settings import BenchSettings
from workbench.models.batches import Batch, Feed, cell_feeds
from workbench.precision.compare import DEFAULT_TOLERANCES
from workbench.runners import IO, Device, Runner
from workbench.runners.onnxruntime import OrtRunner, device_for, providers_for
from workbench.runners.timing import cell_medians_ms

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase as Tokenizer

CELL_SECONDS = 8.0  # rounds of one cell stop after this long (two rounds at least)
MIN_GAIN = 1.03  # the separate form must be 3% faster at one of the cells
MAX_LOSS = 1.02  # and no more than 2% slower at the other
# Rounds of a timing across runtimes (OpenVINO against ONNX Runtime; a cell's rounds stop after CELL_SECONDS): two
# runtimes differ more from call to call than two graphs in one runtime do.
RUNTIME_ROUNDS = 15
RULE = f"needs {MIN_GAIN:.2f}x at one cell and no loss over {MAX_LOSS:.2f}x at the other"


def clearly_faster(ms: Timings, default: str, challenger: str) -> tuple[bool, str]:
    """Whether `challenger` is `MIN_GAIN` faster than `default` at one cell and at most `MAX_LOSS` slower at the
    other (median ms per graph and cell), and the gains as text."""
    gains = {cell: ms[default][cell] / ms[challenger][cell] for cell in ms[default]}
    shown = ", ".join(f"{gain:.2f}x at {cell}" for cell, gain in gains.items())
    return max(gains.values()) >= MIN_GAIN and min(gains.values()) >= 1 / MAX_LOSS, shown


def decide(ms: Timings) -> tuple[str, str]:
    """The form to keep from median ms per form and cell: "separate" when it is clearly faster than "fused"
    (`clearly_faster`), else "fused" (ONNX Runtime's default)."""
    faster, shown = clearly_faster(ms, "fused", "separate")
    if faster:
        return "separate", f"Add + LayerNormalization ran faster than the fused layer norms: {shown}"
    return "fused", f"the separate layer norms were not clearly faster ({shown}; {RULE})"


Feeds = dict[str, Feed]  # by cell name (`b1 s16`): the inputs filling that cell


@dataclass(frozen=True)
class RaceBench:
    """What every race of one run times, built once (`race_bench`): the run's corpus filling the bench's smallest
    and largest cell, and the providers, threads and device of the run's ONNX Runtime sessions."""

    feeds: Feeds
    providers: list[str]
    threads: int | None
    device: Device

    @contextmanager
    def open(self, files: dict[str, Path]) -> Iterator[dict[str, Runner]]:
        """An ONNX Runtime runner per file (by name), timed as `measure.sessions.call_for` times a session: numpy
        in and out on the CPU, inputs bound on the device once on CUDA; all closed when the block ends."""
        io: IO = "device" if self.device == "cuda" else "host"
        with ExitStack() as stack:
            yield {name: stack.enter_context(OrtRunner(name, path, self.providers, self.threads, io=io))
                   for name, path in files.items()}


def _timed(runners: dict[str, Runner], feeds: Feeds, rounds: int) -> Timings:
    """Median ms per runner (by name) and cell, interleaved (at most `rounds`, or CELL_SECONDS a cell: a base-size
    model's largest cell takes seconds a call)."""
    def calls(cell: str) -> dict[str, Callable[[], object]]:
        return {name: runner.timed(Batch(cell, [], feeds[cell])) for name, runner in runners.items()}
    return cell_medians_ms(calls, list(feeds), rounds, block=3, budget_s=CELL_SECONDS, min_rounds=2)


def largest_difference(first: Runner, second: Runner, feeds: Feeds) -> tuple[float, bool]:
    """The largest absolute difference between the two runners' outputs (by the first's names) on every feed, and
    whether every element is within the fp32 gate (atol + rtol x |first|) of the first's."""
    gate = DEFAULT_TOLERANCES["fp32"]["hidden"]
    largest, within = 0.0, True
    for cell, feed in feeds.items():
        wanted, got = first.infer(Batch(cell, [], feed)), second.infer(Batch(cell, [], feed))
        for name, want in wanted.items():
            diff = np.abs(got[name].astype(np.float64) - want)
            largest = max(largest, float(np.nan_to_num(diff, nan=np.inf).max()))
            within = within and bool(np.all(diff <= (gate.atol or 0.0) + (gate.rtol or 0.0) * np.abs(want)))
    return largest, within


def trial(default: str, challenger: str, runners: dict[str, Runner], feeds: Feeds, untimed: str | None = None,
          rounds: int = 5) -> Trial:
    """Keep `challenger` over `default` (both in `runners`, by name): never when its outputs differ beyond the fp32
    gate; when they match, if it is also clearly faster here (`race`), or without timing where `untimed` says why
    not."""
    largest, matches = largest_difference(runners[default], runners[challenger], feeds)
    if not matches:
        return Trial(max_abs=largest, matches=False, ms={}, kept=False, reason=f"its outputs differ from the {default} "
                     f"graph's by up to {largest:.2g} on the same text, beyond the fp32 gate")
    if untimed:
        return Trial(max_abs=largest, matches=True, ms={}, kept=True, reason=untimed)
    ms, kept, reason = race(default, challenger, runners, feeds, rounds)
    return Trial(max_abs=largest, matches=True, ms=ms, kept=kept, reason=reason)


def race(default: str, challenger: str, runners: dict[str, Runner], feeds: Feeds,
         rounds: int = 5) -> tuple[Timings, bool, str]:
    """`challenger` timed against `default` (interleaved, at every cell of `feeds`): the median ms, whether it is
    clearly faster (`clearly_faster`) and why."""
    ms = _timed(runners, feeds, rounds)
    faster, shown = clearly_faster(ms, default, challenger)
    mixed = max(ms[default][cell] / ms[challenger][cell] for cell in ms[default]) >= MIN_GAIN
    reason = (f"clearly faster than the {default} graph: {shown} ({RULE})" if faster else
              f"faster than the {default} graph at one cell, slower at another ({shown}; {RULE})" if mixed else
              f"not clearly faster than the {default} graph ({shown}; {RULE})")
    return ms, faster, reason


def choose_borrowed(files: dict[str, Path], bench: RaceBench, fused: dict[str, int], attention: str, rules: str,
                    untimed: str | None = None) -> Borrowed:
    """The graph fused with borrowed `rules` (`files["borrowed"]`) tried against `files["basic"]` (`trial`)."""
    with bench.open(files) as runners:
        tried = trial("basic", "borrowed", runners, bench.feeds, untimed)
        return Borrowed(rules=rules, fused=fused, attention=attention, **tried.recorded())


def choose_form(files: dict[str, Path], bench: RaceBench) -> FormChoice:
    """Time each form's file (`files`, by form) on every feed of `bench`, interleaved, and decide."""
    with bench.open(files) as runners:
        ms = _timed(runners, bench.feeds, 5)
    chosen, reason = decide(ms)
    return FormChoice(chosen=chosen, reason=reason, ms=ms)


def race_bench(bench: BenchSettings, texts: list[str], device: str, threads: int | None, tokenizer: Tokenizer,
               export: ExportMetrics) -> RaceBench:
    """The races' bench of a run: its `texts` filling the bench's smallest and largest cell (sequences capped at the
    model's limit), on the run's `device` and `threads`; what the optimize and parity steps time."""
    cells = sorted({(min(bench.batches), min(min(bench.sequences), export.max_sequence)),
                    (max(bench.batches), min(max(bench.sequences), export.max_sequence))})
    return RaceBench(cell_feeds(tokenizer, tuple(export.io.inputs), texts, cells), providers_for(device), threads,
                     device_for(device))

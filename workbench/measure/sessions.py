"""ONNX Runtime session settings as part of a variant, chosen by measurement.

At batch 1 and a short sequence a call is per-op overhead more than arithmetic, and the settings that shape that
overhead are screened per variant on one real batch in rotating blocks: on the CPU threads, the graph optimization
level applied at load, the execution mode and whether idle threads spin; on CUDA the provider's options (cuDNN
workspace, arena growth, copies in the default stream), with inputs and outputs bound on the device, never CPU
thread counts. The screen's fastest is then re-measured head to head with the default at the smallest and the largest
cell, and replaces it only when clearly faster at the one and no slower at the other. Only speed follows this
measurement: verdicts never read it.

Spinning is measured and reported but never chosen: a spinning session keeps its threads busy after each call and
takes the cores from everything else on the host (PyTorch ran 2x slower beside one, even 10 ms after its calls),
so it would distort every side-by-side measurement and starve a served tokenizer.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from workbench.measure.tables import SessionTuning
from workbench.runners.onnxruntime import EXECUTION_MODES, OPTIMIZATION_LEVELS, SessionSettings
from workbench.runners.timing import interleaved

if TYPE_CHECKING:
    from onnxruntime import InferenceSession

    Sessions = Callable[[SessionSettings], InferenceSession]  # a new session with the given settings

# CUDA provider options screened on CUDA sessions, ONNX Runtime's default first.
CUDA_OPTIONS = {"cudnn_conv_use_max_workspace": ("1", "0"),
                "arena_extend_strategy": ("kNextPowerOfTwo", "kSameAsRequested"),
                "do_copy_in_default_stream": ("1", "0")}
MIN_GAIN = 1.05  # head to head at the smallest cell, the challenger must beat the default by 5%
MAX_LARGE_LOSS = 1.02  # and be no more than 2% slower at the largest cell


def candidates(threads: int) -> list[SessionSettings]:
    """The default with `threads` first, then every combination of fewer threads, optimization level and execution
    mode (none spins: see `spinning_gain`)."""
    default = SessionSettings(threads)
    grid = [SessionSettings(t, False, level, mode)
            for t, level, mode in itertools.product(sorted({1, threads}, reverse=True), OPTIMIZATION_LEVELS,
                                                    EXECUTION_MODES)]
    return [default, *(s for s in grid if s != default)]


def cuda_candidates() -> list[SessionSettings]:
    """ONNX Runtime's CUDA defaults first, then every combination of `CUDA_OPTIONS`."""
    default = SessionSettings(cuda=tuple((name, values[0]) for name, values in CUDA_OPTIONS.items()))
    grid = [SessionSettings(cuda=tuple(zip(CUDA_OPTIONS, values))) for values in
            itertools.product(*CUDA_OPTIONS.values())]
    return [default, *(s for s in grid if s != default)]


def call_for(session: InferenceSession, feed: dict[str, np.ndarray], device: str) -> Callable[[], object]:
    """One call of `session` on `feed` as it is timed: numpy in and out on the CPU; on CUDA with the inputs bound on
    the device once and the outputs left there, returning once the device is done."""
    if device == "cpu":
        return lambda: session.run(None, feed)
    from onnxruntime import OrtValue

    binding = session.io_binding()
    for name, array in feed.items():
        binding.bind_ortvalue_input(name, OrtValue.ortvalue_from_numpy(array, device, 0))
    for output in session.get_outputs():
        binding.bind_output(output.name, device)

    def call() -> object:
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        return binding
    return call


def choose(default: SessionSettings, challenger: SessionSettings | None, small_ms: dict[SessionSettings, float],
           large_ms: dict[SessionSettings, float]) -> tuple[SessionSettings, str]:
    """The screen's fastest `challenger` when, head to head with `default`, it is `MIN_GAIN` faster at the smallest
    cell and at most `MAX_LARGE_LOSS` slower at the largest (one setting serves every shape); else `default`.
    The head-to-head re-measure keeps the screen's luckiest draw from winning on noise."""
    if challenger is None:
        return default, "the default was the fastest in the screen"
    gain, large = small_ms[default] / small_ms[challenger], large_ms[default] / large_ms[challenger]
    if gain < MIN_GAIN:
        return default, (f"the screen's fastest ({challenger.label()}) was {gain:.2f}x the default head to head "
                         f"(needs {MIN_GAIN:.2f}x)")
    if large < 1 / MAX_LARGE_LOSS:
        return default, (f"the screen's fastest ({challenger.label()}) was {gain:.2f}x the default at the smallest "
                         f"cell but {large:.2f}x at the largest")
    return challenger, (f"{gain:.2f}x faster than the default head to head at the smallest cell, {large:.2f}x at "
                        f"the largest ({challenger.label()})")


def _medians_ms(samples: dict[SessionSettings, list[float]]) -> dict[SessionSettings, float]:
    return {s: float(np.median(v)) * 1e3 for s, v in samples.items()}


def spinning_gain(make_session: Sessions, feed: dict[str, np.ndarray],
                  default: SessionSettings, calls: int = 40) -> float:
    """Default median over spinning median at `feed`, measured in separate phases (default, spinning, default)
    with the spinning session dropped before the last: its threads would slow whatever runs after it."""
    before, spinning, after = (_alone(make_session, settings, feed, calls) for settings in (
        default, SessionSettings(default.threads, spinning=True), default))
    return (before + after) / 2 / spinning


def _alone(make_session: Sessions, settings: SessionSettings, feed: dict[str, np.ndarray],
           calls: int) -> float:
    """Median ms of `calls` calls of a session of its own, released on return (its threads with it)."""
    session = make_session(settings)
    return _medians_ms(interleaved({settings: lambda: session.run(None, feed)}, 1, block=calls))[settings]


def tune(make_session: Sessions, small: dict[str, np.ndarray], large: dict[str, np.ndarray],
         threads: int, device: str = "cpu", rounds: int = 5, block: int = 8) -> SessionTuning:
    """Screen every candidate for `device` at `small` (the smallest cell), re-measure the fastest head to head with
    the default at `small` and `large`, and choose (`choose`). Returns the device, the choice, why and every median;
    on the CPU the spinning gain, on CUDA what I/O binding gains over numpy in and out (the default's median of
    each)."""
    options = candidates(threads) if device == "cpu" else cuda_candidates()
    default = options[0]
    sessions = {s: make_session(s) for s in options}
    small_calls = {s: call_for(r, small, device) for s, r in sessions.items()}
    screen = _medians_ms(interleaved(small_calls, rounds, block=block))
    fastest = min(options, key=lambda s: (screen[s], s != default))
    challenger = None if fastest == default else fastest
    pair = [default] + ([challenger] if challenger else [])
    small_ms = _medians_ms(interleaved({s: small_calls[s] for s in pair}, 2 * rounds, block=block))
    large_ms = _medians_ms(interleaved({s: call_for(sessions[s], large, device) for s in pair}, rounds, block=3))
    if device == "cpu":
        gains = {"spinning_gain": round(spinning_gain(make_session, small, default), 3)}  # measured, never applied
    else:
        host_calls = {default: call_for(sessions[default], small, "cpu")}
        host = _medians_ms(interleaved(host_calls, rounds, block=block))[default]
        gains = {"io_binding_gain": round(host / small_ms[default], 3)}
    del sessions, small_calls
    chosen, reason = choose(default, challenger, small_ms, large_ms)
    return SessionTuning(
        device=device, chosen=chosen.record(), reason=reason,
        head_to_head=[{**s.record(), "small_ms": round(small_ms[s], 4), "large_ms": round(large_ms[s], 4)}
                      for s in pair], **gains,
        screen=[{**s.record(), "p50_ms": round(screen[s], 4)} for s in options])


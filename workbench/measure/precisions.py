"""Which reduced precisions a run builds, checks and repairs (`precisions: auto`), from the deployment's target:
fp16 where it can serve (a GPU, or a CPU with fp16 arithmetic), int8 where it pays. Whether a precision pays is a
speed question, answered the way speed is answered here: the plain variant against fp32 at the goal cells (batch 1
at the shortest sequence, the largest batch at the longest), interleaved on this host, before any repair. A target
that is not this host cannot be measured: its instruction set decides. An explicit `precisions` list always wins,
and is measured all the same where it can be, so the serving order follows the measurement too."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from workbench.core.advice import set_settings
from workbench.core.machine import INT8_INSTRUCTIONS, SPEED_FLAGS, cpu_flags
from workbench.graphs.tables import PrecisionDecision, Timings
from workbench.measure.sessions import call_for
from workbench.runners.onnxruntime import session
from workbench.runners.timing import interleaved

MIN_GAIN = 1.2  # a reduced precision pays where it is at least this much faster than fp32 in one goal cell
# Rounds per cell (each file BLOCK calls a round, the first not counted): at most ROUNDS, stopping after CELL_SECONDS
# once MIN_ROUNDS are done (a base-size model's largest cell takes seconds a call).
ROUNDS, MIN_ROUNDS, BLOCK, CELL_SECONDS = 15, 2, 3, 8.0
FP16_FLAGS = {"avx512_fp16": "AVX512-FP16", "amx_fp16": "AMX-FP16"}
# The instruction sets a named target CPU has (target.cpu), as /proc/cpuinfo names them.
TARGET_FLAGS = {
    "avx2": {"avx2", "fma"},
    "avx512": {"avx2", "fma", "avx512f", "avx512bw"},
    "avx512_vnni": {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"},
    "avx_vnni": {"avx2", "fma", "avx_vnni"},
    "amx": {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "amx_tile", "amx_int8", "amx_bf16"},
}

TARGET_NAMES = {"avx2": "AVX2", "avx512": "AVX-512", "avx512_vnni": "AVX-512 VNNI", "avx_vnni": "AVX-VNNI",
                "amx": "AMX"}


@dataclass(frozen=True)
class Target:
    """The deployment's machine: a GPU, this host's CPU (`measured`: speed is measured here) or a named CPU."""

    kind: Literal["gpu", "host", "cpu"]
    flags: frozenset[str] = frozenset()
    name: str = "this host"

    @property
    def measured(self) -> bool:
        return self.kind == "host"

    @property
    def int8_instructions(self) -> str | None:
        return next((name for flag, name in INT8_INSTRUCTIONS if flag in self.flags), None)

    @property
    def fp16_arithmetic(self) -> str | None:
        return next((name for flag, name in FP16_FLAGS.items() if flag in self.flags), None)

    def record(self) -> dict[str, Any]:
        """The target as run.json holds it: its kind, name, and the flags that decide precisions."""
        relevant = set(SPEED_FLAGS) | set(FP16_FLAGS)
        return {"kind": self.kind, "name": self.name, "flags": sorted(self.flags & relevant)}


def target_for(cpu: str, gpu: bool) -> Target:
    """The deployment target: the GPU the run's sessions use, else this host (`cpu` host) or the named CPU."""
    if gpu:
        return Target("gpu", name="the GPU")
    if cpu == "host":
        return Target("host", frozenset(cpu_flags()))
    return Target("cpu", frozenset(TARGET_FLAGS[cpu]), f"an {TARGET_NAMES[cpu]} CPU (target.cpu={cpu})")


# What a decision's speedups are, beside its ms (which can order two files the other way on a shared host).
PAIRED = ("the median over rounds of fp32's time / the variant's in the same round; ms: each file's own median, "
          "over all its rounds")


def decision(built: bool, reason: str, pays: bool | None = None) -> PrecisionDecision:
    """A reduced precision's decision before any measurement: whether it is built, why, and whether it pays where it
    cannot be measured here (a named target's instructions; None: not known until measured)."""
    return PrecisionDecision(built=built, reason=reason, pays=pays, speedups={}, ms={})


def plan(setting: list[str] | str, target: Target, tensorrt: bool) -> dict[str, PrecisionDecision]:
    """Per reduced precision, before any measurement: built (explicit list, or the target serves it), measured
    (auto on this host: `settle` decides once timed), or skipped with the reason. `tensorrt`: the run builds
    TensorRT engines on a GPU (its fp16 engine keeps what the fp16 repair finds)."""
    assumed = {"fp16": target.kind == "gpu" or bool(target.fp16_arithmetic),
               "int8": target.kind != "gpu" and bool(target.int8_instructions)}
    if setting != "auto":
        return {p: decision(p in setting, "configured (precisions)" if p in setting else
                            "not in the configured precisions", assumed[p]) for p in ("fp16", "int8")}
    if target.kind == "gpu":
        why = "a TensorRT engine will be built from it" if tensorrt else "it serves on the GPU"
        return {"fp16": decision(True, f"fp16: {why}", True),
                "int8": decision(False, "ONNX Runtime's dynamic int8 runs on the CPU only; the GPU deployment serves "
                                        "fp16 (list int8 in precisions to check it)", False)}
    fp16 = target.fp16_arithmetic
    decisions = {"fp16": decision(bool(fp16), f"{target.name} has {fp16}: measured against fp32" if fp16
                                  else f"{target.name} has no fp16 arithmetic (AVX512-FP16, AMX-FP16): fp16 would "
                                       "run through casts, slower than fp32")}
    int8 = target.int8_instructions
    if target.measured:
        decisions["int8"] = decision(True, "measured against fp32 on this host")
    elif int8:
        decisions["int8"] = decision(True, f"{target.name} has {int8} (not measured: not this host)", True)
    else:
        decisions["int8"] = decision(False, f"{target.name} has no int8 dot-product instructions, and whether int8 "
                                            "pays there depends on the model: measure on that host (target.cpu=host), "
                                            "or list int8 in precisions", False)
    return decisions


def settle(decided: PrecisionDecision, precision: str, speedups: dict[str, float], ms: Timings,
           auto: bool) -> PrecisionDecision:
    """`decided` once `precision`'s plain variant was timed against fp32 (`speedups` and the median `ms` per goal
    cell): it pays at MIN_GAIN in one goal cell; auto keeps it only where it pays, a configured one is kept either
    way."""
    decided.ms, decided.speedups, decided.speedups_are = ms, speedups, PAIRED
    decided.pays = max(speedups.values()) >= MIN_GAIN if speedups else decided.pays
    shown = ", ".join(f"{gain:.2f}x fp32 at {cell}" for cell, gain in speedups.items())
    if not auto:
        decided.reason = f"configured (precisions); measured {shown}"
    elif decided.pays:
        decided.reason = f"pays on this host: {shown} (needs {MIN_GAIN}x at one goal cell)"
    else:
        decided.built = False
        decided.reason = (f"does not pay on this host: {shown} (needs {MIN_GAIN}x at one goal cell); to build it "
                          f"anyway: {set_settings({'precisions': ['fp32', precision]})}")
    return decided


def paired_speedups(files: dict[str, Path], feeds: dict[str, dict[str, np.ndarray]], providers: list[Any],
                    threads: int | None, device: str, rounds: int = ROUNDS, seconds_per_cell: float = CELL_SECONDS
                    ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Per file other than "fp32" and per goal cell (`feeds`, by cell name): its speedup over "fp32" as the median,
    over rotating rounds, of the two files' times in the same round (a slow spell of a shared host slows both of a
    pair alike); and every file's median ms per cell. At least MIN_ROUNDS rounds a cell, at most `rounds` or about
    `seconds_per_cell`."""
    sessions = {name: session(path, providers, threads) for name, path in files.items()}
    speedups: dict[str, dict[str, float]] = {name: {} for name in files if name != "fp32"}
    ms: dict[str, dict[str, float]] = {name: {} for name in files}
    for cell, feed in feeds.items():
        calls = {name: call_for(s, {i.name: feed[i.name] for i in s.get_inputs()}, device)
                 for name, s in sessions.items()}
        samples = interleaved(calls, rounds, warmup=1, block=BLOCK, budget_s=seconds_per_cell, min_rounds=MIN_ROUNDS)
        per_round = {name: np.asarray(values).reshape(-1, BLOCK - 1).mean(axis=1) for name, values in samples.items()}
        for name, values in per_round.items():
            ms[name][cell] = round(float(np.median(values)) * 1e3, 4)
            if name != "fp32":
                speedups[name][cell] = round(float(np.median(per_round["fp32"] / values)), 3)
    return speedups, ms

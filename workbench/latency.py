"""In-process latency: every runner on the same real-text batches, interleaved rounds, fixed threads."""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from workbench.batches import Batch
    from workbench.runners import Runner

PERCENTILES = (50, 90, 95, 99)


def percentiles_ms(samples: list[float]) -> dict[str, float]:
    values = np.asarray(samples) * 1e3
    return {f"p{q}": float(np.percentile(values, q)) for q in PERCENTILES} | {"mean": float(values.mean())}


def interleaved(calls: dict[str, Callable[[], object]], rounds: int, warmup: int,
                budget_s: float = 120.0, min_rounds: int = 5) -> dict[str, list[float]]:
    """Seconds per call for each named callable, measured in interleaved rounds (the order rotates every round),
    so a slow spell of the machine hits every runner alike. Stops early after `budget_s` (at least `min_rounds`)."""
    names = list(calls)
    for name in names:
        for _ in range(warmup):
            calls[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    start = time.perf_counter()
    for index in range(rounds):
        for name in names[index % len(names):] + names[:index % len(names)]:
            begin = time.perf_counter()
            calls[name]()
            samples[name].append(time.perf_counter() - begin)
        if index + 1 >= min_rounds and time.perf_counter() - start > budget_s:
            break
    return samples


DISTURBANCE_FACTOR = 1.5  # a runner this much slower on less work than elsewhere was not measuring itself


def disturbances(cells: dict[str, dict[str, dict[str, Any]]], flops: dict[str, float]) -> list[str]:
    """Signs, read from the medians themselves, that other work on the host distorted the grid: a runner whose
    median in one cell is more than `DISTURBANCE_FACTOR` times its median in a cell with at least as much work
    (oversubscribed threads can slow one runner 50x and not another, so ratios do not hold either)."""
    found = []
    for small in cells:
        for large in cells:
            if small == large or flops[large] < flops[small]:
                continue
            for runner, stats in cells[small].items():
                other = cells[large].get(runner)
                if other and stats["p50"] > DISTURBANCE_FACTOR * other["p50"]:
                    found.append(f"{runner} took {stats['p50']:.1f} ms at {small} but {other['p50']:.1f} ms at "
                                 f"{large}, which does more work")
    return found


def disturbance_note(found: list[str]) -> str:
    """What a disturbed grid means for its reader, naming the first sign."""
    return (f"timings disturbed by other work on the host ({found[0]}): re-run the bench step on a quiet host "
            "before trusting the speeds")


def matmul_flops(layers: int, hidden: int, intermediate: int, rows: int, length: int) -> float:
    """Multiply-add FLOPs of an encoder's matmuls: Q, K, V, output and the two feed-forward projections per token,
    plus the two attention products (scores and weighted values) per layer."""
    tokens = rows * length
    linear = 2 * tokens * (4 * hidden * hidden + 2 * hidden * intermediate)
    attention = 2 * 2 * rows * length * length * hidden
    return float(layers * (linear + attention))


PEAK_SIZES = (1024, 2048)


def matmul_peak_gflops(threads: int, repeats: int = 5) -> float:
    """Best fp32 GFLOP/s of a square matmul on this machine with `threads` threads (the achievable peak): the faster
    of PyTorch's and ONNX Runtime's kernels over a few sizes, so no fp32 variant outruns the peak because one
    library's kernel was the slower one."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = max(_best_gflops(_torch_matmul(size), size, repeats) for size in PEAK_SIZES)
    finally:
        torch.set_num_threads(previous)
    return max(best, *(_best_gflops(_ort_matmul(size, threads), size, repeats) for size in PEAK_SIZES))


def _best_gflops(call: Callable[[], object], size: int, repeats: int) -> float:
    call()
    return 2 * size**3 / min(_timed(call) for _ in range(repeats)) / 1e9


def _torch_matmul(size: int) -> Callable[[], object]:
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    return lambda: torch.mm(a, b)


def _ort_matmul(size: int, threads: int) -> Callable[[], object]:
    import onnxruntime
    from onnx import TensorProto, helper

    square = [size, size]
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "peak",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, square) for n in "ab"],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, square)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feed = {n: np.random.default_rng(0).random(square, dtype=np.float32) for n in "ab"}
    return lambda: session.run(None, feed)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def summarize(samples: dict[str, list[float]], rows: int, length: int, reference: str) -> dict[str, dict[str, Any]]:
    """Percentiles, throughput and the speedup over `reference` (ratio of medians) per runner."""
    base = float(np.median(samples[reference])) if reference in samples else None
    result = {}
    for name, values in samples.items():
        median = float(np.median(values))
        result[name] = {**percentiles_ms(values), "rounds": len(values), "sequences_per_s": rows / median,
                        "tokens_per_s": rows * length / median,
                        "speedup": base / median if base else None}
    return result


def tune_sessions(config: Any, record: Any, small: Batch, large: Batch, threads: int) -> dict[str, dict[str, Any]]:
    """Per ONNX variant, the session settings measured fastest at `small` (the grid's smallest cell, where per-op
    overhead dominates) and no slower at `large` (its largest), with every median (`workbench.sessions.tune`)."""
    from workbench.progress import track
    from workbench.runners.onnxruntime import providers_for, session
    from workbench.sessions import tune

    providers = providers_for(config.device)
    variants = record.variants("onnx")
    return {name: tune(lambda settings, path=variants[name][0]: session(path, providers, settings=settings),
                       small.feed, large.feed, threads)
            for name in track(list(variants), "bench: session settings", "variants")}


def benchmark_runners(config: Any, record: Any, stack: ExitStack,
                      tuned: dict[str, dict[str, Any]] | None = None) -> dict[str, Runner]:
    """PyTorch eager (the reference), every ONNX variant in ONNX Runtime (with its `tuned` settings, if any), and
    TensorRT engines where built; each is closed when `stack` closes (also those opened before one that fails)."""
    from workbench.models import load_model
    from workbench.runners.onnxruntime import OrtRunner, providers_for
    from workbench.runners.torch import TorchRunner
    from workbench.sessions import SessionSettings

    threads = config.threads or os.cpu_count() or 1
    runners: dict[str, Runner] = {"pytorch": stack.enter_context(TorchRunner(load_model(config), config.output_specs))}
    for name, (path, _) in record.variants("onnx").items():
        settings = SessionSettings(**tuned[name]["chosen"]) if tuned and name in tuned else None
        runners[name] = stack.enter_context(OrtRunner(name, path, providers_for(config.device), threads, settings))
    engines = record.variants("engine")
    if engines:
        from workbench.runners.tensorrt import TrtEngineRunner

        for name, (path, _) in engines.items():
            runners[name] = stack.enter_context(TrtEngineRunner(name, path, record.engine_profiles(name)))
    return runners


def run_latency_benchmark(config: Any, record: Any) -> dict[str, Any]:
    """The batch x sequence grid of `config.bench` on real text; per cell and runner: percentiles, throughput,
    speedup over PyTorch; fp32-equivalent GFLOP/s against a matmul peak measured in the same run."""
    with ExitStack() as stack:  # every runner is closed, even when the benchmark fails
        return _latency_benchmark(config, record, stack)


def _latency_benchmark(config: Any, record: Any, stack: ExitStack) -> dict[str, Any]:
    import torch

    from workbench.batches import shaped_batch, token_lengths
    from workbench.data import load_corpus
    from workbench.progress import track

    bench, export = config.bench, record.export_info()
    threads = config.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    tokenizer = record.tokenizer()
    texts = list(load_corpus(config.corpus))
    lengths = token_lengths(tokenizer, texts)
    sequences = [s for s in bench.sequences if s <= export["max_sequence"]]
    small, large = (shaped_batch(tokenizer, tuple(export["io"]["inputs"]), texts, lengths, pick(bench.batches),
                                 pick(sequences)) for pick in (min, max))
    tuned = tune_sessions(config, record, small, large, threads) if bench.tune_sessions else {}
    runners = benchmark_runners(config, record, stack, tuned)
    verdicts = record.verdicts()
    passed = {name: name == "pytorch" or bool(verdicts.get(name, {}).get("passed")) for name in runners}
    cells: dict[str, Any] = {}
    flops: dict[str, float] = {}
    shapes = [(rows, length) for rows in bench.batches for length in sequences]
    for rows, length in track(shapes, "bench: latency grid", "cells", note=lambda shape: f"b{shape[0]}_s{shape[1]}"):
        batch = shaped_batch(tokenizer, tuple(export["io"]["inputs"]), texts, lengths, rows, length)
        calls = {name: (lambda r=runner, b=batch: r.infer(b)) for name, runner in runners.items()}
        samples = interleaved(calls, bench.rounds, bench.warmup, bench.seconds_per_cell)
        cell = f"b{rows}_s{length}"
        cells[cell] = summarize(samples, rows, length, "pytorch")
        flops[cell] = matmul_flops(export["num_layers"], export["hidden_size"], export["intermediate_size"],
                                   rows, length)
        for name, stats in cells[cell].items():
            stats["gflops"] = flops[cell] / (stats["p50"] / 1e3) / 1e9
    best = {cell: max((n for n in stats if passed[n]), key=lambda n: stats[n]["speedup"] or 0)
            for cell, stats in cells.items()}
    return {"threads": threads, "cells": cells, "flops": flops, "passed": passed, "sessions": tuned,
            "disturbed": disturbances(cells, flops),
            "best": {cell: {"variant": name, "speedup": cells[cell][name]["speedup"]} for cell, name in best.items()},
            "peak_gflops": matmul_peak_gflops(threads)}



def corpus_rates(runner: Runner, batches: dict[int, list[Batch]], passes: int = 3) -> dict[str, Any]:
    """What one in-process runner delivers on the served texts (`batches`: per batch size, the texts in order,
    tokenized beforehand as a client would): sequences/s of the fastest of `passes` passes per batch size, the
    best size, and at batch size 1 the median call in ms (the in-process side of served/in-process ratios)."""
    rates: dict[str, Any] = {"sequences_per_s": {}}
    for size, sized in batches.items():
        texts = sum(len(batch.text_ids) for batch in sized)
        runner.infer(sized[0])  # warm-up
        calls: list[float] = []
        best = float("inf")
        for _ in range(passes):
            start = time.perf_counter()
            for batch in sized:
                begin = time.perf_counter()
                runner.infer(batch)
                calls.append(time.perf_counter() - begin)
            best = min(best, time.perf_counter() - start)
        rates["sequences_per_s"][str(size)] = texts / best
        if size == 1:
            rates["p50_ms"] = float(np.median(calls)) * 1e3
    rates["best_batch"] = int(max(rates["sequences_per_s"], key=rates["sequences_per_s"].get))
    return rates

"""In-process latency: every runner on the same real-text batches, interleaved rounds, fixed threads."""
from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from workbench.core.results import Verdict
from workbench.measure.errors import DeviceMismatchError
from workbench.measure.tables import BestRow, CellTiming, GridRunner, InProcessRates, LatencyGrid, SessionTuning
from workbench.models.batches import Cell, shaped_batch, token_lengths
from workbench.runners import Device
from workbench.runners.timing import OthersBusy, elapsed, interleaved, too_busy

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from workbench.core.record import Variant
    from workbench.graphs.tables import ShapeProfile
    from workbench.models.batches import Batch
    from workbench.models.loading import LoadedModel
    from workbench.precision.lab import ParityLab
    from workbench.runners import Runner
    from workbench.tasks.registry import OutputSpec

PERCENTILES = (50, 90, 95, 99)


def percentiles_ms(samples: list[float]) -> dict[str, float]:
    values = np.asarray(samples) * 1e3
    return {f"p{q}": float(np.percentile(values, q)) for q in PERCENTILES} | {"mean": float(values.mean())}


DISTURBANCE_FACTOR = 1.5  # a runner this much slower on less work than elsewhere was not measuring itself
# A runner no slower at a cell with at least FLAT_WORK times the work of another, where it took FLAT_MS or more at
# the smaller one, was waiting, not computing: no per-call overhead is that long (a fresh-clone demo beside a test
# suite: PyTorch 398 ms at b1 s16 and 379 ms at b1 s128, and the summary printed "152x faster than PyTorch").
FLAT_WORK, FLAT_MS = 4.0, 20.0


def disturbances(cells: dict[str, dict[str, CellTiming]], flops: dict[str, float],
                 others_busy: float | None = None) -> list[str]:
    """Signs that other work on the host distorted the grid: it kept more than half the cores busy while the grid
    ran (`others_busy`, cores: it can slow one runner uniformly, PyTorch's spinning threads 30x and ONNX Runtime's
    sleeping ones far less, which no comparison of a runner's own medians shows), or, read from the medians
    themselves, a runner whose median in one cell is more than `DISTURBANCE_FACTOR` times its median in a cell with
    at least as much work (oversubscribed threads can slow one runner 50x and not another, so ratios do not hold
    either), or no longer in a cell with `FLAT_WORK` times the work where it took `FLAT_MS` or more in the smaller."""
    load = too_busy(others_busy) if others_busy is not None else ""
    found = [f"{load} while the grid ran"] if load else []
    for small in cells:
        for large in cells:
            if small == large or flops[large] < flops[small]:
                continue
            for runner, stats in cells[small].items():
                other = cells[large].get(runner)
                if not other:
                    continue
                if stats.p50 > DISTURBANCE_FACTOR * other.p50:
                    found.append(f"{runner} took {stats.p50:.1f} ms at {small} but {other.p50:.1f} ms at "
                                 f"{large}, which does more work")
                elif stats.p50 >= FLAT_MS and other.p50 <= stats.p50 and flops[large] >= FLAT_WORK * flops[small]:
                    found.append(f"{runner} took {other.p50:.1f} ms at {large}, {flops[large] / flops[small]:.1f}x "
                                 f"the work of {small}, where it took {stats.p50:.1f} ms: it was waiting, not "
                                 "computing")
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
    return 2 * size**3 / min(elapsed(call) for _ in range(repeats)) / 1e9


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


def baseline_for(name: str, rows: dict[str, GridRunner]) -> str | None:
    """The PyTorch eager fp32 row a row's speedup is measured against: the one on the same device with the same
    I/O (None where the run has none, e.g. ONNX Runtime on CUDA beside a PyTorch without CUDA)."""
    row = rows[name]
    return next((ref for ref, other in rows.items() if other.reference and other.device == row.device
                 and other.io == row.io), None)


def speedup(base: GridRunner, row: GridRunner, base_ms: float, row_ms: float) -> float:
    """`row`'s speedup over `base`: only ever on the same device."""
    if base.device != row.device:
        raise DeviceMismatchError(
            f"a speedup of {row.label} over {base.label} would compare {row.device} with {base.device}",
            "compare runners on the same device: the bench step measures a PyTorch baseline per device")
    return base_ms / row_ms


def summarize(samples: dict[str, list[float]], rows: int, length: int,
              described: dict[str, GridRunner]) -> dict[str, CellTiming]:
    """Percentiles, throughput and the speedup over each row's baseline (`baseline_for`, ratio of medians)."""
    medians = {name: float(np.median(values)) for name, values in samples.items()}
    result = {}
    for name, values in samples.items():
        base = baseline_for(name, described)
        result[name] = CellTiming(**percentiles_ms(values), rounds=len(values), sequences_per_s=rows / medians[name],
                                  tokens_per_s=rows * length / medians[name], baseline=base,
                                  speedup=speedup(described[base], described[name], medians[base], medians[name])
                                  if base in medians else None)
    return result


def tune_sessions(variants: dict[str, Variant], device: Device, small: Batch, large: Batch,
                  threads: int) -> dict[str, SessionTuning]:
    """Per ONNX variant ONNX Runtime runs, the session settings measured fastest at `small` (the grid's smallest
    cell, where per-op overhead dominates) and no slower at `large` (its largest), with every median
    (`measure.sessions.tune`): CPU threads and modes on the CPU, CUDA provider options with I/O binding on CUDA."""
    from workbench.core.progress import track
    from workbench.measure.sessions import tune
    from workbench.runners.onnxruntime import providers_for, session
    from workbench.runners.registry import runner_kind

    providers = providers_for(device)
    return {name: tune(lambda settings, path=variants[name].path: session(path, providers, settings=settings),
                       small.feed, large.feed, threads, device)
            for name in track([n for n, v in variants.items() if runner_kind(v.path).tuned],
                              "bench: session settings", "variants")}


ON_DEVICE = "@device"  # the suffix of a row that keeps its inputs and outputs on the device
REFERENCES = ("pytorch", f"pytorch{ON_DEVICE}")  # PyTorch eager fp32: the baselines, one per I/O
CHECKED_HERE = ("torch_compile", f"pytorch_fp16{ON_DEVICE}")  # rows no other step checks: the grid does


def is_variant_row(name: str) -> bool:
    """A row that measures an ONNX variant or engine end to end, as a deployment calls it."""
    return "@" not in name and name not in REFERENCES and name not in CHECKED_HERE


def row_variant(name: str) -> str:
    """The variant (or PyTorch row) a grid row measures: `fp32@device` measures fp32."""
    return name.split("@")[0]


@dataclass(frozen=True)
class GridRows:
    """What the grid's rows are made from: the PyTorch model (the reference), the ONNX variants and TensorRT
    engines (by name; engines with their shape profiles), the device and the threads."""

    model: LoadedModel
    specs: tuple[OutputSpec, ...]
    device: Device
    threads: int
    variants: dict[str, Variant]
    engines: dict[str, tuple[Variant, list[ShapeProfile]]] = field(default_factory=dict)
    torch_compile: bool = False

    def factories(self, tuned: dict[str, SessionTuning] | None = None) -> dict[str, Callable[[], Runner]]:
        """Every row of the grid, by name, as a function that opens its runner. On the CPU: PyTorch eager (the
        reference), every ONNX variant in ONNX Runtime (with its `tuned` settings) and, with `torch_compile`,
        torch.compile. On CUDA besides: PyTorch on device and in fp16 on device, and each variant with I/O binding
        (`<variant>@device`); TensorRT engines where built."""
        from workbench.runners.onnxruntime import OrtRunner, SessionSettings, providers_for
        from workbench.runners.registry import open_variant, runner_kind
        from workbench.runners.tensorrt import TrtEngineRunner
        from workbench.runners.torch import TorchRunner, torch_device

        on, loaded, specs = torch_device(self.device), self.model, self.specs
        providers, threads = providers_for(self.device), self.threads
        rows: dict[str, Callable[[], Runner]] = {"pytorch": lambda: TorchRunner(loaded, specs, device=on)}
        if on == "cuda":
            rows[f"pytorch{ON_DEVICE}"] = lambda: TorchRunner(loaded, specs, f"pytorch{ON_DEVICE}", on, io="device")
            rows[f"pytorch_fp16{ON_DEVICE}"] = lambda: TorchRunner(loaded, specs, f"pytorch_fp16{ON_DEVICE}", on,
                                                                   half=True, io="device")
        if self.torch_compile:
            rows["torch_compile"] = lambda: TorchRunner(loaded, specs, "torch_compile", on, compiled=True)
        for name, built in self.variants.items():
            settings = SessionSettings.from_record(tuned[name].chosen) if tuned and name in tuned else None
            rows[name] = lambda v=built, s=settings: open_variant(v, self.device, threads, s)
            if self.device == "cuda" and runner_kind(built.path).bound:
                rows[f"{name}{ON_DEVICE}"] = lambda v=built, s=settings: OrtRunner(
                    f"{v.name}{ON_DEVICE}", v.path, providers, threads, s, v.precision, io="device")
        for name, (engine, profiles) in self.engines.items():
            rows[name] = lambda v=engine, f=profiles: TrtEngineRunner(v.name, v.path, f, v.precision)
        return rows

    def open(self, stack: ExitStack, tuned: dict[str, SessionTuning] | None = None) -> dict[str, Runner]:
        """Every row's runner, each closed when `stack` closes (also those opened before one that fails to open)."""
        return {name: stack.enter_context(make()) for name, make in self.factories(tuned).items()}


@dataclass(frozen=True)
class GridShape:
    """The grid's cells (batch sizes x sequence lengths) and how each is timed."""

    batches: list[int]
    sequences: list[int]
    rounds: int
    warmup: int
    seconds_per_cell: float
    tune_sessions: bool = True
    long: list[int] = field(default_factory=list)  # lengths of a batch-1 cell each, past the grid's sequences


LONG_TEXT = 2048  # tokens: a long document's cell, where the model takes it


def long_lengths(sequences: list[int], sequence_max: int) -> list[int]:
    """The batch-1 cells for long texts: LONG_TEXT and `sequence_max` tokens, those longer than the grid's
    `sequences` and within the model's `sequence_max`."""
    return sorted({n for n in (LONG_TEXT, sequence_max) if max(sequences, default=0) < n <= sequence_max})


@dataclass(frozen=True)
class GridText:
    """The real text the grid's batches are cut from, with the tokenizer and the graph's input names."""

    tokenizer: PreTrainedTokenizerBase
    texts: list[str]
    input_names: tuple[str, ...]
    lengths: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", token_lengths(self.tokenizer, self.texts))

    def batch(self, rows: int, length: int) -> Batch:
        """Exactly `rows` x `length` tokens of real text."""
        return shaped_batch(self.tokenizer, self.input_names, self.texts, self.lengths, rows, length)


@dataclass(frozen=True)
class Dimensions:
    """The encoder's sizes its matmul FLOPs follow from (`matmul_flops`)."""

    layers: int
    hidden: int
    intermediate: int


def measure_grid(rows: GridRows, shape: GridShape, text: GridText, dims: Dimensions, verdicts: dict[str, bool],
                 lab: ParityLab | None = None) -> LatencyGrid:
    """The batch x sequence grid on real text; per cell and row: percentiles, throughput, speedup over the PyTorch
    row of its device; GFLOP/s against matmul peaks measured in the same run (per precision on CUDA); on CUDA,
    CUDA-graph rows per cell and each row's peak device memory. `verdicts`: which variants passed parity; `lab`
    checks the rows no other step checked (torch.compile, PyTorch fp16), needed where there are any."""
    with ExitStack() as stack:  # every runner is closed, even when the benchmark fails
        return _measure_grid(rows, shape, text, dims, verdicts, lab, stack)


def _measure_grid(rows: GridRows, shape: GridShape, text: GridText, dims: Dimensions, verdicts: dict[str, bool],
                  lab: ParityLab | None, stack: ExitStack) -> LatencyGrid:
    import torch

    from workbench.core.progress import track

    torch.set_num_threads(rows.threads)
    device = rows.device
    small, large = (text.batch(pick(shape.batches), pick(shape.sequences)) for pick in (min, max))
    tuned = tune_sessions(rows.variants, device, small, large, rows.threads) if shape.tune_sessions else {}
    factories = rows.factories(tuned)
    memory = ({name: device_memory(make, large) for name, make in track(
        list(factories.items()), "bench: device memory", "rows", note=lambda item: item[0])}
        if device == "cuda" else {})
    runners = {name: stack.enter_context(make()) for name, make in factories.items()}
    described = {name: GridRunner(**runner.describe(), reference=name in REFERENCES, variant=row_variant(name),
                                  peak_memory_mb=memory.get(name))
                 for name, runner in runners.items()}
    checked = check_rows(lab, runners)
    judged = {**verdicts, **{name: verdict.passed for name, verdict in checked.items()}}
    passed = {name: name in REFERENCES or judged.get(row_variant(name), False) for name in runners}
    cells: dict[str, dict[str, CellTiming]] = {}
    flops: dict[str, float] = {}
    graphs: dict[str, dict[str, str]] = {}
    shapes = [(size, length) for size in shape.batches for length in shape.sequences] + [(1, n) for n in shape.long]
    with OthersBusy() as others:  # what other work did to the host while the grid ran
        for size, length in track(shapes, "bench: latency grid", "cells", note=lambda s: Cell(*s).key):
            batch = text.batch(size, length)
            cell = Cell(size, length).key
            with ExitStack() as per_cell:
                timed: dict[str, Runner] = dict(runners)
                if device == "cuda":
                    captured, graphs[cell] = cuda_graph_runners(rows.variants, runners, batch, tuned, per_cell)
                    timed.update(captured)
                    for name, runner in captured.items():
                        described[name] = GridRunner(**runner.describe(), variant=row_variant(name))
                        passed[name] = passed[row_variant(name)]
                samples = interleaved({name: runner.timed(batch) for name, runner in timed.items()}, shape.rounds,
                                      shape.warmup, budget_s=shape.seconds_per_cell)
            cells[cell] = summarize(samples, size, length, described)
            flops[cell] = matmul_flops(dims.layers, dims.hidden, dims.intermediate, size, length)
            for stats in cells[cell].values():
                stats.gflops = flops[cell] / (stats.p50 / 1e3) / 1e9
    peaks = matmul_peaks(device, rows.threads)
    for cell_stats in cells.values():
        for name, stats in cell_stats.items():
            stats.peak_share = (stats.gflops or 0.0) / peaks[peak_precision(described[name].precision, peaks)]
    best = {cell: max((n for n in stats if passed[n] and stats[n].speedup is not None and is_variant_row(n)),
                      key=lambda n: stats[n].speedup or 0.0, default=None)
            for cell, stats in cells.items()}
    for name, verdict in checked.items():
        described[name].parity = verdict
    return LatencyGrid(threads=rows.threads, device=device, cells=cells, flops=flops, passed=passed,
                       runners=described, sessions=tuned, cuda_graph=graphs, others_busy=round(others.cores, 2),
                       disturbed=disturbances(cells, flops, others.cores),
                       best={cell: BestRow(variant=name, speedup=cells[cell][name].speedup or 0.0)
                             for cell, name in best.items() if name is not None},
                       peaks=peaks)


def check_rows(lab: ParityLab | None, runners: dict[str, Runner]) -> dict[str, Verdict]:
    """The rows no other step checked (torch.compile, PyTorch in fp16), each on `lab` with the gate for its
    precision, so they are judged like the variants."""
    from workbench.core.progress import track

    names = [name for name in CHECKED_HERE if name in runners]
    if not names:
        return {}
    if lab is None:
        raise ValueError(f"rows {names} need a parity lab to be judged")
    return {name: lab.compare(runners[name], runners[name].precision)
            for name in track(names, "bench: parity of rows only the bench step checks (torch.compile compiles "
                              "here)", "rows", note=lambda name: name)}


def needs_lab(rows: GridRows) -> bool:
    """Whether the grid has rows only it checks (`check_rows`)."""
    return rows.torch_compile or rows.device == "cuda"


def cuda_graph_runners(variants: dict[str, Variant], runners: dict[str, Runner], batch: Batch,
                       tuned: dict[str, SessionTuning], stack: ExitStack) -> tuple[dict[str, Runner], dict[str, str]]:
    """Per ONNX variant, a CUDA-graph session captured at `batch` (its own row, `<variant>@cuda_graph`), opened on
    `stack`; and, per variant, "captured" or ONNX Runtime's reason for refusing the graph."""
    from workbench.runners.onnxruntime import CudaGraphRunner, SessionSettings

    opened: dict[str, Runner] = {}
    outcome: dict[str, str] = {}
    for name, built in variants.items():
        shapes = {k: tuple(v.shape) for k, v in runners[name].infer(batch).items()}
        settings = SessionSettings.from_record(tuned[name].chosen) if name in tuned else None
        try:
            opened[f"{name}@cuda_graph"] = stack.enter_context(
                CudaGraphRunner(f"{name}@cuda_graph", built.path, batch, shapes, settings, built.precision))
            outcome[name] = "captured"
        except Exception as exc:  # noqa: BLE001 - ONNX Runtime's refusals share no narrower class
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            outcome[name] = f"not captured: {reason}"
    return opened, outcome


def device_memory(make: Callable[[], Runner], batch: Batch) -> float:
    """Peak device memory (MiB) of one runner alone on CUDA at `batch`, its weights included: PyTorch's allocator
    counter for PyTorch rows, the device's used memory (cudaMemGetInfo, what NVML reports) for the others, whose
    allocator PyTorch does not see."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    free_before, _ = torch.cuda.mem_get_info()
    allocated_before = torch.cuda.memory_allocated()
    with make() as runner:
        call = runner.timed(batch)
        call()
        call()
        torch.cuda.synchronize()
        free_after, _ = torch.cuda.mem_get_info()
        used = (torch.cuda.max_memory_allocated() - allocated_before if runner.providers[0].startswith("torch")
                else free_before - free_after)
    torch.cuda.empty_cache()
    return round(used / 2**20, 1)


def peak_precision(precision: str, peaks: dict[str, float]) -> str:
    """The peak a row's share is taken against: its own precision's where one was measured (fp32, and fp16 on
    CUDA), else fp32 (int8 counts its arithmetic as fp32-equivalent, as on the CPU)."""
    return precision if precision in peaks else "fp32"


def matmul_peaks(device: Device, threads: int) -> dict[str, float]:
    """The achievable matmul GFLOP/s per precision on the run's device, measured in the same run: fp32 on the CPU
    (`matmul_peak_gflops`); on CUDA, fp32 with TF32 off and fp16 on the tensor cores (`cuda_matmul_gflops`)."""
    if device == "cuda":
        return {"fp32": cuda_matmul_gflops("fp32"), "fp16": cuda_matmul_gflops("fp16")}
    return {"fp32": matmul_peak_gflops(threads)}


def cuda_matmul_gflops(precision: str, size: int = 8192, repeats: int = 10) -> float:
    """Best GFLOP/s of a square PyTorch matmul on the GPU in `precision`, timed with CUDA events."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32
    dtype = torch.float16 if precision == "fp16" else torch.float32
    a, b = (torch.randn(size, size, device="cuda", dtype=dtype) for _ in range(2))
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * size**3 / best / 1e9


def corpus_rates(runner: Runner, batches: dict[int, list[Batch]], passes: int = 3) -> InProcessRates:
    """What one in-process runner delivers on the served texts (`batches`: per batch size, the texts in order,
    tokenized beforehand as a client would): sequences/s of the fastest of `passes` passes per batch size, the
    best size, and at batch size 1 the median call in ms (the in-process side of served/in-process ratios)."""
    rates: dict[str, float] = {}
    p50_ms = None
    for size, sized in batches.items():
        texts = sum(len(batch.text_ids) for batch in sized)
        runner.infer(sized[0])  # warm-up
        calls: list[float] = []
        best = float("inf")
        for _ in range(passes):
            times = [elapsed(lambda batch=batch: runner.infer(batch)) for batch in sized]
            calls += times
            best = min(best, sum(times))
        rates[str(size)] = texts / best
        if size == 1:
            p50_ms = float(np.median(calls)) * 1e3
    return InProcessRates(sequences_per_s=rates, best_batch=int(max(rates, key=lambda size: rates[size])),
                          p50_ms=p50_ms)

"""The bench step: in-process latency of every runner on a batch x sequence grid, and served load sweeps against
a local Triton (batching off and on, a batching search, where tokenization runs)."""
from __future__ import annotations

import os

from workbench.core.advice import run_again
from workbench.core.config import RunConfig
from workbench.core.errors import DOCTOR_HINT
from workbench.core.record import RunRecord, StepEntry
from workbench.graphs.tables import ExportMetrics, ShapeProfile
from workbench.measure.latency import (
    Dimensions,
    GridRows,
    GridShape,
    GridText,
    corpus_rates,
    disturbance_note,
    long_lengths,
    measure_grid,
    needs_lab,
)
from workbench.measure.settings import BenchSettings
from workbench.measure.sweeps import rerank_benchmark, run_served_benchmark, serving_efficiency
from workbench.measure.tables import (
    BatchingSearch,
    BenchMetrics,
    InProcessRates,
    InstanceMemory,
    LatencyGrid,
    ServedBenchmark,
)
from workbench.models.batches import corpus_batches
from workbench.models.loading import load_model
from workbench.precision.lab import ParityLab
from workbench.report.page import Parts, Section
from workbench.report.recommend import recommend
from workbench.report.takeaways import disturbed_lines
from workbench.runners.onnxruntime import device_for
from workbench.runners.registry import open_variant
from workbench.runners.timing import others_busy, timed
from workbench.serving.errors import TritonNotFoundError
from workbench.serving.flavor import Flavor
from workbench.serving.plan import deployed_plan
from workbench.serving.repository import ServingPlan
from workbench.serving.server import find_tritonserver
from workbench.serving.settings import lab_settings
from workbench.serving.tables import TritonMetrics
from workbench.steps import StepSpec, specs
from workbench.steps.bench import figures

STEP = "bench"


def engine_profiles(record: RunRecord, name: str) -> list[ShapeProfile]:
    """The shape profiles engine `name` of the run was built with."""
    return [ShapeProfile.model_validate(p) for p in record.artifact_details(f"engine.{name}")["profiles"]]


def grid_rows(config: RunConfig, record: RunRecord) -> GridRows:
    """The grid's rows for this run: PyTorch on the run's device, its ONNX variants and TensorRT engines."""
    engines = {name: (engine, engine_profiles(record, name)) for name, engine in record.variants("engine").items()}
    record.phase(f"loading {config.model_slug} with transformers, the grid's PyTorch row")
    return GridRows(load_model(config), config.output_specs, device_for(config.device),
                    config.threads or os.cpu_count() or 1, record.variants("onnx"), engines,
                    BenchSettings.of(config).torch_compile)


def latency(config: RunConfig, record: RunRecord) -> LatencyGrid:
    """The in-process grid of the bench settings on the run's corpus, cells up to the exported sequence length, the
    variants judged by their parity verdicts (metrics.bench.latency)."""
    bench, export, rows = BenchSettings.of(config), record.needed(ExportMetrics), grid_rows(config, record)
    sequences = [s for s in bench.sequences if s <= export.max_sequence]
    shape = GridShape(list(bench.batches), sequences, bench.rounds, bench.warmup, bench.seconds_per_cell,
                      bench.tune_sessions,
                      long_lengths(sequences, export.sequence_range.max) if bench.long_texts
                      else [])
    texts = list(config.texts())
    text = GridText(record.tokenizer(), texts, tuple(export.io.inputs))
    dims = Dimensions(export.num_layers, export.hidden_size, export.intermediate_size)
    lab = ParityLab.build(lab_settings(config), rows.model, tuple(texts)) if needs_lab(rows) else None
    passed = {name: verdict.passed for name, verdict in record.verdicts().items()}
    return measure_grid(rows, shape, text, dims, passed, lab)


def served_benchmark(config: RunConfig, record: RunRecord) -> ServedBenchmark:
    """The served measurements of what the triton step deployed, or why they were not taken (nothing deployed, no
    server, or a flavor this server cannot run)."""
    deployed = deployed_plan(record.current(TritonMetrics), record)
    if deployed is None:
        return ServedBenchmark(skipped=f"nothing deployed in this run (triton: {record.step_entry('triton').label}); "
                                       f"to measure serving: {run_again(['triton', 'bench'], record.run_dir)}")
    plan, variant = deployed
    try:
        binary = find_tritonserver()
    except TritonNotFoundError as missing:
        return ServedBenchmark(skipped=str(missing))
    if plan.flavor is not Flavor.PYTHON_ORT and binary.origin == "nvidia-pytriton":
        return ServedBenchmark(skipped=f"the {plan.flavor.value} flavor needs NVIDIA's Triton container; {DOCTOR_HINT}")
    texts, tokenizer = list(config.texts()), record.tokenizer()
    if plan.reranks:
        result = rerank_benchmark(BenchSettings.of(config), plan, texts, record.run_dir / "served-bench")
        result.variant = variant
        return result
    result = run_served_benchmark(BenchSettings.of(config), plan, texts, tokenizer, record.run_dir / "served-bench")
    if plan.flavor is not Flavor.TENSORRT_PLAN:
        result.efficiency = serving_efficiency(result, in_process_rates(config, record, plan, variant, texts))
    deployment = record.current(TritonMetrics)
    result.variant, result.verified = variant, bool(deployment and deployment.verified)
    return result


def in_process_rates(config: RunConfig, record: RunRecord, plan: ServingPlan, variant: str,
                     texts: list[str]) -> InProcessRates:
    """The served variant in process on the served texts, with the cores the deployment has (its instances' threads
    together: one in-process session is the fastest way to use them for one caller), at batch size 1 and the served
    preferred sizes."""
    tokenizer = record.tokenizer()
    with open_variant(record.variant(variant), config.device, plan.threads * plan.instances) as runner:
        batches = {size: corpus_batches(tokenizer, runner.input_names, texts, size, plan.max_length)
                   for size in sorted({1, *plan.preferred_batch_sizes})}
        return corpus_rates(runner, batches)


def run(config: RunConfig, record: RunRecord) -> StepEntry:
    """Measure in process (metrics.bench.latency) and, unless bench.served is false, served (metrics.bench.served)."""
    with record.step(STEP):
        record.set_metric(f"{STEP}.host", {"cpu_count": os.cpu_count(), "busy_before": others_busy()})
        grid, seconds = timed(lambda: latency(config, record))
        grid.seconds = round(seconds, 1)
        record.set_metric(f"{STEP}.latency", grid.recorded())
        if grid.disturbed:  # the step ran, but its speeds cannot be trusted: the summary says so
            record.unverified(disturbance_note(grid.disturbed))
        measured = BenchSettings.of(config).served
        served, seconds = timed(lambda: served_benchmark(config, record) if measured else ServedBenchmark(
            skipped="bench.served is false; to measure serving: "
                    + run_again(["triton", "bench"], record.run_dir, {"bench.served": True})))
        served.seconds = round(seconds, 1)
        record.set_metric(f"{STEP}.served", served.recorded())
    return record.step_entry(STEP)


def lines(record: RunRecord) -> list[str]:
    """The verdict line: a busy host or a disturbed grid, the recommendation per goal (and where Triton serves
    another variant, which and how to switch), a served bench that was skipped."""
    bench = record.results_as(STEP, BenchMetrics)
    busy = busy_note(bench) if bench else ""
    differs = next((step.served_differs for step in specs() if step.served_differs), None)
    found = [*([f"{busy}: read the speedups below as this host's under load"] if busy else []),
             *disturbed_lines(record),
             *(r.line(record.run_dir) + (differs(record, r.variant) if differs and r.variant else "")
               for r in recommend(record))]
    if bench and bench.served and bench.served.skipped:
        found.append(f"served benchmark skipped: {bench.served.skipped}")
    if bench and bench.served and bench.served.memory:
        found.append(memory_line(bench.served.memory))
    return found


def memory_line(memory: list[InstanceMemory]) -> str:
    """What each served instance holds, beside its weights."""
    return "served memory (PSS after the load): " + ", ".join(
        f"{m.instance} {m.pss_mib:.0f} MiB for {m.weights_mib:.0f} MiB of weights" for m in memory)


def disturbed_warning(bench: BenchMetrics) -> str:
    """The warning the report opens with when the in-process grid's own medians show other work distorted it."""
    disturbed = bench.disturbed()
    if not disturbed:
        return ""
    more = f" (and {len(disturbed) - 1} more)" if disturbed[1:] else ""
    return (f"DISTURBED TIMINGS: {disturbed[0]}{more}. Other work on the host distorted the in-process grid, ratios "
            "included: do not compare or deploy by the speedups below; re-run the bench step on a quiet host.")


def busy_note(bench: BenchMetrics) -> str:
    """"the host was busy when measuring began (...)" where other work kept more than half its cores busy then
    (older runs recorded only the load average, which counts the run's own steps), else "". A grid that other work
    disturbed has its own, stronger warning (`disturbed_warning`), which stands alone."""
    host = bench.host
    if not host or not host.cpu_count or bench.disturbed():
        return ""
    busy, measure = ((host.busy_before, "other work kept {:.1f} of {} cores busy") if host.busy_before is not None
                     else (host.load_before or 0.0, "load average {:.1f} on {} cores"))
    if busy <= host.cpu_count / 2:
        return ""
    return f"the host was busy when measuring began ({measure.format(busy, host.cpu_count)})"


def headline(bench: BenchMetrics) -> list[str]:
    """A warning when other work loaded the host, then what batching and serving delivered (the speedups are in
    the recommendation)."""
    busy = busy_note(bench)
    lines = [f"{busy[0].upper()}{busy[1:]}: absolute times do not hold; ratios hold only where the other work slowed "
             "every runner alike."] if busy else []
    served = bench.served or ServedBenchmark()
    if served.batching_on and served.batching_off:
        top = str(max(served.levels))
        on, off = served.batching_on.text[top], served.batching_off.text[top]
        lines.append(f"Dynamic batching at concurrency {top}: {on.throughput:.1f} vs {off.throughput:.1f} "
                     f"req/s ({on.throughput / off.throughput:.2f}x).")
    efficiency = served.efficiency
    if efficiency:
        lines.append(f"Serving efficiency at concurrency {efficiency.concurrency}: "
                     f"{efficiency.throughput_ratio['batching_on']:.2f} of in-process throughput (batching on)"
                     + (f"; p50 at concurrency 1 {efficiency.p50_ratio_c1:.2f}x in process."
                        if efficiency.p50_ratio_c1 is not None else "."))
    return lines


def latency_section(bench: BenchMetrics) -> Parts:
    latency = bench.latency
    if not latency:
        return []
    warning = f"{disturbed_warning(bench)} " if latency.disturbed else ""
    charts = [figures.latency_figure(latency), figures.speedup_figure(latency)]
    if latency.runners:
        charts.append(figures.runners_table(latency))
    if latency.sessions:
        charts.append(figures.sessions_table(latency))
    return [("In-process latency", warning + latency_text(latency), charts)]


def latency_text(latency: LatencyGrid) -> str:
    """How the grid was measured, on the device it ran on."""
    if latency.device == "cpu":
        threads = f"{latency.threads} thread{'s' * (latency.threads != 1)}"
        return (f"Interleaved rounds, {threads} for PyTorch (ONNX Runtime: the settings in the "
                "table below), median per call; speedup over PyTorch eager fp32 on the CPU. fp32 matmul peak "
                "measured in the same run (the faster of PyTorch and ONNX Runtime): "
                f"{latency.peaks['fp32']:.0f} GFLOP/s.")
    peaks = latency.peaks
    graphs = "; ".join(f"{cell}: " + ", ".join(f"{v} {o}" for v, o in outcome.items())
                       for cell, outcome in latency.cuda_graph.items())
    return ("Interleaved rounds on CUDA, median per call; every call ends when the GPU is done with it. End to end: "
            "numpy arrays in and out (what a server pays); on device: inputs copied to the GPU once per batch, "
            "outputs left there. Speedup over PyTorch eager fp32 on the same device with the same I/O (TF32 off). "
            f"Matmul peaks measured in the same run: fp32 {peaks['fp32']:.0f} GFLOP/s, fp16 (tensor cores) "
            f"{peaks['fp16']:.0f} GFLOP/s; each row's share is against its own precision's. CUDA graphs: "
            f"{graphs or 'none measured'}.")


def served_section(bench: BenchMetrics) -> Parts:
    served = bench.served or ServedBenchmark()
    if served.skipped:
        return [("Served throughput and latency", f"Not measured: {served.skipped}.", [])]
    if served.rerank:
        return [("Served throughput and latency", f"Load tool: {served.tool} over {served.protocol}; "
                 f"measured: {served.variant}.", [figures.rerank_table(served.rerank)])]
    if not served.batching_on:
        return []
    measured = f"{served.variant} in the " if served.variant else ""
    parts: Parts = [("Served throughput and latency", f"Load tool: {served.tool} over {served.protocol}; one text "
                     f"per request; measured: {measured}{served.variant_plan.layout} layout.",
                     [figures.throughput_figure(served), figures.breakdown_figure(served.batching_on)])]
    if served.memory:
        parts.append(("Served memory", f"{memory_line(served.memory)}. PSS counts an instance's own memory and its "
                      "share of what it maps with the others; the rest beyond the weights is the runtime, its "
                      "arenas and the Python backend's interpreter.", []))
    if served.efficiency:
        parts.append(("Serving efficiency", "What the server delivers of what the same variant does in process on "
                      "the same texts with the same threads (targets: throughput >= 0.8, p50 <= 1.5x).",
                      [figures.efficiency_table(served.efficiency)]))
    if served.layouts:
        parts.append(("Repository layouts", "The same variant served as an ensemble and as one fused Python model, "
                      "batching on.", [figures.layouts_figure(served.layouts)]))
    if served.search:
        parts.append(("Dynamic batching search", _search_text(served.search), [figures.search_figure(served.search)]))
    return parts + [
        ("Where tokenization runs", "Text in, tokenized in Triton, against token ids sent straight to the ensemble's "
         "network model (tokenized in the client), same concurrencies.",
         [figures.tokenization_figure(served.batching_on)])]


def _search_text(search: BatchingSearch) -> str:
    chosen = search.chosen
    if not chosen:
        return f"No configuration kept p99 under {search.p99_limit_ms} ms at concurrency {search.concurrency}."
    return (f"Best throughput with p99 under {search.p99_limit_ms} ms at concurrency {search.concurrency}: "
            f"max_queue_delay {chosen.max_queue_delay_us} us, {chosen.instances} instance(s): "
            f"{chosen.throughput:.1f} req/s, p99 {chosen.p99:.1f} ms.")


SPEC = StepSpec(
    STEP, 7, "in-process latency grid and served load sweeps, batching search, tokenization placement", run,
    lines, sections=(Section("In-process latency", latency_section),
                           Section("Served throughput and latency", served_section, served=True)),
    needs=("model", "ports"), reads=("optimize",), machine=("torch", "onnxruntime"), owns=("served-bench", "bench"),
    metrics=BenchMetrics, after="generation", settings=BenchSettings, headline=headline, warning=disturbed_warning,
    lighter="a lower batch.max_tokens or sequence.max, one instance in the batching search "
            "(-p bench.search_instances=[1])")

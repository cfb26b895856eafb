"""The bench step (in-process and served against a real Triton) and the self-contained report, on a tiny model."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.core.advice import IN_LAB, command, set_settings
from workbench.core.config import RunConfig
from workbench.core.record import RunRecord
from workbench.core.results import Verdict
from workbench.graphs.tables import GraphStats
from workbench.measure.latency import matmul_flops, summarize
from workbench.measure.load import breakdown, stage_totals
from workbench.measure.perf_analyzer import find_perf_analyzer
from workbench.measure.sweeps import TextLoad, measure_text_loads, pick
from workbench.measure.tables import BatchingSweeps, BenchMetrics, GridRunner, LatencyGrid, SearchCandidate, ServedLevel
from workbench.models.batches import Cell
from workbench.precision.tables import ParityMetrics
from workbench.report import figures
from workbench.report.page import again_both_ways
from workbench.report.recommend import recommend
from workbench.runners.timing import interleaved
from workbench.steps import bench, export, optimize, parity, report, spec, tensorrt, triton
from workbench.steps.bench import figures as bench_figures
from workbench.steps.triton import serving_plan

from .conftest import export_metrics

BENCH = {"rounds": 4, "warmup": 1, "batches": [1, 2], "sequences": [8, 16], "concurrency": [1, 4],
         "requests_per_level": 24, "seconds_per_level": 10, "search_queue_delays_us": [0, 4000],
         "search_instances": [1]}


@pytest.fixture(scope="module")
def reported(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    config = RunConfig.model_validate({
        "model": str(tiny_models["bert"]), "precisions": ["fp32", "int8"], "threads": 1, "bench": BENCH,
        "batch": {"min": 1, "opt": 4, "max": 8}, "sequence": {"min": 1, "opt": 32, "max": 64},
        "triton": {"repository_dir": str(root / "repos")}})
    record = RunRecord.create(root / "run", config)
    for step in (export, optimize, parity, tensorrt, triton, bench, report):  # bench serves what triton deployed
        step.run(config, record)
    return config, record


@pytest.mark.slow
def test_latency_grid_covers_every_runner_and_cell(reported):
    from workbench.measure.latency import disturbances
    from workbench.measure.sessions import candidates
    from workbench.runners.onnxruntime import SessionSettings

    _, record = reported
    latency = record.metric("bench.latency")
    assert set(latency["cells"]) == {"b1_s8", "b1_s16", "b2_s8", "b2_s16", "b1_s64"}, "and one text at the max"
    for cell, stats in latency["cells"].items():
        assert {"pytorch", "original", "fp32", "int8"} <= set(stats)
        assert stats["pytorch"]["speedup"] == 1.0
        for runner in stats.values():
            assert 0 < runner["p50"] <= runner["p90"] <= runner["p99"]
            assert runner["rounds"] >= 3 and runner["gflops"] > 0
            rows, length = (int(x) for x in re.findall(r"\d+", cell))
            assert runner["tokens_per_s"] == pytest.approx(runner["sequences_per_s"] * length)
    assert latency["peaks"]["fp32"] > 0  # measured; how fast is for benchmarks/, not a test
    assert latency["passed"]["pytorch"] and latency["passed"]["fp32"]
    grid = LatencyGrid.model_validate(latency)
    assert grid.others_busy is not None and grid.disturbed == disturbances(grid.cells, grid.flops, grid.others_busy)
    # Session settings screened per ONNX variant, the fastest re-measured head to head; the chosen one never spins
    assert set(latency["sessions"]) == set(record.variants("onnx"))
    for tuned in latency["sessions"].values():
        assert len(tuned["screen"]) == len(candidates(latency["threads"]))
        assert all(c["p50_ms"] > 0 for c in tuned["screen"]) and tuned["spinning_gain"] > 0
        assert tuned["chosen"]["spinning"] is False and tuned["head_to_head"][0] == {
            **SessionSettings(latency["threads"]).record(), **{k: tuned["head_to_head"][0][k] for k in
                                                              ("small_ms", "large_ms")}}
        assert tuned["chosen"] in [{k: v for k, v in h.items() if not k.endswith("_ms")}
                                   for h in tuned["head_to_head"]]


@pytest.mark.slow
def test_served_sweeps_search_and_tokenization(reported):
    config, record = reported
    served = record.metric("bench.served")
    assert served["tool"] == ("perf_analyzer" if find_perf_analyzer() else "asyncio")
    for label in ("batching_off", "batching_on"):
        for level in served[label]["text"].values():
            assert level["errors"] == 0 and level["throughput"] > 0 and level["p50"] <= level["p99"]
            (model,) = level["server"]  # the fused layout: one model does all the work
            assert level["server"][model]["requests"] >= level["requests"] or served["tool"] == "perf_analyzer"
            assert level["server"][model]["compute_infer"] > 0
    assert set(served["batching_on"]["client_tokenization"]) == {"1", "4"}
    assert served["protocol"] == "grpc" and served["variant_plan"]["layout"] == "fused"
    layouts = served["layouts"]
    assert set(layouts) == {"fused", "ensemble"} and layouts["fused"] == served["batching_on"]["text"]
    assert all(level["errors"] == 0 for level in served["layouts"]["ensemble"].values())
    assert set(served["batching_on"]["text_http"]) == {"1", "4"}, "the deployment over HTTP too"
    assert set(served["batching_on"]["text_asyncio"]) == {"1", "4"}, "tokenization compared on the ensemble"
    efficiency = served["efficiency"]
    rates = efficiency["in_process"]
    assert set(rates["sequences_per_s"]) == {"1", "4", "8"} and rates["p50_ms"] > 0
    best = rates["sequences_per_s"][str(rates["best_batch"])]
    assert best == max(rates["sequences_per_s"].values())
    for label, ratio in efficiency["throughput_ratio"].items():
        assert ratio == pytest.approx(served[label]["text"]["4"]["throughput"] / best)
    assert efficiency["p50_ratio_c1"] == pytest.approx(served["batching_on"]["text"]["1"]["p50"] / rates["p50_ms"])
    search = served["search"]
    assert [c["max_queue_delay_us"] for c in search["candidates"]] == [0, 4000]
    assert search["chosen"] == max(search["candidates"], key=lambda c: c["throughput"])


@pytest.mark.slow
def test_text_loads_run_on_each_batching_setting(reported, tmp_path):
    """What benchmarks/bench.py measures: chosen loads on a server with dynamic batching off, then on."""
    config, record = reported
    plan, _ = serving_plan(config, record)
    loads = [TextLoad("one", ["a short text"], 1, 8, batching=(True,)), TextLoad("four", ["a text", "another"], 4, 16)]
    measured = measure_text_loads(plan, loads, tmp_path, None, seconds=10)
    assert {label: list(levels) for label, levels in measured.items()} == {"batching_off": ["four"],
                                                                          "batching_on": ["one", "four"]}
    for level in (*measured["batching_off"].values(), *measured["batching_on"].values()):
        assert level.errors == 0 and level.requests >= 8 and 0 < level.p50 <= level.p99
    assert (tmp_path / "batching_on" / "server" / "tritonserver.log").is_file()


@pytest.mark.slow
def test_report_is_self_contained(reported):
    config, record = reported
    html = record.artifact("report").read_text()
    assert html.count("<script") > 3 and "Plotly.newPlot" in html
    assert not re.search(r'<script[^>]+src="https?://', html), "no script fetched from the network"
    settings = html.split("Settings apart from the defaults:")[1].split("</p>")[0]
    assert "sequence.max 64" in settings and "precisions [&#39;fp32&#39;, &#39;int8&#39;]" in settings
    for title in ("Parity against PyTorch", "In-process latency", "Served throughput", "Dynamic batching search",
                  "Where tokenization runs", "ONNX Runtime fusions", "Serving efficiency", "Repository layouts"):
        assert title in html, title
    assert ("int8 precision repair" in html) == bool(record.metric("parity.repair"))
    assert "ONNX Runtime session settings, measured at the smallest cell" in html
    sessions = record.metric("bench.latency.sessions")
    grid = LatencyGrid.model_validate(record.metric("bench.latency"))
    reasons = [tuned["reason"] for tuned in sessions.values()]
    assert list(bench_figures.sessions_table(grid).data[0].cells.values[2]) == reasons
    assert "<td>report</td>" not in html, "the report leaves its own running step out of the summary"
    calling = html.split("Calling the deployment</h2>")[1].split("</pre>")[0]
    name = record.metric("triton.name")
    assert f"workbench serve --repository {record.metric('triton.repository')}" in calling
    assert "curl -s http://127.0.0.1:8080/v1/embeddings" in calling and f"model=&quot;{name}&quot;" in calling
    # Rendering again measures nothing: the bench step's numbers stay as they were, and stay current.
    before = record.step_entry("bench")
    again = report.run(config, record)
    assert again.status == "ok" and record.step_entry("bench") == before and before.status == "ok"
    assert record.artifact("report").read_text().count("Plotly.newPlot") == html.count("Plotly.newPlot")
    if record.status("tensorrt") == "skipped":  # no GPU: the profiles designed on the CPU are shown all the same
        assert "TensorRT shape profiles" in html and "Skipped: building TensorRT engines needs" in html
    # An earlier step runs again: the sections built on what it replaced say so, and name the step to run.
    optimize.run(config, record)
    report.run(config, record)
    stale = record.artifact("report").read_text()
    # parity, served parity, latency, served; a bench whose timings were disturbed says that instead of its inputs
    assert stale.count("STALE: ") >= 3 and stale.count("STALE: inputs changed since it ran") >= 2
    assert f"run <code>{command()} run --resume --output-dir {record.run_dir} --steps bench</code> (in JupyterLab: " \
        "07_bench.ipynb) to refresh them" in stale, "the command and the notebook: the same step either way"


def test_a_report_built_in_jupyterlab_names_the_notebook_first_and_the_command_second(tmp_path, monkeypatch):
    record = RunRecord.create(tmp_path, RunConfig())
    monkeypatch.setenv(IN_LAB, "1")
    assert again_both_ways(record, "triton,bench", {"triton.variant": "int8"}) == (
        'run 05_triton.ipynb with config = {"triton.variant": "int8"} in its parameters cell, then 07_bench.ipynb '
        f"(from a terminal: `{command()} run --resume --output-dir {tmp_path} --steps triton,bench "
        "-p triton.variant=int8`)")
    monkeypatch.delenv(IN_LAB)
    assert again_both_ways(record, "bench").startswith(f"run `{command()} run --resume")
    # a setting the parameters cell names is set by its own parameter there; any other by a `config` line of Python
    assert set_settings({"sequence.max": "auto"}, lab=True) == \
        'sequence_max = "auto" in the parameters cell of 01_export.ipynb'
    assert set_settings({"bench.served": True}, lab=True) == \
        'config = {"bench.served": True} in the parameters cell of 07_bench.ipynb'


def test_a_report_of_a_partial_run_names_the_steps_that_fill_each_section(tmp_path):
    config = RunConfig()
    record = RunRecord.create(tmp_path, config)
    with record.step("export"):
        record.set_metric("export", export_metrics())
    with record.step("parity"):
        pass  # ok, but wrote no metric
    with pytest.raises(RuntimeError), record.step("optimize"):
        raise RuntimeError("the disk is full")
    with record.step("triton"):
        record.set_metric("triton", {"variant": "fp32"})
    record.data["metrics"]["triton"]["served_parity"] = {"http": {}}  # damaged: a protocol without its verdict
    result = report.run(config, record)
    html = record.artifact("report").read_text()
    assert result.status == "ok" and "Plotly.newPlot" not in html
    assert "The optimize step failed (RuntimeError: the disk is full)" in html
    for step in ("tensorrt", "generation", "bench"):
        assert f"the {step} step did not run; run <code>{command()} run --resume --output-dir {tmp_path} " \
               f"--steps {step}</code> (in JupyterLab: {spec(step).notebook}) to fill it" in html, step
    assert "The parity step ran but recorded nothing" in html
    assert "Served parity</h2>\n<p>Could not be drawn from the recorded metrics (ValidationError" in html
    assert html.count(f"nothing was benchmarked in process in this run (bench: not run); run <code>{command()} run "
                      f"--resume --output-dir {tmp_path} --steps parity,bench</code>") == 2  # latency and throughput
    assert "Served: unknown, the triton step&#39;s record is unreadable (ValidationError: 1 validation error for " \
           "TritonMetrics); run" in html


def test_interleaving_rotates_and_respects_the_budget():
    order = []
    calls = {name: (lambda n=name: order.append(n)) for name in "abc"}
    samples = interleaved(calls, rounds=3, warmup=0)
    assert order == list("abcbcacab") and all(len(v) == 3 for v in samples.values())
    rows = {name: GridRunner(label=name, reference=name == "pytorch") for name in ("pytorch", "x")}
    stats = summarize({"pytorch": [0.02, 0.02], "x": [0.01, 0.01]}, rows=2, length=8, described=rows)
    assert stats["x"].speedup == pytest.approx(2.0) and stats["x"].tokens_per_s == pytest.approx(1600)


def test_matmul_flops_match_minilm_counts():
    # all-MiniLM-L6-v2: 6 layers, hidden 384, intermediate 1536 (published counts, in GFLOP)
    assert matmul_flops(6, 384, 1536, 1, 16) / 1e9 == pytest.approx(0.342, abs=1e-3)
    assert matmul_flops(6, 384, 1536, 8, 128) / 1e9 == pytest.approx(22.951, abs=1e-3)


def test_stage_breakdown_and_pick():
    before = stage_totals({"inference_stats": {"success": {"count": 10}, "queue": {"ns": 1_000_000},
                                               "compute_infer": {"ns": 5_000_000}}})
    after = stage_totals({"inference_stats": {"success": {"count": "14"}, "queue": {"ns": "3000000"},
                                              "compute_infer": {"ns": "13000000"}}})
    assert breakdown(before, after) == {"queue": 0.5, "compute_input": 0.0, "compute_infer": 2.0,
                                        "compute_output": 0.0, "requests": 4}
    candidates = [SearchCandidate(concurrency=8, requests=100, seconds=1.0, throughput=throughput, p50=p99 / 2,
                                  p90=p99, p95=p99, p99=p99, mean=p99 / 2, max_queue_delay_us=delay, instances=1)
                  for delay, throughput, p99 in ((0, 50, 90), (100, 80, 120), (4000, 60, 99))]
    assert pick(candidates, 100) == candidates[2], "the highest throughput with p99 under the limit"
    assert pick(candidates, 10) is None


def test_tables_leave_room_for_every_row():
    outputs = {"sentence_embedding": {"kind": "embedding", "passed": False, "max_abs": 0.2, "mean_abs": 0.01,
                                      "min_cosine": 0.95, "failures": ["min cosine 0.950000 < 0.99"]}}
    results = {f"variant_{i}": Verdict(passed=False, precision="int8", outputs=outputs) for i in range(2)}
    figure = figures.parity_table(results)
    table = figure.data[0]
    margin = figure.layout.margin
    drawable = figure.layout.height - margin.t - margin.b
    assert drawable >= table.header.height + len(results) * table.cells.height
    assert list(table.cells.values[0]) == ["variant_0", "variant_1"]
    assert table.columnwidth[-1] > table.columnwidth[3]  # the long "why" column gets the room, not the verdict
    assert list(table.header.values) == ["variant", "precision", "output", "verdict", "max abs", "mean abs",
                                         "min cosine", "why"], "an embedding has no label agreement, nor neighbours"


def _verdict(precision: str, min_cosine: float, threshold: float = 0.99) -> dict:
    """A parity verdict as the parity step records it, for one embedding output."""
    passed = min_cosine >= threshold
    failures = [] if passed else [f"min cosine {min_cosine:.6f} < {threshold}"]
    output = {"kind": "embedding", "passed": passed, "failures": failures, "max_abs": 0.05, "mean_abs": 0.01,
              "min_cosine": min_cosine, "tolerance": {"min_cosine": threshold},
              "quantiles": {"p50": 0.01, "p90": 0.02, "p99": 0.04, "p99.9": 0.045}}
    return {"passed": passed, "precision": precision, "failures": [f"sentence_embedding: {f}" for f in failures],
            "outputs": {"sentence_embedding": output}}


def _cell(p50: dict[str, float]) -> dict:
    """One latency cell: medians in ms per runner, speedup over PyTorch as the bench step computes it."""
    return {name: {"p50": ms, "p90": ms * 1.1, "speedup": p50["pytorch"] / ms} for name, ms in p50.items()}


PASSING = {"fp32": 0.99999, "int8": 0.9556, "int8_repaired": 0.9903}  # min cosine; int8 fails


def _benched(run_dir, cosines: dict[str, float]) -> tuple[RunConfig, RunRecord]:
    """A record with parity verdicts (fp32 against 0.9999, int8 against 0.99) and a latency grid where int8 is the
    fastest everywhere and the repaired int8 beats fp32 at batch 1 only."""
    config = RunConfig()
    record = RunRecord.create(run_dir, config)
    with record.step("parity"):
        for name, cosine in cosines.items():
            precision = name.split("_")[0]
            record.set_metric(f"parity.variants.{name}",
                              _verdict(precision, cosine, 0.9999 if precision == "fp32" else 0.99))
    cells = {"b1_s16": _cell({"pytorch": 10.0, "fp32": 5.0, "int8": 2.0, "int8_repaired": 4.0}),
             "b1_s128": _cell({"pytorch": 40.0, "fp32": 10.0, "int8": 5.0, "int8_repaired": 8.0}),
             "b8_s16": _cell({"pytorch": 50.0, "fp32": 20.0, "int8": 10.0, "int8_repaired": 25.0}),
             "b8_s128": _cell({"pytorch": 400.0, "fp32": 100.0, "int8": 50.0, "int8_repaired": 125.0})}
    with record.step("bench"):
        passed = {name: v.passed for name, v in record.verdicts().items()}  # what the bench step reads
        record.set_metric("bench.latency", {"threads": 2, "peaks": {"fp32": 50.0}, "cells": cells,
                                            "passed": {"pytorch": True, **passed}})
    return config, record


@pytest.fixture
def benched(tmp_path):
    return _benched(tmp_path, PASSING)


def test_the_recommendation_is_the_fastest_variant_that_passes_parity(benched):
    _, record = benched
    latency, throughput = recommend(record)
    assert (latency.goal, latency.cell, latency.variant) == ("latency", Cell(1, 16), "int8_repaired")
    assert latency.speedup == pytest.approx(2.5) and latency.gate_metric == "min cosine"
    assert latency.margin == pytest.approx(0.0003)
    assert "faster but failing parity: int8 (5x, sentence_embedding: min cosine 0.955600 < 0.99)" in latency.reason
    assert latency.line(Path("run")) == ("latency: int8_repaired, 2.5x faster than PyTorch at b1 s16, min cosine "
                                         "0.9903 vs 0.99 (margin +0.0003)")
    # the largest batch at its longest sequence: fp32 beats the repaired int8 there
    assert (throughput.goal, throughput.cell, throughput.variant) == ("throughput", Cell(8, 128), "fp32")
    assert throughput.speedup == pytest.approx(4.0) and throughput.margin == pytest.approx(0.00009)
    assert throughput.steps == () and latency.steps == ()


def test_a_variant_that_failed_served_parity_is_not_recommended(benched):
    """The triton step passed int8_repaired over (it failed parity served): a deployment would answer as the
    server did, so the recommendation counts it as failing."""
    _, record = benched
    failure = "served over http, grpc: sentence_embedding: min cosine 0.989409 < 0.99"
    with record.step("triton"):
        verification = {"variant": "fp32", "by": "parity step", "passed_over": {"int8_repaired": [failure]}}
        record.set_metric("triton", {"name": "m", "flavor": "python-ort", "variant": "fp32", "verified": True,
                                     "verification": verification})
    latency, _ = recommend(record)
    assert latency.variant == "fp32"
    assert f"int8_repaired (2.5x, {failure})" in latency.reason


def test_no_recommendation_without_a_variant_that_passes(tmp_path):
    _, record = _benched(tmp_path, {"fp32": 0.99, "int8": 0.95, "int8_repaired": 0.985})
    for choice in recommend(record):
        assert choice.variant is None and choice.speedup is None and choice.margin is None
        assert choice.steps == ("parity", "bench")
        assert choice.reason.startswith(f"no variant measured at {choice.cell.label} passes parity")
        assert "int8_repaired: sentence_embedding: min cosine 0.985000 < 0.99" in choice.reason
        assert choice.line(tmp_path).endswith(
            f"; {command()} run --resume --output-dir {tmp_path} --steps parity,bench")


def test_a_stale_bench_recommends_nothing(benched):
    _, record = benched
    with record.step("parity"):  # parity again: the bench's numbers may no longer describe what passes
        record.set_metric("parity.variants.fp32", _verdict("fp32", 0.99999, 0.9999))
    for choice in recommend(record):
        assert choice.variant is None and choice.steps == ("bench",)
        assert choice.reason.startswith("nothing was benchmarked in process in this run (bench: stale: inputs "
                                        "changed since it ran")


def test_the_report_opens_with_the_recommendation_and_names_the_served_variant(benched):
    config, record = benched
    with record.step("triton"):
        record.set_metric("triton", {"variant": "int8_repaired", "layout": "fused", "verified": True,
                                     "served_parity": {}})
    report.run(config, record)
    html = record.artifact("report").read_text()
    block = html.index('<h2 id="recommendation">')
    assert block < html.index("<h2>Summary</h2>") < html.index("Plotly.newPlot")
    table = html[block:html.index("</table>", block)]
    assert "<b>int8_repaired</b></td><td>2.5x</td>" in table and "margin +0.0003) on sentence_embedding" in table
    assert "<b>fp32</b></td><td>4x</td>" in table
    assert html.count("Served: int8_repaired via the fused layout.") == 2  # the block and the served parity section
    throughput = next(line for line in bench.lines(record) if line.startswith("throughput: fp32"))
    assert ". Triton serves int8_repaired (the triton step's order, chosen before bench measured); to serve fp32:" \
        in throughput, "the terminal's summary says so too"


def test_the_speedup_heatmap_is_centred_on_1x(benched):
    _, record = benched
    latency = LatencyGrid.model_validate(record.metric("bench.latency"))
    heatmap = bench_figures.speedup_figure(latency).data[0]
    assert heatmap.zmid == 0 and heatmap.zmin == -heatmap.zmax  # log2 of the ratio: 1x sits in the middle
    assert heatmap.colorbar.title.text == "speedup over PyTorch (x)"
    row = list(heatmap.y).index("int8_repaired")
    assert heatmap.z[row][0] == pytest.approx(1.3219, abs=1e-4) and heatmap.text[row][0] == "2.50x"
    assert dict(zip(heatmap.colorbar.tickvals, heatmap.colorbar.ticktext))[0] == "1x"
    assert heatmap.z[list(heatmap.y).index("pytorch")][0] == 0
    low, high = ([int(c) for c in re.findall(r"\d+", colour)] for _, colour in (heatmap.colorscale[0],
                                                                              heatmap.colorscale[-1]))
    assert low[0] > low[2] and high[2] > high[0], "slower than PyTorch reads red, faster blue"


def test_a_log_concurrency_axis_ticks_only_the_levels_measured():
    def level(concurrency: int) -> ServedLevel:
        return ServedLevel(concurrency=concurrency, requests=8, seconds=1.0, throughput=8.0 * concurrency, p50=1.0,
                           p90=1.0, p95=1.0, p99=1.0, mean=1.0)

    sweep = {str(c): level(c) for c in (1, 4, 16)}
    axis = bench_figures.layouts_figure({"ensemble": sweep, "fused": sweep}).layout.xaxis
    assert axis.type == "log" and list(axis.tickvals) == [1, 4, 16]
    served = bench_figures.tokenization_figure(BatchingSweeps(text=sweep, client_tokenization={"2": level(2)}))
    assert list(served.layout.xaxis.tickvals) == [1, 2, 4, 16]


def test_figures_name_their_units(benched):
    _, record = benched
    from workbench.steps.optimize.figures import fusion_figure
    from workbench.steps.parity.figures import error_distribution

    latency = LatencyGrid.model_validate(record.metric("bench.latency"))
    axes = {
        "latency": bench_figures.latency_figure(latency).layout.yaxis,
        "errors": error_distribution(record.results_as("parity", ParityMetrics).variants).layout.yaxis,
        "fusions": fusion_figure({"fp32": GraphStats(nodes=120, fused={"Attention": 6})}).layout.yaxis,
    }
    assert {name: axis.title.text for name, axis in axes.items()} == {
        "latency": "latency per call (ms)", "errors": "absolute error |variant - PyTorch| (output units)",
        "fusions": "fused nodes (count)"}


def test_int8_that_is_not_meaningfully_faster_gives_way_to_fp32():
    """A host where int8 gains nothing (the speed table an AVX2-only CPU measured: b8 s128 fp32 377 ms, int8
    380 ms): fp32 is recommended, and the reason names the instructions that would make int8 pay."""
    from workbench.report.recommend import Candidate, pick

    pytorch_ms = 640.0
    table = {"fp32": (377.0, "fp32"), "int8": (380.0, "int8"), "int8_repaired": (360.0, "int8")}
    measured = [Candidate(name, pytorch_ms / ms, True, None, (), precision) for name, (ms, precision) in table.items()]
    choice = pick("throughput", Cell(8, 128), measured, int8_dot_product=None)
    assert choice.variant == "fp32" and choice.speedup == pytest.approx(pytorch_ms / 377.0)
    assert "int8_repaired is only 1.05x fp32 here" in choice.reason
    assert "no int8 dot-product instructions: AVX-512 VNNI, AVX-VNNI or AMX make int8 pay" in choice.reason
    faster = [Candidate("fp32", 2.0, True, None, (), "fp32"), Candidate("int8", 5.0, True, None, (), "int8")]
    assert pick("latency", Cell(1, 16), faster, int8_dot_product="AVX-512 VNNI").variant == "int8"  # where int8 pays
    decided = "pays on this host: 1.30x fp32 at b8 s128 (needs 1.2x at one goal cell)"
    choice = pick("throughput", Cell(8, 128), measured, int8_dot_product=None, int8_decision=decided)
    assert choice.variant == "fp32", "in the bench's own cell int8 gains too little: the bench's numbers decide here"
    assert choice.reason.endswith(f"; the optimize step measured that plain int8 {decided}"), "not the flags"


def test_busy_cores_count_another_process():
    from workbench.runners.timing import others_busy

    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert others_busy(2.0) > 0.3  # a spinning process gets a good share of a core even beside a busy loop
    finally:
        child.kill()
        child.wait()


def test_cpu_features_name_the_int8_instructions():
    from workbench.core.machine import cpu_features

    assert cpu_features({"avx2", "fma", "sse4_2"}).recorded() == {"flags": ["avx2", "fma"], "int8_dot_product": None}
    assert cpu_features({"avx2", "avx512f", "avx512_vnni", "amx_int8", "amx_tile"}).int8_dot_product == "AMX"
    assert cpu_features({"avx2", "avx_vnni"}).int8_dot_product == "AVX-VNNI"


def test_the_recommendation_shows_how_many_neighbours_it_keeps():
    from workbench.report.recommend import candidates, pick

    verdict = _verdict("int8", 0.9903)
    verdict["outputs"]["sentence_embedding"]["retrieval"] = {"texts": 320, "agreement_at_1": 0.95,
                                                             "recall_at_10": 0.97, "spearman": 0.998}
    cell = _cell({"pytorch": 10.0, "int8_repaired": 4.0})
    timed = LatencyGrid(cells={"b1_s16": cell}).cells["b1_s16"]
    choice = pick("latency", Cell(1, 16), candidates(timed, {"int8_repaired": Verdict.model_validate(verdict)}), "AMX")
    assert choice.line(Path("run")).endswith("(margin +0.0003), recall@10 0.970 of PyTorch's neighbours")


def test_a_lower_precision_within_noise_of_a_more_precise_one_gives_way():
    """The trial's b8 s128 medians on a busy host: fp16 99.3 ms, int8_repaired 102.5 ms, fp32 110.4 ms."""
    from workbench.report.recommend import Candidate, pick

    table = {"fp16": (99.3, "fp16"), "int8_repaired": (102.5, "int8"), "fp32": (110.4, "fp32")}
    measured = [Candidate(name, 459.0 / ms, True, None, (), precision) for name, (ms, precision) in table.items()]
    choice = pick("throughput", Cell(8, 128), measured, int8_dot_product="AVX-512 VNNI")
    assert choice.variant == "fp32"
    assert choice.reason.startswith("fp16 is only 1.11x fp32 here (under 1.2x)")


def test_a_neighbour_gate_is_the_gate_it_is_judged_by():
    from workbench.report.recommend import gate

    verdict = _verdict("int8", 0.99998, threshold=0.99)
    output = verdict["outputs"]["sentence_embedding"]
    output["tolerance"]["min_recall_at_10"] = 0.999
    output["retrieval"] = {"texts": 320, "agreement_at_1": 0.97, "recall_at_10": 0.9859, "spearman": 0.99999}
    judged = gate(Verdict.model_validate(verdict))
    assert (judged.metric, judged.value, judged.threshold) == ("recall@10", 0.9859, 0.999)
    assert str(judged) == "recall@10 0.98590 vs 0.999 (margin -0.01310)"
    output["tolerance"] = {"min_cosine": 0.99999998}
    assert str(gate(Verdict.model_validate(verdict))) == "min cosine 0.9999800000 vs 0.99999998 (margin -0.0000199800)"


def test_medians_that_fall_with_more_work_mark_the_grid_disturbed(tmp_path):
    from workbench.measure.latency import disturbances
    from workbench.steps import verdict_line
    from workbench.steps.bench import disturbed_warning

    flops = {"b1_s16": 1.0, "b1_s128": 8.0, "b8_s16": 8.5, "b8_s128": 70.0}
    quiet = {"b1_s16": _cell({"pytorch": 7.8, "int8_repaired": 2.2}), "b1_s128": _cell({"pytorch": 22.5,
             "int8_repaired": 7.4}), "b8_s16": _cell({"pytorch": 30.0, "int8_repaired": 9.0}),
             "b8_s128": _cell({"pytorch": 145.7, "int8_repaired": 49.7})}
    assert disturbances(LatencyGrid(cells=quiet).cells, flops) == []
    # the demo beside two other jobs: PyTorch slowed alike in every cell (183 ms at b1 s16), which only the load
    # measured while the grid ran shows; what "busy" means follows this host's core count, so it is given in cores
    cores = os.cpu_count() or 1
    assert disturbances(LatencyGrid(cells=quiet).cells, flops, cores / 2) == []
    assert disturbances(LatencyGrid(cells=quiet).cells, flops, cores + 0.5) == [
        f"other work kept {cores + 0.5:.1f} of {cores} cores busy while the grid ran"]
    # what a run beside a test suite and a busy loop measured: PyTorch's threads oversubscribed, ORT's not
    busy = {"b1_s16": _cell({"pytorch": 844.8, "int8_repaired": 2.22}), "b1_s128": _cell({"pytorch": 1273.4,
            "int8_repaired": 12.38}), "b8_s16": _cell({"pytorch": 1734.6, "int8_repaired": 10.8}),
            "b8_s128": _cell({"pytorch": 1007.0, "int8_repaired": 135.4})}
    found = disturbances(LatencyGrid(cells=busy).cells, flops)
    assert found == ["pytorch took 1007.0 ms at b8_s128, 8.8x the work of b1_s128, where it took 1273.4 ms: it was "
                     "waiting, not computing",
                     "pytorch took 1734.6 ms at b8_s16 but 1007.0 ms at b8_s128, which does more work"]
    # a fresh-clone demo beside a test suite: PyTorch as slow at b1 s128 as at b1 s16, no cell 1.5x off another,
    # other work at 0.98 of 2 cores, and the summary printed "152x faster than PyTorch" with no warning
    flat = {"b1_s16": _cell({"pytorch": 398.0, "int8_repaired": 2.6}), "b1_s128": _cell({"pytorch": 379.0,
            "int8_repaired": 9.1}), "b8_s16": _cell({"pytorch": 478.0, "int8_repaired": 11.0}),
            "b8_s128": _cell({"pytorch": 1171.0, "int8_repaired": 107.0})}
    assert disturbances(LatencyGrid(cells=flat).cells, flops) == [
        "pytorch took 379.0 ms at b1_s128, 8.0x the work of b1_s16, where it took 398.0 ms: it was waiting, not "
        "computing"]
    tiny = {cell: _cell({"pytorch": 3.0, "int8_repaired": 0.5}) for cell in flops}  # per-call overhead alone
    assert disturbances(LatencyGrid(cells=tiny).cells, flops) == []
    assert disturbed_warning(BenchMetrics(latency={"disturbed": found})).startswith(
        f"DISTURBED TIMINGS: {found[0]} (and 1 more). Other")
    assert disturbed_warning(BenchMetrics(latency={"disturbed": []})) == ""
    config, record = _benched(tmp_path, PASSING)
    latency = record.metric("bench.latency")
    with record.step("bench"):
        record.set_metric("bench.latency", {**latency, "disturbed": found})
        record.set_metric("bench.host", {"cpu_count": 2, "busy_before": 2.0})  # busy before too: one warning
    assert not any("busy when measuring" in line for line in verdict_line("bench", record).splitlines())
    assert verdict_line("bench", record).splitlines()[0] == (
        f"timings disturbed by other work on the host ({found[0]}): re-run the bench step on a quiet host before "
        "trusting the speeds below")
    report.run(config, record)
    html = record.artifact("report").read_text()
    warning = html.index('<div class="warning"><p>DISTURBED TIMINGS: pytorch took 1007.0 ms at b8_s128')
    table = html.index('<table class="summary recommendation">')
    assert warning < table and "<td>2.5x (disturbed timings: not a speed to expect)</td>" in html[table:]
    assert "int8_repaired at b1 s16, the fastest in timings other work disturbed (2.5x PyTorch there, not a speed " \
        "to expect), min cosine" in report.lines(record)[1]


def test_the_bench_verdict_says_when_other_work_loaded_the_host(tmp_path):
    """A fresh-clone trial beside a test suite: 2.0 of 2 cores busy, PyTorch's medians 84 ms at b1 s16 and 877 at
    b1 s128, no cell 1.5x off another, and the verdict line printed "22.1x faster than PyTorch" with no caveat."""
    _, record = _benched(tmp_path, {"fp32": 0.99999, "int8": 0.9995, "int8_repaired": 0.9999})
    assert not any("busy" in line for line in bench.lines(record))
    record.set_metric("bench.host", {"cpu_count": 2, "busy_before": 2.0})  # as the bench step writes it
    lines = bench.lines(record)
    assert lines[0] == ("the host was busy when measuring began (other work kept 2.0 of 2 cores busy): read the "
                        "speedups below as this host's under load")
    assert lines[1:] == [choice.line(record.run_dir) for choice in recommend(record)]
    assert "x faster than PyTorch" in lines[1]
    assert bench.headline(record.results_as("bench", BenchMetrics))[0].startswith("The host was busy")

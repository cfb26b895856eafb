"""The bench on CUDA: every row on the GPU with its baseline on the same GPU, I/O binding, CUDA graphs, memory."""
from __future__ import annotations

import pytest

from workbench.core.config import RunConfig
from workbench.core.record import RunRecord
from workbench.measure.latency import REFERENCES
from workbench.steps import export, optimize, parity
from workbench.steps.bench import latency as run_latency_benchmark

SETTINGS = {"precisions": ["fp32", "fp16"], "device": "cuda", "parity": {"repair": False},
            "bench": {"batches": [1, 8], "sequences": [16, 128], "rounds": 30, "warmup": 5}}


@pytest.fixture(scope="module")
def gpu_bench(tmp_path_factory):
    config = RunConfig.model_validate(SETTINGS)
    record = RunRecord.create(tmp_path_factory.mktemp("gpu-bench"), config)
    for step in (export, optimize, parity):
        step.run(config, record)
    return record, run_latency_benchmark(config, record).recorded()  # the grid as run.json holds it


def test_pytorch_runs_on_the_gpu_and_every_speedup_is_against_the_same_device(gpu_bench):
    _, latency = gpu_bench
    assert latency["device"] == "cuda"
    runners = latency["runners"]
    assert runners["pytorch"]["device"] == "cuda" and runners["pytorch"]["providers"] == ["torch-cuda"]
    assert runners["pytorch_fp16@device"]["precision"] == "fp16"
    for cell in latency["cells"].values():
        for name, stats in cell.items():
            base = stats["baseline"]
            assert base in REFERENCES and runners[name]["device"] == runners[base]["device"] == "cuda", name
            assert runners[base]["io"] == runners[name]["io"], name


def test_io_binding_is_at_least_as_fast_as_numpy_in_and_out_at_b1_s16(gpu_bench):
    _, latency = gpu_bench
    cell = latency["cells"]["b1_s16"]
    assert cell["fp32@device"]["p50"] <= cell["fp32"]["p50"] * 1.02, (cell["fp32@device"]["p50"], cell["fp32"]["p50"])


def test_cuda_graph_rows_or_their_reason(gpu_bench):
    _, latency = gpu_bench
    for cell, outcome in latency["cuda_graph"].items():
        for variant, result in outcome.items():
            assert result == "captured" or result.startswith("not captured: "), result
            assert (f"{variant}@cuda_graph" in latency["cells"][cell]) == (result == "captured")


def test_peak_device_memory_and_per_precision_peaks(gpu_bench):
    _, latency = gpu_bench
    assert latency["peaks"]["fp16"] > 0 and latency["peaks"]["fp32"] > 0, "both measured (their ratio: make bench)"
    for name, row in latency["runners"].items():
        if "@cuda_graph" not in name:
            assert row["peak_memory_mb"] > 0, name
    assert latency["runners"]["pytorch_fp16@device"]["parity"]["precision"] == "fp16"

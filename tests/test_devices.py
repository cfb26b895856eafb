"""Every runner says where and how it runs, a speedup only ever compares runners on one device, and the CUDA code
paths that also run on the CPU (I/O binding over CPU OrtValues, the CUDA provider options) give what they promise.
The CUDA measurements themselves are in tests/gpu."""
from __future__ import annotations

import json

import numpy as np
import pytest

from workbench.core.config import RunConfig
from workbench.core.data import load_corpus
from workbench.core.record import RunRecord
from workbench.measure.errors import DeviceMismatchError
from workbench.measure.latency import baseline_for, speedup, summarize
from workbench.measure.sessions import cuda_candidates
from workbench.measure.tables import GridRunner
from workbench.models.batches import shaped_batch, token_lengths
from workbench.models.loading import load_model
from workbench.report.page import build_report
from workbench.runners.library import library_runner
from workbench.runners.onnxruntime import CPU, CUDA, OrtRunner, SessionSettings
from workbench.runners.torch import TorchRunner
from workbench.steps import export, optimize, specs
from workbench.steps.bench import latency as run_latency_benchmark

SMALL = {"batch": {"min": 1, "opt": 2, "max": 4}, "sequence": {"min": 1, "opt": 16, "max": 32},
         "precisions": ["fp32"], "threads": 1}


@pytest.fixture(scope="module")
def exported(tiny_models, tmp_path_factory):
    config = RunConfig.model_validate({"model": str(tiny_models["bert"]), **SMALL})
    record = RunRecord.create(tmp_path_factory.mktemp("devices"), config)
    export.run(config, record)
    optimize.run(config, record)
    loaded = load_model(config)
    texts = list(load_corpus())
    batch = shaped_batch(loaded.tokenizer, loaded.input_names, texts, token_lengths(loaded.tokenizer, texts), 2, 16)
    return config, record, loaded, batch


def test_every_runner_records_device_precision_providers_and_io(exported):
    config, record, loaded, _ = exported
    path = record.variant("fp32").path
    with (TorchRunner(loaded, config.output_specs) as torch_runner, OrtRunner("fp32", path, [CPU]) as host,
          OrtRunner("fp32@device", path, [CPU], io="device") as bound,
          library_runner(loaded, load_corpus(), ("sentence_embedding",), 32) as library):
        assert torch_runner.describe() == {"label": "PyTorch eager fp32 · cpu", "device": "cpu", "precision": "fp32",
                                           "providers": ["torch-cpu"], "io": "host"}
        assert host.describe() == {"label": "ONNX Runtime fp32 · cpu", "device": "cpu", "precision": "fp32",
                                   "providers": [CPU], "io": "host"}
        assert bound.describe()["io"] == "device" and bound.describe()["device"] == "cpu"
        assert library.describe()["label"] == "sentence-transformers · cpu"


def test_io_binding_gives_what_session_run_gives(exported):
    """ONNX Runtime's I/O binding (CPU OrtValues here, CUDA memory on a GPU host): the same outputs, bit for bit."""
    _, record, _, batch = exported
    path = record.variant("fp32").path
    with OrtRunner("fp32", path, [CPU]) as host, OrtRunner("fp32@device", path, [CPU], io="device") as bound:
        want, got = host.infer(batch), bound.infer(batch)
        assert set(got) == set(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
        call = bound.timed(batch)
        call()
        assert [value.shape() for value in call().get_outputs()] == [list(v.shape) for v in want.values()]


def test_a_speedup_across_two_devices_is_refused():
    cpu = GridRunner(label="PyTorch eager fp32 · cpu", device="cpu", reference=True)
    cuda = GridRunner(label="ONNX Runtime fp32 · cuda · end to end", device="cuda")
    with pytest.raises(DeviceMismatchError, match="would compare cuda with cpu"):
        speedup(cpu, cuda, 5.0, 1.0)
    assert speedup(cpu, cuda.model_copy(update={"device": "cpu"}), 5.0, 2.0) == 2.5
    rows = {"pytorch": cpu, "fp32": cuda}
    assert baseline_for("fp32", rows) is None, "no PyTorch on CUDA: no speedup, never one against the CPU"
    stats = summarize({"pytorch": [0.005] * 3, "fp32": [0.001] * 3}, 1, 16, rows)
    assert stats["fp32"].speedup is None and stats["pytorch"].speedup == 1.0


def test_cuda_sessions_screen_provider_options_never_thread_counts():
    options = cuda_candidates()
    assert options[0].cuda == (("cudnn_conv_use_max_workspace", "1"), ("arena_extend_strategy", "kNextPowerOfTwo"),
                               ("do_copy_in_default_stream", "1"))
    assert len(options) == len(set(options)) == 8 and all(o.threads is None for o in options)
    chosen = options[3]
    assert chosen.providers([CUDA, CPU]) == [(CUDA, {"use_tf32": "0", **dict(chosen.cuda)}), CPU]
    graph = chosen.providers([(CUDA, {"enable_cuda_graph": "1"}), CPU])
    assert graph == [(CUDA, {"use_tf32": "0", **dict(chosen.cuda), "enable_cuda_graph": "1"}), CPU]
    assert SessionSettings().providers([CUDA, CPU]) == [(CUDA, {"use_tf32": "0"}), CPU], "fp32 stays fp32 (no TF32)"
    assert SessionSettings.from_record(chosen.record()) == chosen
    assert SessionSettings(2).providers([CPU]) == [CPU]


@pytest.mark.slow
def test_torch_compile_is_a_peer_row_checked_like_a_variant(exported, tmp_path):
    config, record, _, _ = exported
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(load_corpus()[:16]), encoding="utf-8")
    bench = {"batches": [1], "sequences": [16], "rounds": 3, "warmup": 1, "tune_sessions": False,
             "torch_compile": True}
    config = config.model_copy(update={"bench": config.bench.model_copy(update=bench), "corpus": str(corpus)})
    latency = run_latency_benchmark(config, record)
    row = latency.runners["torch_compile"]
    assert row.label == "torch.compile fp32 · cpu" and row.io == "host"
    assert row.parity and row.parity.passed and (row.parity.outputs["sentence_embedding"].max_abs or 0) < 1e-4
    stats = latency.cells["b1_s16"]["torch_compile"]
    assert stats.baseline == "pytorch" and stats.speedup is not None and latency.passed["torch_compile"]
    assert latency.device == "cpu" and set(latency.peaks) == {"fp32"} and not latency.cuda_graph
    assert all(b.variant != "torch_compile" for b in latency.best.values()), "a peer, not a variant to deploy"
    with record.step("bench"):
        record.set_metric("bench.latency", latency.recorded())
    page = build_report(record, tmp_path / "report.html", specs()).read_text()
    for label in ("PyTorch eager fp32 · cpu", "torch.compile fp32 · cpu", "ONNX Runtime fp32 · cpu"):
        assert label in page or json.dumps(label)[1:-1] in page, label  # plotly's JSON: raw with orjson, else escaped
    assert "What each row ran on" in page

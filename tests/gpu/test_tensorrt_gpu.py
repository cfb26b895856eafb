"""TensorRT and CUDA on a real GPU: MiniLM engines with two profiles, parity with PyTorch, the engine cache."""
from __future__ import annotations

import numpy as np
import pytest

from workbench.core.atomic import sha256_file
from workbench.core.config import RunConfig
from workbench.core.data import load_corpus
from workbench.core.record import RunRecord
from workbench.doctor import check_tensorrt
from workbench.models.batches import Batch
from workbench.models.loading import load_model
from workbench.models.text import encode
from workbench.runners.onnxruntime import CPU, CUDA, TENSORRT, OrtRunner, tensorrt_providers
from workbench.steps import export, optimize, parity, tensorrt

TENSORRT_LIBRARY = check_tensorrt()
pytestmark = pytest.mark.skipif(not TENSORRT_LIBRARY.available,
                                reason=f"needs TensorRT: tensorrt {TENSORRT_LIBRARY.reason}")

SETTINGS = {"batch": {"min": 1, "opt": 8, "max": 32}, "sequence": {"min": 1, "opt": 128, "max": 256},
            "precisions": ["fp32", "fp16"], "tensorrt": {"profiles": 2}, "device": "cuda"}


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    cache = tmp_path_factory.mktemp("engine-cache")
    config = RunConfig.model_validate({**SETTINGS, "tensorrt": {"profiles": 2, "engine_cache_dir": str(cache)}})
    record = RunRecord.create(tmp_path_factory.mktemp("run"), config)
    for step in (export, optimize, parity, tensorrt):
        step.run(config, record)
    return config, record


def test_cuda_provider_runs_the_ort_variants(engine_run):
    _, record = engine_run
    assert "CUDAExecutionProvider" in record.data["environment"]["onnxruntime"]["providers_used"]
    assert record.data["metrics"]["parity"]["variants"]["fp32"]["passed"]


def test_two_profile_engines_are_built_and_match_pytorch(engine_run):
    _, record = engine_run
    assert record.data["steps"]["tensorrt"]["status"] == "ok", record.data["steps"]["tensorrt"]
    engines = record.data["metrics"]["tensorrt"]["engines"]
    assert len(record.data["metrics"]["tensorrt"]["profiles"]) == 2
    for name in ("trt_fp32", "trt_fp16"):
        assert engines[name]["build"]["cache_hit"] is False
        assert record.artifact(f"engine.{name}").stat().st_size > 1_000_000
    variants = record.data["metrics"]["tensorrt"]["parity"]
    fp32 = variants["trt_fp32"]["outputs"]["sentence_embedding"]
    assert fp32["min_cosine"] > 0.9999 and fp32["max_abs"] < 1e-3
    fp16 = variants["trt_fp16"]["outputs"]["sentence_embedding"]
    assert fp16["min_cosine"] > 0.999 and fp16["non_finite"] == 0


def test_a_second_run_reuses_the_cached_engines(engine_run, tmp_path):
    config, first = engine_run
    record = RunRecord.create(tmp_path, config)
    export.run(config, record)
    optimize.run(config, record)
    record.data["metrics"]["parity"] = first.data["metrics"]["parity"]  # same pins as the first run
    tensorrt.run(config, record)
    engines = record.data["metrics"]["tensorrt"]["engines"]
    for name in ("trt_fp32", "trt_fp16"):
        assert engines[name]["build"]["cache_hit"] is True
        assert "seconds" not in engines[name]["build"]
        assert sha256_file(record.artifact(f"engine.{name}")) == sha256_file(first.artifact(f"engine.{name}"))


def test_ort_tensorrt_provider_answers_like_cuda_fp32(engine_run):
    config, record = engine_run
    options = record.data["metrics"]["tensorrt"]["engines"]["trt_fp32"]["ort_provider_options"]
    loaded = load_model(config)
    with (OrtRunner("ort_trt", record.artifact("onnx.tensorrt"), tensorrt_providers(options)) as trt,
          OrtRunner("fp32", record.artifact("onnx.fp32"), [CUDA, CPU]) as cuda):
        assert trt.providers[0] == TENSORRT
        feed = encode(loaded.tokenizer, list(load_corpus()[:16]), trt.input_names, max_length=128)
        batch = Batch("texts", list(range(16)), feed)
        got, want = trt.infer(batch)["sentence_embedding"], cuda.infer(batch)["sentence_embedding"]
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() > 0.9999 and np.abs(got - want).max() < 1e-3

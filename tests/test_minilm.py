"""The embedded default model with real weights, end to end: export, optimize, parity and a real Triton server."""
from __future__ import annotations

import numpy as np
import pytest

from tests.test_optimize import fused_ops
from workbench.core.config import RunConfig
from workbench.core.data import load_corpus
from workbench.core.record import RunRecord
from workbench.models.loading import resolve_source
from workbench.serving.client import TritonClient
from workbench.serving.server import TritonServer
from workbench.steps import export, optimize, triton

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    """fp32 and int8 built; fp32 served (the triton step checks it on the parity lab itself)."""
    root = tmp_path_factory.mktemp("minilm")
    config = RunConfig.model_validate({"precisions": ["fp32", "int8"], "threads": 1,
                                       "triton": {"repository_dir": str(root / "repos"), "variant": "fp32"}})
    record = RunRecord.create(root / "run", config)
    steps = {step.__name__.rsplit(".", 1)[-1]: step.run(config, record) for step in (export, optimize)}
    return root, config, record, steps


def test_minilm_fuses_like_onnxruntime_promises(minilm):
    _, _, _, steps = minilm
    metrics = steps["export"].metrics
    assert (metrics["architecture"], metrics["num_heads"], metrics["hidden_size"], metrics["num_layers"]) == (
        "bert", 12, 384, 6)
    assert metrics["source"]["kind"] == "embedded"
    fusions = steps["optimize"].metrics["variants"]
    assert fusions["fp32"]["fused"] == fused_ops(fusions["fp32"]["form"]["chosen"], 6)
    assert fusions["int8"]["fused"]["QAttention"] == 6
    assert fusions["int8"]["megabytes"] < 0.3 * fusions["fp32"]["megabytes"]


def test_the_embedded_model_serves_what_encode_returns(minilm, tmp_path):
    """The served sentence_embedding is SentenceTransformer(folder).encode()'s, unit vectors included."""
    from sentence_transformers import SentenceTransformer

    root, config, record, _ = minilm
    deployment = triton.run(config, record).metrics
    assert deployment["variant"] == "fp32" and deployment["served_reference"].startswith("model = SentenceTransformer(")
    for result in deployment["served_parity"].values():
        assert result["passed"] and result["outputs"]["sentence_embedding"]["max_abs"] < 1e-5
    texts = list(load_corpus())
    want = SentenceTransformer(resolve_source(config.model).location, device="cpu").encode(texts)
    name = deployment["name"]
    with TritonServer(root / "repos" / name, tmp_path / "server") as server:
        for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
            with TritonClient(url, protocol) as client:
                got = np.concatenate([client.infer_texts(name, texts[i:i + 32])["sentence_embedding"]
                                      for i in range(0, len(texts), 32)])
            cosine = np.sum(got * want, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
            assert np.abs(got - want).max() < 1e-4 and cosine.min() > 0.9999, protocol
            assert np.abs(np.linalg.norm(got, axis=1) - 1).max() < 1e-6, protocol

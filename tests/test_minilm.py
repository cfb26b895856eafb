"""The embedded default model, end to end through export and optimize (real weights, about 15 s)."""
from __future__ import annotations

import pytest

from workbench.config import RunConfig
from workbench.record import RunRecord
from workbench.steps import export, optimize


@pytest.mark.slow
def test_minilm_fuses_like_onnxruntime_promises(tmp_path):
    config = RunConfig(precisions=["fp32", "int8"])
    record = RunRecord.create(tmp_path, config)
    metrics = export.run(config, record).metrics
    assert (metrics["architecture"], metrics["num_heads"], metrics["hidden_size"], metrics["num_layers"]) == (
        "bert", 12, 384, 6)
    assert metrics["source"]["kind"] == "embedded"
    fusions = optimize.run(config, record).metrics["variants"]
    assert fusions["fp32"]["fused"] == {"EmbedLayerNormalization": 1, "Attention": 6, "BiasGelu": 6,
                                        "SkipLayerNormalization": 12}
    assert fusions["int8"]["fused"]["QAttention"] == 6
    assert fusions["int8"]["megabytes"] < 0.3 * fusions["fp32"]["megabytes"]

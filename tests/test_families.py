"""Encoder families ONNX Runtime has no fusion rules for: exported, optimized at the basic level (DeBERTa-v2, borrowed
rules not tried) or with BERT's rules borrowed and attention fused with its position bias (MPNet), fp16 and int8
built from that graph, and checked against PyTorch like the others."""
from __future__ import annotations

import numpy as np
import pytest

from workbench.core.config import RunConfig
from workbench.core.data import load_corpus
from workbench.core.record import RunRecord
from workbench.graphs import onnxfiles
from workbench.models.loading import load_model
from workbench.models.tiny import build_encoder
from workbench.steps import export, optimize, parity, triton
from workbench.steps.optimize.onnxruntime_variants import TRANSFORMER_FUSIONS

SMALL = {"batch": {"min": 1, "opt": 4, "max": 8}, "sequence": {"min": 1, "opt": 32, "max": 64}}
# family -> (task, what its tokenizer returns, what the graph takes, borrowed_rules)
FAMILIES = {
    # DeBERTa-v3 layout: no segment embeddings, so the tokenizer's token_type_ids are not a graph input
    "deberta-v2": ("sequence-classification", {"input_ids", "attention_mask", "token_type_ids"},
                   ["input_ids", "attention_mask"], "never"),
    "mpnet": ("feature-extraction", {"input_ids", "attention_mask"}, ["input_ids", "attention_mask"], "always"),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_run(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(family)
    model = build_encoder(root / "model", family, FAMILIES[family][0])
    config = RunConfig.model_validate({"model": str(model), "task": FAMILIES[family][0], **SMALL,
                                       "precisions": ["fp32", "fp16", "int8"],
                                       "optimize": {"borrowed_rules": FAMILIES[family][3], "openvino": "never"}})
    record = RunRecord.create(root / "run", config)
    export.run(config, record)
    fusions = optimize.run(config, record).metrics["variants"]
    return family, config, record, fusions, parity.run(config, record).metrics["variants"]


def test_fp32_variants_match_pytorch(family_run):
    family, _, _, _, results = family_run
    assert "original" not in results, "checked only where the fused graph fails"
    for variant in ("fp32",):
        for name, out in results[variant]["outputs"].items():
            assert out["passed"] and out["max_abs"] < 1e-4, (family, variant, name, out["max_abs"])
            if out.get("min_cosine") is not None:
                assert out["min_cosine"] > 0.9999, (family, variant, name)
            if out.get("agreement") is not None:
                assert out["agreement"] == 1.0, (family, variant, name)
    assert {"fp16", "int8"} <= set(results), "fp16 and int8 were built and checked"


def test_record_names_the_unavailable_fusions(family_run):
    family, config, record, fusions, _ = family_run
    assert record.data["metrics"]["export"]["optimizer_model_type"] is None
    if config.optimize.borrowed_rules != "never":
        pytest.skip("borrowed rules: test_borrowed_rules_fuse_attention_with_its_position_bias")
    for variant in ("fp32", "fp16", "int8"):
        stats = record.metric(f"optimize.variants.{variant}")
        assert stats["unavailable"]["fusions"] == list(TRANSFORMER_FUSIONS)
        assert f"no fusion rules for model type '{family}'" in stats["unavailable"]["reason"]
        assert "(optimize.borrowed_rules=never)" in stats["unavailable"]["reason"]
        assert not set(TRANSFORMER_FUSIONS) & set(stats["fused"])
        assert stats["attention_fused"] is False and "warning" not in stats
    assert "unavailable" not in fusions["original"] and "unavailable" not in fusions["tensorrt"]
    assert fusions["fp32"]["nodes"] < fusions["original"]["nodes"] * 0.6, "the basic level folded constants"
    assert fusions["int8"]["fused"]["MatMulInteger"] > 0
    graph = onnxfiles.load(record.artifact("onnx.fp32"))
    assert {node.domain for node in graph.graph.node} <= {"", "ai.onnx"}, "no contrib ops only some EPs have"


def test_borrowed_rules_fuse_attention_with_its_position_bias(family_run):
    family, config, record, fusions, results = family_run
    if config.optimize.borrowed_rules == "never":
        pytest.skip("the basic graph: test_record_names_the_unavailable_fusions")
    borrowed = fusions["fp32"]["borrowed"]
    assert borrowed["rules"] == "bert" and borrowed["kept"] and borrowed["matches"]
    assert borrowed["max_abs"] < 1e-5 and borrowed["reason"] == "set by optimize.borrowed_rules=always"
    assert borrowed["attention"].startswith("fused in 2 of 2 layers, the position bias passed")
    graph = onnxfiles.load(record.artifact("onnx.fp32"))
    attention = [n for n in graph.graph.node if n.op_type == "Attention"]
    assert len(attention) == 2 and all(n.domain == "com.microsoft" and n.input[5] for n in attention), \
        "packed Attention with the position bias (plus the mask) as attention_bias"
    for variant in ("fp32", "fp16", "int8"):
        stats = fusions[variant]
        assert stats["attention_fused"] and "warning" not in stats
        assert stats["unavailable"]["fusions"] == ["EmbedLayerNormalization"], "MPNet's embeddings stay unfused"
        assert "attention: fused in 2 of 2 layers" in stats["unavailable"]["reason"]
    assert fusions["fp32"]["fused"]["SkipLayerNormalization"] >= 3 and fusions["fp32"]["fused"]["BiasGelu"] == 2
    int8 = [n.op_type for n in onnxfiles.load(record.artifact("onnx.int8")).graph.node]
    assert "QAttention" not in int8 and int8.count("MultiHeadAttention") == 2, "the position bias kept in int8"
    # int8 is in the configured precisions, so it is built and checked on any host, int8 instructions or not
    assert results["fp32"]["passed"] and results["int8"]["outputs"], family


def test_graph_inputs_are_what_the_tokenizer_produces(family_run):
    family, config, record, fusions, _ = family_run
    _, produced, taken, _ = FAMILIES[family]
    loaded = load_model(config)
    assert set(loaded.tokenizer(list(load_corpus()[:2]))) == produced
    assert list(record.data["metrics"]["export"]["io"]["inputs"]) == taken == list(loaded.input_names)
    assert list(fusions["fp32"]["smoke_test"]["outputs"]) == [o.name for o in config.output_specs]


def test_tiny_families_are_not_degenerate(family_run):
    """Random weights that give every text the same output would let any graph pass parity."""
    family, config, record, _, _ = family_run
    loaded = load_model(config)
    assert loaded.max_sequence == 128 and loaded.optimizer_model_type is None
    feed = loaded.tokenizer(list(load_corpus()[:8]), padding=True, return_tensors="pt")
    outputs = loaded.task.forward(loaded.model, {n: feed[n] for n in loaded.input_names}, loaded.head)
    first = list(outputs.values())[-1]  # the sentence embedding, or the logits
    assert np.ptp(first.detach().numpy(), axis=0).min() > 1e-3, family


@pytest.mark.slow
def test_served_through_triton_like_the_others(family_run, tmp_path):
    family, config, record, _, _ = family_run
    served = config.model_copy(update={"triton": config.triton.model_copy(
        update={"repository_dir": str(tmp_path / "repos")})})
    metrics = triton.run(served, record).metrics
    assert metrics["verified"] and metrics["verification"]["by"] == "parity step", family
    # OpenVINO left out (optimize.openvino=never): a variant it ran faster here would go first, as the race decided
    preferred = "int8" if record.metric("optimize.precisions.decisions.int8.pays") else "fp32"
    passed_over = metrics["verification"].get("passed_over", {})
    # The measured first choice, unless its served answers failed the gate (recorded, and the next one served).
    assert metrics["variant"] == preferred or preferred in passed_over, (family, metrics["verification"])
    served_parity = metrics["served_parity"]
    assert set(served_parity) == {"http", "grpc"}
    for protocol, result in served_parity.items():
        assert result["passed"] and result["precision"] == record.variant(metrics["variant"]).precision, \
            (family, protocol, result["failures"])

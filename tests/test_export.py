from __future__ import annotations

import numpy as np
import pytest
import torch

from workbench.core.config import RunConfig
from workbench.core.data import load_corpus
from workbench.core.errors import ConfigError
from workbench.core.record import RunRecord
from workbench.graphs.errors import ExportError, OpsetError
from workbench.models.batches import Batch
from workbench.models.loading import check_pooling_task, load_model
from workbench.models.text import encode
from workbench.models.tiny import build_encoder
from workbench.runners.onnxruntime import OrtRunner
from workbench.runners.torch import GraphModule
from workbench.steps import export


def torch_outputs(config: RunConfig, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    loaded = load_model(config)
    module = GraphModule(loaded, config.output_specs).eval()
    with torch.no_grad():
        return [t.numpy() for t in module(*(torch.from_numpy(feed[n]) for n in loaded.input_names))]


@pytest.mark.parametrize("model, exporter, opset, outputs", [
    ("bert", "legacy", 17, ["token_embeddings", "sentence_embedding"]),
    ("roberta", "legacy", 14, ["token_embeddings", "sentence_embedding"]),
    ("distilbert", "legacy", 17, ["token_embeddings", "sentence_embedding"]),
    ("bert-seqcls", "legacy", 17, ["logits"]),
    ("bert-tokcls", "legacy", 17, ["logits"]),
    ("bert", "dynamo", 18, ["token_embeddings", "sentence_embedding"]),
])
def test_export_matches_torch_at_other_shapes(tiny_models, tmp_path, model, exporter, opset, outputs):
    task = {"bert-seqcls": "sequence-classification", "bert-tokcls": "token-classification"}.get(
        model, "feature-extraction")
    config = RunConfig(model=str(tiny_models[model]), task=task, exporter=exporter, opset=opset)
    record = RunRecord.create(tmp_path, config)
    metrics = export.run(config, record).metrics
    assert metrics["opset"] == opset and list(metrics["io"]["outputs"]) == outputs
    assert all(shape[:2] == ["batch", "sequence"] for shape in metrics["io"]["inputs"].values())

    with OrtRunner("original", record.artifact("onnx.original"), ["CPUExecutionProvider"]) as runner:
        # Seven texts up to 90 tokens: neither the batch (2) nor the length used at export time.
        feed = encode(record_tokenizer(record), list(load_corpus()[10:17]), runner.input_names, max_length=90)
        got = runner.infer(Batch("texts", list(range(10, 17)), feed))
    want = torch_outputs(config, feed)
    assert feed["input_ids"].shape[0] == 7 and feed["input_ids"].shape[1] > 40
    for name, reference in zip(outputs, want):
        assert got[name].shape == reference.shape
        assert np.abs(got[name] - reference).max() < 1e-4, name
    assert record.data["steps"]["export"]["status"] == "ok"
    assert (tmp_path / "model" / "tokenizer_config.json").is_file()


def record_tokenizer(record: RunRecord):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(record.artifact("tokenizer"))


@pytest.mark.parametrize("exporter, opset", [("legacy", 21), ("legacy", 6), ("dynamo", 17)])
def test_opset_outside_range_fails_before_writing(tiny_bert, tmp_path, exporter, opset):
    config = RunConfig(model=str(tiny_bert), exporter=exporter, opset=opset)
    record = RunRecord.create(tmp_path, config)
    with pytest.raises(OpsetError, match=f"opset {opset} is outside the {exporter} exporter's range"):
        export.run(config, record)
    assert record.data["steps"]["export"]["status"] == "failed"
    assert not (tmp_path / "onnx").exists()


def test_family_the_exporter_cannot_handle_at_an_opset_is_a_typed_error(tmp_path):
    """DeBERTa-v2's relative positions slice with dynamic bounds, which ONNX has no operator for before opset 10."""
    model = build_encoder(tmp_path / "deberta", "deberta-v2", "sequence-classification")
    config = RunConfig(model=str(model), task="sequence-classification", opset=9)
    record = RunRecord.create(tmp_path / "run", config)
    with pytest.raises(ExportError, match="opset 9\\) cannot export 'deberta-v2': .*Slice with dynamic inputs") as info:
        export.run(config, record)
    assert "-p opset=17" in info.value.fix
    assert record.data["steps"]["export"]["status"] == "failed"
    assert not list((tmp_path / "run" / "onnx").glob("*.onnx"))


def test_a_classifier_folder_run_without_a_task_follows_its_head(tiny_models, tmp_path, capsys):
    """task auto (the default): a folder without sentence-transformers files whose config.json names a sequence or
    token classifier's head is exported for that head's task, said first and recorded with why; a set task wins."""
    config = RunConfig(model=str(tiny_models["bert-seqcls"]))
    assert config.task == "auto"
    record = RunRecord.create(tmp_path / "run", config)
    capsys.readouterr()
    metrics = export.run(config, record).metrics
    reason = ("auto: follows the head config.json names (BertForSequenceClassification); -p task=feature-extraction "
              "for its embeddings")
    assert metrics["task"] == "sequence-classification" and metrics["task_reason"] == reason
    assert metrics["io"]["outputs"] == {"logits": ["batch", 3]}, "the head is kept, not mean-pooled away"
    said = capsys.readouterr().out.splitlines()
    assert said[0].endswith("started") and said[1].endswith(f"task sequence-classification: {reason}")
    assert export.lines(record)[0] == f"task sequence-classification: {reason}"
    assert RunConfig(model=str(tiny_models["bert-tokcls"])).task_choice.name == "token-classification"
    assert "no sequence or token classifier's head in config.json's architectures (BertModel)" in RunConfig(
        model=str(tiny_models["bert"])).task_choice.reason
    with pytest.raises(ConfigError) as refused:  # pooling on a followed head: the fix names the embeddings' task
        check_pooling_task(RunConfig(model=str(tiny_models["bert-seqcls"]), pooling="cls"))
    assert refused.value.fix.endswith("or -p task=feature-extraction for its embeddings")
    embeddings = RunConfig(model=str(tiny_models["bert-seqcls"]), task="feature-extraction")
    record = RunRecord.create(tmp_path / "embeddings", embeddings)
    metrics = export.run(embeddings, record).metrics
    assert metrics["task_reason"] == "set: task=feature-extraction"
    assert list(metrics["io"]["outputs"]) == ["token_embeddings", "sentence_embedding"]

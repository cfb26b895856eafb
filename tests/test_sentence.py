"""Embeddings exactly as sentence-transformers users get them: the pipeline read from the model's own files, in the
graph, checked against `SentenceTransformer.encode()` in process and as served by a real Triton server."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from workbench.core.config import RunConfig
from workbench.core.data import load_corpus
from workbench.core.record import RunRecord
from workbench.models.errors import PoolingMismatchError, UnsupportedModelError
from workbench.models.loading import load_model, resolve_source
from workbench.models.sentence import read_pipeline
from workbench.models.tiny import build_sentence_encoder
from workbench.precision.lab import library_check
from workbench.preflight import preflight
from workbench.serving.client import TritonClient
from workbench.serving.server import TritonServer
from workbench.serving.settings import lab_settings
from workbench.steps import export, optimize, parity, triton

SMALL = {"batch": {"min": 1, "opt": 4, "max": 8}, "sequence": {"min": 1, "opt": 32, "max": 64},
         "precisions": ["fp32"], "threads": 1}
PROMPTS = {"query": "query: ", "passage": "passage: "}
TEXTS = list(load_corpus()[:12])


def _encode(folder, texts, **kwargs):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    model.max_seq_length = min(model.max_seq_length or 64, 64)
    return model.encode(texts, convert_to_numpy=True, **kwargs)


def _served(repository, name, texts, tmp_path, parameters=None):
    """`texts` through a real server of the published repository, over HTTP and gRPC, 8 per request."""
    with TritonServer(repository, tmp_path / "server") as server:
        answers = {}
        for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
            with TritonClient(url, protocol) as client:
                answers[protocol] = np.concatenate([
                    client.infer_texts(name, texts[start:start + 8], parameters=parameters)["sentence_embedding"]
                    for start in range(0, len(texts), 8)])
    return answers


def _deploy(model, tmp_path, **settings):
    config = RunConfig.model_validate({"model": str(model), **SMALL, **settings,
                                       "triton": {"repository_dir": str(tmp_path / "repos")}})
    record = RunRecord.create(tmp_path / "run", config)
    for step in (export, optimize, parity, triton):
        assert step.run(config, record).status == "ok", record.data["steps"]
    return config, record


def _gate(got, want):
    """The fp32 gate, as numbers: max abs and min cosine."""
    cosine = np.sum(got * want, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    return float(np.abs(got - want).max()), float(cosine.min())


@pytest.fixture(scope="module")
def cls_dense(tmp_path_factory):
    """CLS pooling, a Dense layer to 16 dimensions, no Normalize, two prompts, dot-product similarity."""
    return build_sentence_encoder(tmp_path_factory.mktemp("cls-dense") / "model", pooling="cls", dense=16,
                                  prompts=PROMPTS, similarity="dot")


def test_the_pipeline_is_read_from_the_models_own_files(cls_dense):
    pipeline = read_pipeline(str(cls_dense))
    assert (pipeline.declared, pipeline.pooling, pipeline.dense_layers, pipeline.normalized) == (True, "cls", 1, False)
    assert pipeline.prompts == {**PROMPTS, "document": ""} and pipeline.similarity == "dot", "as the library has them"
    assert pipeline.max_seq_length == 128, "the tokenizer's limit, as the library resolves it"
    minilm = read_pipeline(resolve_source(RunConfig().model).location)
    assert (minilm.pooling, minilm.normalized, minilm.max_seq_length) == ("mean", True, 256)
    assert minilm.similarity == "cosine" and minilm.prompts == {"query": "", "document": ""}
    assert minilm.steps("mean") == ["Transformer", "Pooling(mean)", "Normalize"]


@pytest.fixture(scope="module")
def cls_dense_deployed(cls_dense, tmp_path_factory):
    root = tmp_path_factory.mktemp("cls-dense-deployed")
    return root, *_deploy(cls_dense, root)


@pytest.mark.slow
def test_cls_pooling_and_a_dense_layer_are_served_as_encode_returns_them(cls_dense, cls_dense_deployed, tmp_path):
    root, config, record = cls_dense_deployed
    pipeline = record.metric("export.sentence_pipeline")
    assert pipeline["steps"] == ["Transformer", "Pooling(cls)", "Dense"] and pipeline["similarity"] == "dot"
    assert record.metric("export.io.outputs.sentence_embedding") == ["batch", 16]
    check = record.metric("parity.reference")
    assert check["passed"] and check["reference"].startswith(f"model = SentenceTransformer({str(cls_dense)!r});")
    assert check["outputs"]["sentence_embedding"]["max_abs"] < 1e-5
    deployment = record.metric("triton")
    assert deployment["served_reference"] == check["reference"]
    assert all(r["passed"] for r in deployment["served_parity"].values())
    name, repository = deployment["name"], root / "repos" / deployment["name"]
    want, query = _encode(cls_dense, TEXTS), _encode(cls_dense, TEXTS, prompt_name="query")
    assert _gate(want, query)[1] < 0.9999, "the prompt changes the embedding: the test below can tell"
    spaces = [" ", "\t\n "]  # whitespace alone: encode() embeds it, and so does the deployment
    want_spaces = _encode(cls_dense, spaces)
    for protocol, got in _served(repository, name, TEXTS + spaces, tmp_path).items():
        max_abs, min_cosine = _gate(got, np.concatenate([want, want_spaces]))
        assert got.shape == (len(TEXTS) + 2, 16) and max_abs < 1e-4 and min_cosine > 0.9999, protocol
    for parameters in ({"prompt_name": "query"}, {"prompt": "query: "}):  # a name, or the text, as encode() takes
        for protocol, got in _served(repository, name, TEXTS, tmp_path, parameters).items():
            max_abs, min_cosine = _gate(got, query)
            assert max_abs < 1e-4 and min_cosine > 0.9999, (protocol, parameters)
    prompts = deployment["prompt_parity"]
    assert set(prompts) == {"query", "passage", "document"} and all(r["passed"] for r in prompts.values())
    assert all(deployment["served_passed"][f"http, prompt_name={p!r}"] for p in prompts)


@pytest.mark.slow
def test_an_unknown_prompt_name_is_refused_with_the_known_ones(cls_dense_deployed, tmp_path):
    root, _, record = cls_dense_deployed
    name = record.metric("triton.name")
    with TritonServer(root / "repos" / name, tmp_path / "server") as server, \
            TritonClient(server.http_url, "http") as client:
        with pytest.raises(Exception, match="unknown prompt_name 'querry': this model's prompts are document, "
                                            "passage, query"):
            client.infer_texts(name, TEXTS[:1], parameters={"prompt_name": "querry"})


@pytest.mark.slow
def test_a_default_prompt_and_normalize_are_applied_as_encode_applies_them(tmp_path):
    model = build_sentence_encoder(tmp_path / "model", pooling="mean", dense=None, normalize=True,
                                   prompts=PROMPTS, default_prompt_name="query", similarity="cosine")
    _, record = _deploy(model, tmp_path)
    assert record.metric("parity.reference.passed")
    norms = record.metric("parity.reference.norms")
    assert abs(norms[0] - 1) < 1e-6 and abs(norms[1] - 1) < 1e-6
    name = record.metric("triton.name")
    want = _encode(model, TEXTS)  # the default prompt, applied by the library
    plain = _encode(model, TEXTS, prompt="")
    for protocol, got in _served(tmp_path / "repos" / name, name, TEXTS, tmp_path).items():
        assert _gate(got, want)[0] < 1e-4 and _gate(got, plain)[1] < 0.9999, protocol
        assert np.abs(np.linalg.norm(got, axis=1) - 1).max() < 1e-6, protocol


def test_a_pooling_that_contradicts_the_models_files_is_refused_before_anything_runs(tmp_path):
    config = RunConfig.model_validate({"pooling": "cls", "output_dir": str(tmp_path / "run")})
    with pytest.raises(PoolingMismatchError, match="1_Pooling/config.json declares mean pooling") as refused:
        preflight(config)
    assert "pooling_override=true" in refused.value.fix
    cli = subprocess.run([sys.executable, "-m", "workbench", "run", "--steps", "export", "--output-dir",
                          str(tmp_path / "run"), "-p", "pooling=cls"], capture_output=True, text=True, timeout=300)
    assert cli.returncode == 2 and "PoolingMismatchError" in cli.stderr + cli.stdout
    assert not (tmp_path / "run").exists(), "nothing is written"


def test_an_override_is_noted_and_checked_against_the_library_pooling_that_way(cls_dense, tmp_path):
    config = RunConfig.model_validate({"model": str(cls_dense), **SMALL, "pooling": "mean",
                                       "pooling_override": True})
    loaded = load_model(config)
    assert loaded.pooling == "mean" and loaded.pooling_overridden
    assert loaded.pipeline.describe("mean", True).override == \
        "pooling mean instead of the declared cls (pooling_override)"
    check = library_check(lab_settings(config), loaded, load_corpus()[:24])
    assert check.passed and check.reference == (
        f"model = SentenceTransformer({str(cls_dense)!r}); model[1] = Pooling(32, pooling_mode='mean'); "
        "model.encode(texts)"), "the model as it ships: cut where it cuts, not at the run's sequence.max"
    assert check.library == "SentenceTransformer.encode() with mean pooling (pooling_override)"


def test_a_module_pooled_the_wrong_way_fails_the_check_against_encode(cls_dense):
    from sentence_transformers.sentence_transformer.modules import Pooling

    config = RunConfig.model_validate({"model": str(cls_dense), **SMALL})
    loaded = load_model(config)
    loaded.head = torch.nn.Sequential(Pooling(loaded.hidden_size, "mean"), loaded.head[1]).eval()
    check = library_check(lab_settings(config), loaded, load_corpus()[:24])
    assert check.checked and not check.passed
    assert any("sentence_embedding: min cosine" in failure for failure in check.failures)


def test_models_without_sentence_transformers_files_keep_working(tiny_models):
    embedding = RunConfig.model_validate({"model": str(tiny_models["bert"]), **SMALL})
    loaded = load_model(embedding)
    assert not loaded.pipeline.declared and loaded.pooling == "mean"
    check = library_check(lab_settings(embedding), loaded, load_corpus()[:24])
    assert check.passed and check.reference == (
        f"model = SentenceTransformer(modules=[Transformer({str(tiny_models['bert'])!r}), Pooling(32, "
        "pooling_mode='mean')]); model.encode(texts)")
    classifier = RunConfig.model_validate({"model": str(tiny_models["bert-seqcls"]), **SMALL,
                                           "task": "sequence-classification"})
    check = library_check(lab_settings(classifier), load_model(classifier), load_corpus()[:24])
    assert check.passed and check.reference.startswith("pipeline('text-classification'")
    assert check.outputs["logits"].agreement == 1.0 and check.outputs["logits"].max_abs < 1e-5
    tokens = RunConfig.model_validate({"model": str(tiny_models["bert-tokcls"]), **SMALL,
                                       "task": "token-classification"})
    check = library_check(lab_settings(tokens), load_model(tokens), load_corpus()[:24])
    assert not check.checked and "returns each token's best label" in check.reason


def test_a_module_the_graph_cannot_hold_is_refused_by_name(cls_dense, tmp_path):
    folder = tmp_path / "model"
    subprocess.run(["cp", "-r", str(cls_dense), str(folder)], check=True)
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_LSTM",
                    "type": "sentence_transformers.sentence_transformer.modules.lstm.LSTM"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedModelError, match="modules.json lists .*LSTM, which the exported graph cannot hold"):
        read_pipeline(str(folder))


def test_a_pipeline_without_a_transformer_is_refused_naming_its_module(tmp_path):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import StaticEmbedding
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "text": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    SentenceTransformer(modules=[StaticEmbedding(words, embedding_dim=8)]).save(str(tmp_path / "static"))
    with pytest.raises(UnsupportedModelError) as refused:  # it has no config.json: named, not "not a model folder"
        resolve_source(str(tmp_path / "static"))
    assert "modules.json starts with StaticEmbedding" in refused.value.problem
    assert "has none to export" in refused.value.problem


def test_a_cross_encoder_folder_is_not_read_as_an_embedding_model(tmp_path):
    """A CrossEncoder's folder also starts modules.json with a Transformer: read as an embedding model, its export
    failed with a KeyError. It is refused before the run, with the task that exports it."""
    from sentence_transformers import CrossEncoder

    from workbench.models.tiny import build_encoder
    from workbench.preflight import check_model_limits

    base = build_encoder(tmp_path / "classifier", "bert", "sequence-classification")
    CrossEncoder(str(base), device="cpu").save(str(tmp_path / "reranker"))
    with pytest.raises(UnsupportedModelError) as refused:
        check_model_limits(RunConfig(model=str(tmp_path / "reranker"), task="feature-extraction"))
    assert "sentence-transformers CrossEncoder" in refused.value.problem
    assert "-p task=rerank" in refused.value.fix
    check_model_limits(RunConfig(model=str(tmp_path / "reranker"), task="rerank"))
    check_model_limits(RunConfig(model=str(tmp_path / "reranker")))  # task auto: the class that saved it

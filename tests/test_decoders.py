"""Decoder embedders: a causal LM's last hidden states pooled at each text's last real token (sentence-transformers'
last-token pooling), with instruction prompts; exported, checked and served equal to `encode()` and
`encode(prompt_name="query")`, though the library pads on the left and the workbench on the right."""
from __future__ import annotations

import json

import numpy as np
import pytest

from workbench.core.config import RunConfig
from workbench.core.data import load_corpus
from workbench.core.record import RunRecord
from workbench.models.errors import UnsupportedModelError
from workbench.models.tiny import DECODER_CONFIGS, build_decoder_embedder, build_gemma_embedder, build_gpt2
from workbench.preflight import check_model_limits
from workbench.serving.client import TritonClient
from workbench.serving.server import TritonServer
from workbench.steps import export, optimize, parity, triton

SMALL = {"batch": {"min": 1, "opt": 4, "max": 8}, "sequence": {"min": 1, "opt": 32, "max": 128}}


def _checked(model, root):
    """`model` through export, optimize and parity in fp32 (its repository under `root`/repos)."""
    config = RunConfig.model_validate({"model": str(model), **SMALL, "precisions": ["fp32"], "threads": 1,
                                       "optimize": {"openvino": "never"},
                                       "triton": {"repository_dir": str(root / "repos")}})
    record = RunRecord.create(root / "run", config)
    for step in (export, optimize, parity):
        step.run(config, record)
    return config, record


@pytest.fixture(scope="module", params=list(DECODER_CONFIGS))
def decoder_run(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    config, record = _checked(build_decoder_embedder(root / "model", request.param), root)
    return request.param, root, config, record


def test_the_module_and_its_graphs_return_what_encode_returns(decoder_run):
    family, _, _, record = decoder_run
    assert record.metric("export.architecture") == family
    pipeline = record.metric("export.sentence_pipeline")
    assert pipeline["pooling"] == "lasttoken" and pipeline["normalize"] and "query" in pipeline["prompts"]
    reference = record.metric("parity.reference")
    assert reference["passed"] and reference["outputs"]["sentence_embedding"]["max_abs"] < 1e-5
    assert reference["outputs"]["token_embeddings"]["passed"], "each text's tokens at their places, padding aside"
    assert record.metric("parity.variants.fp32")["passed"] and record.metric("parity.variants.original") is None


def test_the_workbench_pads_on_the_right(decoder_run):
    """The library pads on the left (the model's tokenizer says so) and still agrees: rotary positions make a
    text's answer independent of its padding, and last-token pooling finds the last real token on either side."""
    _, root, _, record = decoder_run
    shipped = json.loads((root / "model" / "tokenizer_config.json").read_text())
    saved = json.loads((record.artifact("tokenizer") / "tokenizer_config.json").read_text())
    assert shipped["padding_side"] == "left" and saved["padding_side"] == "right"


def test_served_answers_equal_encode_and_its_query_prompt(decoder_run, tmp_path):
    from sentence_transformers import SentenceTransformer

    _, root, config, record = decoder_run
    deployment = triton.run(config, record).metrics
    assert all(deployment["served_passed"].values()) and "http, prompt_name='query'" in deployment["served_passed"]
    library = SentenceTransformer(str(root / "model"), device="cpu")
    texts = list(load_corpus()[:48])
    name = deployment["name"]
    with TritonServer(root / "repos" / name, tmp_path / "server") as server, \
            TritonClient(server.http_url, "http") as client:
        for prompt in (None, "query"):
            want = library.encode(texts, prompt_name=prompt, batch_size=16)
            got = np.concatenate([client.infer_texts(name, texts[i:i + 8], ["sentence_embedding"],
                                                     {"prompt_name": prompt} if prompt else None)["sentence_embedding"]
                                  for i in range(0, len(texts), 8)])
            assert np.abs(got - want).max() < 1e-5, prompt
    assert np.abs(library.encode(texts[:4], prompt_name="query") - library.encode(texts[:4])).max() > 1e-3, \
        "the prompt changes the answer: the check above would catch a server that ignored it"


def test_a_bidirectional_gemma_embedder_is_exported_and_served_equal_to_encode(tmp_path):
    """EmbeddingGemma's build (a Gemma 3 text model attending both ways, a two-sided window on its sliding layer,
    mean pooling, two Dense, Normalize, prompts, truncate_dim): its graph and its served answers equal
    encode(truncate_dim=32), with and without the query prompt; a causal graph would not come close."""
    from sentence_transformers import SentenceTransformer

    model = build_gemma_embedder(tmp_path / "model", truncate_dim=32)
    config, record = _checked(model, tmp_path)
    assert record.metric("export.architecture") == "gemma3_text"
    assert record.metric("export.sentence_pipeline")["steps"] == [
        "Transformer", "Pooling(mean)", "Dense", "Dense", "Normalize", "Truncate(32)"]
    assert record.metric("parity.reference")["outputs"]["sentence_embedding"]["max_abs"] < 1e-5
    deployment = triton.run(config, record).metrics
    assert all(deployment["served_passed"].values()) and "http, prompt_name='query'" in deployment["served_passed"]
    answers = [record.metric("parity.variants.fp32"), deployment["served_parity"]["http"],
               deployment["served_parity"]["grpc"], deployment["prompt_parity"]["query"]]
    for answer in answers:
        embedding = answer["outputs"]["sentence_embedding"]
        assert embedding["max_abs"] < 1e-5 and embedding["min_cosine"] > 0.99999

    library = SentenceTransformer(str(model), device="cpu")
    texts = list(load_corpus()[:16])
    want = library.encode(texts, prompt_name="query")
    library[0].auto_model.config.use_bidirectional_attention = False
    for layer in library[0].auto_model.layers:
        layer.self_attn.is_causal = True
    causal = library.encode(texts, prompt_name="query")
    assert want.shape == (16, 32) and np.abs(causal - want).max() > 0.1, "the checks above tell the two apart"


def test_a_decoder_without_sentence_transformers_files_is_refused(tmp_path):
    model = build_gpt2(tmp_path / "gpt2")
    with pytest.raises(UnsupportedModelError) as refused:
        check_model_limits(RunConfig(model=str(model)))
    assert "decoder-only" in refused.value.problem and "modules.json" in refused.value.fix


def test_absolute_positions_padded_on_the_left_are_refused_with_the_fix(tmp_path):
    """GPT-2 left-padded: encode() embeds a text differently in each batch. Right-padded, as the fix says, it runs."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import AutoTokenizer

    base = build_gpt2(tmp_path / "gpt2")
    transformer = Transformer(str(base))
    folder = tmp_path / "embedder"
    SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), "lasttoken")],
                        device="cpu").save(str(folder))
    config = RunConfig(model=str(folder), sequence={"max": 64})
    with pytest.raises(UnsupportedModelError) as refused:
        check_model_limits(config)
    assert "learned absolute positions" in refused.value.problem and "padding_side='right'" in refused.value.fix
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "right"
    tokenizer.save_pretrained(folder)
    check_model_limits(config)

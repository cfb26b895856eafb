"""The reference is the model as it ships: the run cuts texts where the model's library does unless told otherwise
(and then says so), every pipeline option that changes the vector is applied as the library applies it, and a setting
the model cannot honour is refused before anything runs, every problem in one refusal."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from workbench.core.config import RunConfig
from workbench.core.data import load_corpus
from workbench.core.errors import ShapeError
from workbench.core.record import RunRecord
from workbench.models.errors import PoolingMismatchError, UnsupportedModelError
from workbench.models.loading import load_model
from workbench.models.sentence import read_pipeline
from workbench.models.tiny import build_encoder, build_sentence_encoder
from workbench.preflight import ProblemsError, preflight
from workbench.serving.client import TritonClient
from workbench.serving.server import TritonServer
from workbench.steps import export, optimize, parity, triton, verdict_line

SMALL = {"batch": {"min": 1, "opt": 4, "max": 8}, "precisions": ["fp32"], "threads": 1}
PROMPTS = {"query": "Query: ", "passage": "Passage: "}
# Mixed case, so a model that lowercases its input gives other tokens than one that does not.
TEXTS = [text.upper() if i % 2 else text for i, text in enumerate(load_corpus()[:10])]


def _library(folder):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu")  # as the model ships: its own max_seq_length


def _long(model, tokens):
    """A real text of about `tokens` tokens for `model` (corpus texts joined)."""
    from workbench.models.batches import long_texts

    return long_texts(model.tokenizer, load_corpus(), [tokens])[0]


def _served(folder, name, texts, tmp_path, parameters=None):
    with TritonServer(folder, tmp_path / "server") as server:
        answers = {}
        for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
            with TritonClient(url, protocol) as client:
                answers[protocol] = np.concatenate([client.infer_texts(name, texts[i:i + 4], parameters=parameters)[
                    "sentence_embedding"] for i in range(0, len(texts), 4)])
    return answers


def _gate(got, want):
    cosine = np.sum(got * want, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    return float(np.abs(got - want).max()), float(cosine.min())


def _run(model, root, **settings):
    config = RunConfig.model_validate({"model": str(model), **SMALL, **settings,
                                       "triton": {"repository_dir": str(root / "repos")}})
    record = RunRecord.create(root / "run", config)
    for step in (export, optimize, parity, triton):
        assert step.run(config, record).status == "ok", record.data["steps"]
    return record


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """512 positions and max_seq_length 512 (e5/bge style), mean pooling without the prompt's tokens, Normalize,
    named prompts, and an input lowercased by the library (`do_lower_case` in sentence_bert_config.json) over a
    tokenizer that keeps case."""
    return build_sentence_encoder(tmp_path_factory.mktemp("long") / "model", pooling="mean", dense=None,
                                  normalize=True, prompts=PROMPTS, similarity="cosine", positions=512,
                                  max_seq_length=512, include_prompt=False, do_lower_case=True)


@pytest.fixture(scope="module")
def long_deployed(long_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("long-deployed")
    return root, _run(long_model, root)


def test_the_pipeline_options_that_change_the_vector_are_read(long_model):
    pipeline = read_pipeline(str(long_model))
    assert (pipeline.include_prompt, pipeline.do_lower_case, pipeline.max_seq_length) == (False, True, 512)
    loaded = load_model(RunConfig.model_validate({"model": str(long_model), **SMALL}))
    assert loaded.input_names[-1] == "pooling_mask" and (loaded.sequence.max, loaded.sequence.opt) == (512, 128)
    assert loaded.tokenizer("ABC")["input_ids"] == loaded.tokenizer("abc")["input_ids"], "lowercased as encode() does"
    assert loaded.prompt_tokens("query") == len(loaded.tokenizer("Query: ")["input_ids"]) - 1, "less [SEP]"


@pytest.mark.slow
def test_defaults_serve_what_encode_returns_as_shipped_long_texts_and_prompts_included(long_model, long_deployed,
                                                                                        tmp_path):
    root, record = long_deployed
    assert record.metric("export.sequence")["max"] == 512
    assert record.metric("export.sequence.sources.max").startswith("auto: max_seq_length 512")
    assert record.metric("parity.reference.reference").endswith("model.encode(texts)"), "no max_seq_length of ours"
    assert record.metric("triton.cut")["gated"] and record.metric("triton.cut.texts_beyond") >= 1
    assert any("past 512 tokens" in key for key in record.metric("triton.served_passed"))
    library = _library(long_model)
    texts = [*TEXTS, _long(library, 400), _long(library, 700)]
    lengths = [len(ids) for ids in library.tokenizer(texts)["input_ids"]]
    assert 400 <= lengths[-2] <= 512 < lengths[-1], lengths
    name = record.metric("triton.name")
    custom = "Custom instruction: "
    cases = {"plain": ({}, library.encode(texts)),
             "prompt_name": ({"prompt_name": "query"}, library.encode(texts, prompt_name="query")),
             "custom prompt": ({"prompt": custom}, library.encode(texts, prompt=custom))}
    assert _gate(cases["plain"][1], cases["custom prompt"][1])[1] < 0.9999, "the prompt changes the vectors"
    for case, (parameters, want) in cases.items():
        for protocol, got in _served(root / "repos" / name, name, texts, tmp_path, parameters).items():
            max_abs, min_cosine = _gate(got, want)
            assert max_abs < 1e-4 and min_cosine > 0.9999, (case, protocol, max_abs, min_cosine)


@pytest.mark.slow
def test_a_shorter_cut_is_named_in_the_verdict_and_never_a_plain_pass(long_model, long_deployed, tmp_path):
    root, first = long_deployed
    config = RunConfig.model_validate({"model": str(long_model), **SMALL, "sequence": {"max": 256},
                                       "triton": {"repository_dir": str(root / "repos")}})
    record = RunRecord.create(tmp_path / "run", config)
    for step in (export, optimize, parity, triton):
        assert step.run(config, record).status == "ok", record.data["steps"]
    assert record.metric("parity.reference.passed"), "the module is checked at the model's own limit"
    cut = record.metric("parity.reference.cut")
    assert (cut["deployment"], cut["library"]) == (256, 512) and cut["texts_beyond"] >= 2
    assert cut["beyond"]["outputs"]["sentence_embedding"]["min_cosine"] < 0.9999, "the cut changes long texts"
    served = record.metric("triton.cut")
    assert not served["gated"] and set(served["beyond"]) == {"http", "grpc"}
    for step in ("parity", "triton"):
        assert "equal to SentenceTransformer.encode() up to 256 tokens; longer texts are cut at 256 where " \
               "SentenceTransformer.encode() cuts at 512" in verdict_line(step, record), step
    served = verdict_line("triton", record)
    assert "served parity against SentenceTransformer.encode() on texts up to 256 tokens: HTTP pass" in served
    assert f"replaced the deployment 'model' that run {first.run_dir.resolve()} had published" in served
    assert f", published to {record.metric('triton.repository')}" in served, "where the deployment went, said"


def test_a_plain_folder_takes_the_librarys_default_prompt_names(tiny_bert):
    pipeline = read_pipeline(str(tiny_bert))
    assert not pipeline.declared and pipeline.prompts == {"query": "", "document": ""}
    assert pipeline.prompted(("a",), "query") == ("a",)


def test_a_64_token_model_runs_with_defaults_and_bad_sequences_are_refused_at_once(tmp_path):
    model = build_sentence_encoder(tmp_path / "model", pooling="mean", dense=None, positions=64)
    config = RunConfig.model_validate({"model": str(model), "steps": ["export"], "output_dir": str(tmp_path / "r")})
    preflight(config)
    assert load_model(config).sequence.model_dump() == {"min": 1, "opt": 64, "max": 64}
    bad = config.model_copy(update={"sequence": config.sequence.model_copy(update={"min": 0, "opt": 300, "max": 100})})
    with pytest.raises(ShapeError) as refused:
        preflight(bad)
    problem = refused.value.problem
    assert "sequence.min=0 is below 1" in problem and "sequence.max=100 exceeds the model's limit of 64" in problem
    assert "need sequence.min <= opt <= max, got 0, 300, 100" in problem and "-p sequence.max=64" in refused.value.fix


def test_an_override_that_breaks_a_dense_layer_and_a_missing_head_are_refused_before_export(tmp_path):
    model = build_sentence_encoder(tmp_path / "model", pooling=("cls", "mean"), dense=24)
    override = RunConfig.model_validate({"model": str(model), "pooling": "cls", "pooling_override": True,
                                         "steps": ["export"], "output_dir": str(tmp_path / "a")})
    with pytest.raises(PoolingMismatchError, match=r"pooling=cls gives 32 values per text, but .*2_Dense/config.json "
                                                   r"takes 64"):
        preflight(override)
    head = RunConfig.model_validate({"model": str(model), "task": "sequence-classification", "steps": ["export"],
                                     "output_dir": str(tmp_path / "b")})
    with pytest.raises(UnsupportedModelError, match=r"needs BertForSequenceClassification's head \(classifier.weight, "
                                                    r"classifier.bias\), and the weights in .* have none"):
        preflight(head)
    both = head.model_copy(update={"sequence": head.sequence.model_copy(update={"max": 4096})})
    with pytest.raises(ProblemsError) as refused:
        preflight(both)
    assert [type(p).__name__ for p in refused.value.problems] == ["UnsupportedModelError", "ShapeError"]
    cli = subprocess.run([sys.executable, "-m", "workbench", "run", "--model", str(model), "--steps", "export",
                          "--output-dir", str(tmp_path / "c"), "-p", "pooling=cls", "-p", "pooling_override=true"],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 2 and "PoolingMismatchError" in cli.stderr and "Traceback" not in cli.stderr
    assert not (tmp_path / "c").exists(), "nothing is written"


def test_a_fine_tuned_classifier_keeps_its_head_and_pooling_is_for_embeddings_only(tiny_models, tiny_bert,
                                                                                  tmp_path):
    head = RunConfig.model_validate({"model": str(tiny_models["bert-seqcls"]), "task": "sequence-classification",
                                     "steps": ["export"], "output_dir": str(tmp_path / "a")})
    preflight(head)
    both = head.model_copy(update={"model": str(tiny_bert), "pooling": "max"})
    with pytest.raises(ProblemsError) as refused:  # one refusal: the pooling and the missing head
        preflight(both)
    assert "pooling=max applies to task feature-extraction only" in refused.value.problem
    assert "needs BertForSequenceClassification's head" in refused.value.problem


@pytest.mark.parametrize("borrowed", ["never", "always"])
def test_the_optimize_summary_says_in_words_why_a_family_is_not_fused(tmp_path, borrowed):
    model = build_encoder(tmp_path / "model", family="mpnet")
    config = RunConfig.model_validate({"model": str(model), **SMALL, "sequence": {"max": 64},
                                       "optimize": {"borrowed_rules": borrowed}})
    record = RunRecord.create(tmp_path / "run", config)
    for step in (export, optimize):
        assert step.run(config, record).status == "ok"
    line = verdict_line("optimize", record)
    assert ("no attention fusion for this family: ONNX Runtime's transformer optimizer has no fusion rules" in line
            if borrowed == "never" else
            line.startswith("Attention fused in 2 of 2 layers (bert's rules borrowed, attention fused in 2 of 2 "
                            "layers, the position bias passed as the attention op's attention_bias; set by "
                            "optimize.borrowed_rules=always)"))
    assert "{" not in line and json.dumps(record.metric("export.sequence.max")) == "64"

"""Model kinds a 2026 retrieval stack deploys, run as their library's modules compute them: a Matryoshka model
(truncate_dim), a sentence-T5 (T5EncoderModel, Dense without bias), a module of the model's own code
(trust_remote_code), a SPLADE (SparseEncoder), each checked against its library's `encode()` in process and as a
real Triton and the API front serve it."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.test_sentence import SMALL, TEXTS, _deploy, _encode, _gate, _served
from workbench.cli import main
from workbench.core.config import RunConfig
from workbench.models.errors import UnsupportedModelError
from workbench.models.tiny import (
    build_sentence_encoder,
    build_sentence_t5,
    build_sparse_encoder,
    with_custom_module,
)
from workbench.preflight import check_model_limits

pytestmark = pytest.mark.slow
@pytest.fixture(scope="module")
def matryoshka(tmp_path_factory):
    """Mean pooling, Dense to 48, Normalize, and truncate_dim 16 in config_sentence_transformers.json."""
    folder = build_sentence_encoder(tmp_path_factory.mktemp("matryoshka") / "model", pooling="mean", dense=48,
                                    normalize=True)
    settings = json.loads((folder / "config_sentence_transformers.json").read_text())
    (folder / "config_sentence_transformers.json").write_text(json.dumps({**settings, "truncate_dim": 16}))
    return folder


def test_a_matryoshka_model_is_served_at_its_truncate_dim_as_encode_returns(matryoshka, tmp_path):
    config, record = _deploy(matryoshka, tmp_path)
    pipeline = record.data["metrics"]["export"]["sentence_pipeline"]
    assert pipeline["truncate_dim"] == 16 and pipeline["steps"][-2:] == ["Normalize", "Truncate(16)"]
    assert record.data["metrics"]["export"]["io"]["outputs"]["sentence_embedding"] == ["batch", 16]
    lab = record.data["metrics"]["parity"]["reference"]
    assert "with truncate_dim=16" in lab["library"] and lab["passed"], lab
    want = _encode(matryoshka, TEXTS)
    assert want.shape == (len(TEXTS), 16)  # the library's own answer: cut after Normalize, not renormalized
    assert np.linalg.norm(want, axis=1).max() < 0.99
    name = record.metric("triton")["name"]
    served = _served(tmp_path / "repos" / name, name, TEXTS, tmp_path)
    for protocol in ("http", "grpc"):
        max_abs, cosine = _gate(served[protocol], want)
        assert served[protocol].shape == (len(TEXTS), 16) and max_abs < 1e-5 and cosine > 0.99999, protocol


def test_truncate_dim_set_for_the_run_cuts_there_and_a_wider_one_is_refused(matryoshka, tmp_path):
    narrower = RunConfig.model_validate({"model": str(matryoshka), **SMALL, "truncate_dim": 8})
    check_model_limits(narrower)
    with pytest.raises(UnsupportedModelError) as refused:
        check_model_limits(narrower.model_copy(update={"truncate_dim": 64}))
    assert "truncate_dim 64 is wider than the 48 values" in refused.value.problem
    assert "at most 48" in refused.value.fix
    from workbench.core.record import RunRecord
    from workbench.steps import export, optimize, parity

    record = RunRecord.create(tmp_path / "run", narrower)
    for step in (export, optimize, parity):
        assert step.run(narrower, record).status == "ok", record.data["steps"]
    assert record.data["metrics"]["export"]["io"]["outputs"]["sentence_embedding"] == ["batch", 8]
    assert "model.truncate_dim = 8" in record.data["metrics"]["parity"]["reference"]["reference"]


def test_a_sentence_t5_loads_its_encoder_and_is_served_as_encode_returns(tmp_path):
    folder = build_sentence_t5(tmp_path / "st5")
    config, record = _deploy(folder, tmp_path)
    export = record.data["metrics"]["export"]
    assert export["architecture"] == "t5" and export["sentence_pipeline"]["steps"] == [
        "Transformer", "Pooling(mean)", "Dense", "Normalize"]
    assert set(export["io"]["inputs"]) == {"input_ids", "attention_mask"}
    want = _encode(folder, TEXTS)
    name = record.metric("triton")["name"]
    served = _served(tmp_path / "repos" / name, name, TEXTS, tmp_path)
    for protocol in ("http", "grpc"):
        max_abs, cosine = _gate(served[protocol], want)
        assert max_abs < 1e-5 and cosine > 0.99999, (protocol, max_abs, cosine)
    # a Unigram tokenizer whose JSON reads scores back one ulp off is served as the library loads it, not from JSON
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(str(folder)).backend_tokenizer.to_str()
    exact = Tokenizer.from_str(saved).to_str() == saved
    assert (tmp_path / "repos" / name / "1" / "encoder.json").exists() == exact


def test_the_models_own_module_needs_trust_and_then_runs_in_the_graph(matryoshka, tmp_path, capsys):
    folder = with_custom_module(matryoshka, tmp_path / "custom")
    code = main(["run", "--model", str(folder), "--steps", "export", "--output-dir", str(tmp_path / "refused")])
    out = capsys.readouterr()
    text = out.out + out.err
    assert code == 2 and "Scale (scale_module.Scale), a module of the model's own code" in text, text
    assert "-p trust_remote_code=true" in text and "Traceback" not in text
    assert not (tmp_path / "refused").exists()

    from workbench.core.record import RunRecord
    from workbench.steps import export, optimize, parity

    config = RunConfig.model_validate({"model": str(folder), **SMALL, "trust_remote_code": True})
    record = RunRecord.create(tmp_path / "run", config)
    for step in (export, optimize, parity):
        assert step.run(config, record).status == "ok", record.data["steps"]
    assert record.data["metrics"]["export"]["sentence_pipeline"]["steps"][-2:] == ["Scale", "Truncate(16)"]
    assert record.data["metrics"]["parity"]["reference"]["passed"]
    assert record.data["metrics"]["parity"]["variants"]["fp32"]["passed"]


def test_a_module_that_cannot_be_traced_is_refused_in_preflight_by_its_class(matryoshka, tmp_path):
    folder = with_custom_module(matryoshka, tmp_path / "untraceable", traceable=False)
    with pytest.raises(UnsupportedModelError) as refused:
        check_model_limits(RunConfig.model_validate({"model": str(folder), "trust_remote_code": True}))
    assert "Scale (scale_module.Scale)" in refused.value.problem and "cannot be exported" in refused.value.problem
    assert "-p pooling=none" in refused.value.fix


def _sparse_encode(folder, texts, **kwargs):
    """encode() cutting at the deployment's 64 tokens (SMALL), as test_sentence's _encode does."""
    from sentence_transformers import SparseEncoder

    model = SparseEncoder(str(folder), device="cpu")
    model.max_seq_length = 64
    return model.encode(texts, convert_to_sparse_tensor=False, **kwargs).numpy()


def test_a_splade_is_exported_gated_on_its_terms_and_served_as_its_active_terms(tmp_path):
    """A SparseEncoder folder, task auto: exported through its own SpladePooling, gated on its terms and dot
    products, served by Triton as each text's active terms and by the API front's /embed_sparse, as encode() returns
    them (query prompt included)."""
    import subprocess
    import urllib.error
    import urllib.request

    from workbench.serving.backend.sparse_terms import dense_rows
    from workbench.serving.client import TritonClient
    from workbench.serving.endpoints import request_lines
    from workbench.serving.front import ApiFront
    from workbench.serving.server import TritonServer

    folder = build_sparse_encoder(tmp_path / "splade", prompts={"query": "query: ", "document": ""})
    config, record = _deploy(folder, tmp_path)
    export = record.data["metrics"]["export"]
    assert export["task"] == "sparse-embedding" and "SparseEncoder" in export["task_reason"]
    assert export["sentence_pipeline"]["steps"] == ["Transformer", "SpladePooling"]
    assert export["sentence_pipeline"]["similarity"] == "dot"
    fp32 = record.data["metrics"]["parity"]["variants"]["fp32"]["outputs"]["sentence_embedding"]
    assert fp32["passed"] and fp32["sparse"]["top_k_overlap"] == 1.0 and fp32["sparse"]["dot_rel_error"] < 1e-4
    assert 5 < fp32["sparse"]["mean_active_terms"] < 100  # a sparse vector: tens of 600 terms
    deployment = record.metric("triton")
    assert all(v["passed"] for v in deployment["served_parity"].values())
    assert set(deployment["prompt_parity"]) == {"query", "document"}

    from workbench.serving.repository import ensemble_config, fused_config
    from workbench.steps.triton import serving_plan

    plan, _ = serving_plan(config, record)  # the bench's ensemble (tokenizer -> network model) has no terms to serve
    terms = {"sparse_indices", "sparse_values"}
    assert terms <= {o.name for o in fused_config(plan).output}
    assert not terms & {o.name for o in ensemble_config(plan).output}
    name = deployment["name"]
    repository = tmp_path / "repos" / name
    want = _sparse_encode(folder, TEXTS)
    queries = _sparse_encode(folder, TEXTS, prompt_name="query")
    with TritonServer(repository, tmp_path / "server") as server:
        with TritonClient(server.grpc_url, "grpc") as client:
            got = client.infer_texts(name, TEXTS[:8], outputs=["sparse_indices", "sparse_values"])
        ids, weights = got["sparse_indices"], got["sparse_values"]
        assert ids.dtype == np.int64 and all((np.diff(w[i >= 0]) <= 0).all() for i, w in zip(ids, weights))
        # the same terms (a weight within fp32 rounding of relu's 0 may be on in one and off in the other)
        assert [set(i[w > 1e-4]) for i, w in zip(ids, weights)] == [set(np.flatnonzero(r > 1e-4)) for r in want[:8]]
        np.testing.assert_allclose(dense_rows(ids, weights, want.shape[1]), want[:8], atol=1e-5)
        with ApiFront(repository, server.grpc_url, tmp_path / "front") as api:
            lines = request_lines(api.url, [(name, "sparse")], "tea", keyed=False)
            assert "/embed_sparse" in lines[1] and json.loads(subprocess.run(
                ["bash", "-c", lines[1]], capture_output=True, text=True, check=True, timeout=60).stdout)[0]
            refused = urllib.request.Request(f"{api.url}/v1/embeddings", headers={"Content-Type": "application/json"},
                                             data=json.dumps({"model": name, "input": "a"}).encode())
            with pytest.raises(urllib.error.HTTPError) as wrong_route:
                urllib.request.urlopen(refused, timeout=60)
            assert wrong_route.value.code == 404
            assert "is a sparse encoder: POST /embed_sparse answers it" in wrong_route.value.read().decode()
            for body, expected in (({"inputs": TEXTS}, want), ({"inputs": TEXTS, "prompt_name": "query"}, queries),
                                   ({"inputs": TEXTS[0]}, want[:1])):
                request = urllib.request.Request(f"{api.url}/embed_sparse", data=json.dumps(body).encode(),
                                                 headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=60) as response:
                    answer = json.loads(response.read())
                assert len(answer) == len(expected)
                for terms, row in zip(answer, expected):
                    assert {t["index"] for t in terms if t["value"] > 1e-4} == set(np.flatnonzero(row > 1e-4))
                    np.testing.assert_allclose([t["value"] for t in terms], row[[t["index"] for t in terms]],
                                               atol=1e-5)


def test_a_module_whose_code_does_not_import_is_refused_naming_its_file_and_line(matryoshka, tmp_path, capsys):
    folder = with_custom_module(matryoshka, tmp_path / "broken")
    code = (folder / "scale_module.py").read_text()
    (folder / "scale_module.py").write_text(code.replace("        self.factor = factor", "          self.factor = 1"))
    status = main(["run", "--model", str(folder), "--steps", "export", "-p", "trust_remote_code=true",
                   "--output-dir", str(tmp_path / "refused")])
    out = capsys.readouterr()
    assert status == 2 and "Traceback" not in out.out + out.err
    assert "scale_module.Scale, which cannot be imported here: IndentationError (scale_module.py, line" in out.err
    assert not (tmp_path / "refused").exists()


def test_a_splade_with_max_active_dims_keeps_its_heaviest_terms_in_the_graph(tmp_path):
    from workbench.core.record import RunRecord
    from workbench.steps import export, optimize, parity

    folder = build_sparse_encoder(tmp_path / "splade", max_active_dims=5)
    config = RunConfig.model_validate({"model": str(folder), **SMALL})
    record = RunRecord.create(tmp_path / "run", config)
    for step in (export, optimize, parity):
        assert step.run(config, record).status == "ok", record.data["steps"]
    assert record.data["metrics"]["export"]["sentence_pipeline"]["steps"][-1] == "KeepTop(5)"
    fp32 = record.data["metrics"]["parity"]["variants"]["fp32"]["outputs"]["sentence_embedding"]
    assert fp32["passed"] and fp32["sparse"]["mean_active_terms"] <= 5
    assert record.data["metrics"]["parity"]["reference"]["passed"]

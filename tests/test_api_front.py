"""The API front: the real openai and LangChain clients, and raw HTTP, against a real Triton serving a tiny
sentence-transformers model (with prompts) and a tiny reranker; answers equal encode() and predict()."""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import urllib.error
import urllib.request

import numpy as np
import psutil
import pytest

from workbench.core.config import RunConfig
from workbench.core.record import RunRecord
from workbench.models.tiny import build_cross_encoder, build_encoder, build_sentence_encoder
from workbench.serving.backend.api_core import bounded
from workbench.serving.backend.api_schema import parse_keys
from workbench.serving.endpoints import request_lines
from workbench.serving.errors import PortInUseError, ServerStartError
from workbench.serving.front import ApiFront, check_api_port, front_spec
from workbench.serving.repository import write_repository
from workbench.serving.server import TritonServer, free_port
from workbench.steps import export, optimize
from workbench.steps.triton import serving_plan

pytestmark = pytest.mark.slow
KEY = "sk-test-front"
PROMPTS = {"query": "query: ", "passage": "passage: "}
TEXTS = ["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog.", "tea", "Triton serves models."]
SETTINGS = {"batch": {"min": 1, "opt": 2, "max": 4}, "sequence": {"min": 1, "opt": 16, "max": 64},
            "precisions": ["fp32"], "threads": 1, "optimize": {"openvino": "never"}}
LIMITS = {"max_texts": 12, "max_text_chars": 2000, "max_documents": 16}


def _repository(model, task, root, name, **triton):
    config = RunConfig.model_validate({"model": str(model), "task": task, **SETTINGS, "triton": {
        "name": name, "repository_dir": str(root / "repos"), **LIMITS, **triton}})
    record = RunRecord.create(root / f"run-{name}", config)
    export.run(config, record)
    optimize.run(config, record)
    plan, _ = serving_plan(config, record)
    return write_repository(plan, root / f"repository-{name}")


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    """One Triton with an embedding model (max 4 texts a Triton request, 12 a front request, 200 tokens a Triton
    request), a reranker (300 tokens a request) and a 3-label classifier, and the front before it, asking KEY."""
    root = tmp_path_factory.mktemp("front")
    encoder = build_sentence_encoder(root / "encoder", pooling="mean", dense=None, normalize=True, prompts=PROMPTS)
    reranker = build_cross_encoder(root / "reranker")
    classifier = build_encoder(root / "classifier", task="sequence-classification", labels=3)
    both = root / "repository"
    for source in (_repository(encoder, "feature-extraction", root, "embedder", max_request_tokens=200),
                   _repository(reranker, "rerank", root, "reranker", max_request_tokens=300),
                   _repository(classifier, "sequence-classification", root, "classifier")):
        for folder in source.iterdir():
            if folder.is_dir():
                shutil.copytree(folder, both / folder.name)
    with TritonServer(both, root / "server") as server, \
            ApiFront(both, server.grpc_url, root / "front", api_key=KEY) as api:
        yield api, encoder, reranker, classifier


def _post(url, body, key=KEY, raw=None):
    """(status, JSON answer) of a POST."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=raw if raw is not None else json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _encode(model, texts, **kwargs):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model), device="cpu").encode(texts, **kwargs)


def test_the_spec_reads_the_models_their_limits_and_prompts(front):
    api, *_ = front
    spec = {m.id: m for m in front_spec(api.repository).models}
    embedder, reranker = spec["embedder"], spec["reranker"]
    assert (embedder.kind, embedder.output, embedder.batch, embedder.max_texts) == ("embeddings",
                                                                                   "sentence_embedding", 4, 12)
    assert embedder.max_request_tokens == 200 and embedder.prompts["query"] == "query: " and embedder.dimensions > 0
    assert (reranker.kind, reranker.output, reranker.max_documents) == ("rerank", "scores", 16)


def test_the_openai_and_langchain_clients_embed_as_encode_does(front):
    from langchain_openai import OpenAIEmbeddings
    from openai import OpenAI
    from transformers import AutoTokenizer

    api, encoder, *_ = front
    client = OpenAI(base_url=f"{api.url}/v1", api_key=KEY)
    one = client.embeddings.create(model="embedder", input=TEXTS[0])  # the client asks for base64 and decodes it
    np.testing.assert_allclose(one.data[0].embedding, _encode(encoder, [TEXTS[0]])[0], atol=1e-5)
    answer = client.embeddings.create(model="embedder", input=TEXTS * 2)  # 8 texts: two Triton requests of 4
    assert [d.index for d in answer.data] == list(range(8)) and answer.model == "embedder"
    np.testing.assert_allclose([d.embedding for d in answer.data], _encode(encoder, TEXTS * 2), atol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(str(encoder))
    tokens = sum(len(tokenizer(t)["input_ids"]) for t in TEXTS * 2)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == tokens
    query = client.embeddings.create(model="embedder", input=TEXTS, extra_body={"prompt_name": "query"})
    want = _encode(encoder, TEXTS, prompt_name="query")
    np.testing.assert_allclose([d.embedding for d in query.data], want, atol=1e-5)
    assert query.usage.prompt_tokens == sum(len(tokenizer("query: " + t)["input_ids"]) for t in TEXTS)
    long = ["word " * 20 + t for t in TEXTS]  # 208 tokens (each within 64), past 200: two Triton requests
    np.testing.assert_allclose([d.embedding for d in client.embeddings.create(model="embedder", input=long).data],
                               _encode(encoder, long), atol=1e-5)
    floats = client.embeddings.create(model="embedder", input=TEXTS[:2], encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in floats.data], _encode(encoder, TEXTS[:2]), atol=1e-5)

    langchain = OpenAIEmbeddings(model="embedder", base_url=f"{api.url}/v1", api_key=KEY,
                                 check_embedding_ctx_length=False)
    np.testing.assert_allclose(langchain.embed_documents(TEXTS), _encode(encoder, TEXTS), atol=1e-5)
    np.testing.assert_allclose(langchain.embed_query(TEXTS[1]), _encode(encoder, [TEXTS[1]])[0], atol=1e-5)
    status, raw = _post(f"{api.url}/v1/embeddings", {"model": "embedder", "input": TEXTS[:1],
                                                     "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert status == 200 and raw["object"] == "list" and raw["data"][0]["object"] == "embedding"
    np.testing.assert_allclose(decoded, one.data[0].embedding, atol=0)


def test_dimensions_answer_as_encode_with_truncate_dim_does(front):
    """Cut, not renormalized, as sentence-transformers cuts a Matryoshka embedding."""
    from openai import OpenAI

    api, encoder, *_ = front
    client = OpenAI(base_url=f"{api.url}/v1", api_key=KEY)
    answer = client.embeddings.create(model="embedder", input=TEXTS, dimensions=8)
    got = np.array([d.embedding for d in answer.data])
    want = _encode(encoder, TEXTS, truncate_dim=8)
    assert got.shape == (len(TEXTS), 8) and np.linalg.norm(want, axis=1).max() < 0.999
    np.testing.assert_allclose(got, want, atol=1e-5)
    width = next(m.dimensions for m in front_spec(api.repository).models if m.id == "embedder")
    status, raw = _post(f"{api.url}/v1/embeddings", {"model": "embedder", "input": "a", "dimensions": width})
    assert status == 200 and len(raw["data"][0]["embedding"]) == width
    status, raw = _post(f"{api.url}/v1/embeddings", {"model": "embedder", "input": "a", "dimensions": 0})
    assert status == 400 and raw["error"]["code"] == "dimensions_not_supported"
    assert f"at most {width}" in raw["error"]["message"]


def test_the_reranker_scores_as_predict_does_best_first(front):
    from sentence_transformers import CrossEncoder

    api, _, reranker, _ = front
    query, documents = "where do cats sit?", TEXTS
    want = CrossEncoder(str(reranker), device="cpu").predict([(query, d) for d in documents])
    status, answer = _post(f"{api.url}/v1/rerank", {"model": "reranker", "query": query, "documents": documents,
                                                    "top_n": 3, "return_documents": True})
    assert status == 200 and len(answer["results"]) == 3
    order = list(np.argsort(-want, kind="stable")[:3])
    assert [r["index"] for r in answer["results"]] == order
    np.testing.assert_allclose([r["relevance_score"] for r in answer["results"]], want[order], atol=1e-5)
    assert [r["document"]["text"] for r in answer["results"]] == [documents[i] for i in order]
    status, every = _post(f"{api.url}/v1/rerank", {"model": "reranker", "query": query,
                                                   "documents": [{"text": d} for d in documents]})
    assert status == 200 and sorted(r["index"] for r in every["results"]) == [0, 1, 2, 3]
    assert "document" not in every["results"][0] and every["usage"]["total_tokens"] > 0


BAD = [  # (what, path, body or raw bytes, key, status, code)
    ("empty input", "embeddings", {"model": "embedder", "input": []}, KEY, 400, "empty_input"),
    ("an empty text", "embeddings", {"model": "embedder", "input": ["a", ""]}, KEY, 400, "empty_input"),
    ("over max_texts", "embeddings", {"model": "embedder", "input": ["a"] * 13}, KEY, 413, "too_many_inputs"),
    ("over max_text_chars", "embeddings", {"model": "embedder", "input": ["a" * 2001]}, KEY, 413, "text_too_long"),
    ("token ids", "embeddings", {"model": "embedder", "input": [[101, 2000, 102]]}, KEY, 400,
     "token_ids_not_supported"),
    ("dimensions", "embeddings", {"model": "embedder", "input": "a", "dimensions": 100_000}, KEY, 400,
     "dimensions_not_supported"),
    ("an unknown prompt", "embeddings", {"model": "embedder", "input": "a", "prompt_name": "querry"}, KEY, 400,
     "unknown_prompt"),
    ("a wrong model", "embeddings", {"model": "text-embedding-3-small", "input": "a"}, KEY, 404, "model_not_found"),
    ("a reranker as embedder", "embeddings", {"model": "reranker", "input": "a"}, KEY, 404, "model_not_found"),
    ("a malformed body", "embeddings", b'{"model": "embedder", "input": ', KEY, 400, "invalid_json"),
    ("no input", "embeddings", {"model": "embedder"}, KEY, 422, "invalid_value"),
    ("input a number", "embeddings", {"model": "embedder", "input": 3}, KEY, 422, "invalid_value"),
    ("no key", "embeddings", {"model": "embedder", "input": "a"}, None, 401, "invalid_api_key"),
    ("a wrong key", "embeddings", {"model": "embedder", "input": "a"}, "sk-wrong", 401, "invalid_api_key"),
    ("no documents", "rerank", {"model": "reranker", "query": "q", "documents": []}, KEY, 400, "empty_input"),
    ("over the token budget", "rerank", {"model": "reranker", "query": "q", "documents": ["word " * 60] * 8}, KEY,
     413, "too_many_tokens"),
    ("over max_documents", "rerank", {"model": "reranker", "query": "q", "documents": ["d"] * 17}, KEY, 413,
     "too_many_inputs"),
    ("top_n 0", "rerank", {"model": "reranker", "query": "q", "documents": ["d"], "top_n": 0}, KEY, 422,
     "invalid_value"),
    ("an unknown route", "chat/completions", {"model": "embedder"}, KEY, 404, "not_found"),
    ("a lone surrogate", "embeddings", b'{"model": "embedder", "input": ["a", "\\ud800"]}', KEY, 400,
     "invalid_unicode"),
    ("a lone surrogate in a query", "rerank", b'{"model": "reranker", "query": "\\udc00", "documents": ["d"]}', KEY,
     400, "invalid_unicode"),
    ("a lone surrogate in a prompt", "embeddings", b'{"model": "embedder", "input": "a", "prompt": "\\ud83d"}', KEY,
     400, "invalid_unicode"),
    ("nested 100,000 deep", "embeddings", b"[" * 100_000 + b"]" * 100_000, KEY, 400, "invalid_json"),
    ("invalid UTF-8", "embeddings", b'{"model": "embedder", "input": "\xff"}', KEY, 400, "invalid_json"),
]


def test_bad_requests_get_the_documented_status_in_openais_shape_and_the_front_stays_healthy(front):
    api, *_ = front
    for what, path, body, key, status, code in BAD:
        raw = body if isinstance(body, bytes) else None
        got, answer = _post(f"{api.url}/v1/{path}", body, key, raw)
        error = answer["error"]
        assert (got, error["code"]) == (status, code), (what, answer)
        assert "Traceback" not in error["message"], what
        assert set(error) == {"message", "type", "param", "code"} and error["message"], what
    status, answer = _post(f"{api.url}/embed_sparse", {"inputs": ["a"]})  # no sparse encoder here: said so
    assert status == 404 and answer["error_type"] == "Validation"  # TEI's shape on TEI's routes
    assert "serves no sparse encoder, which /embed_sparse answers for" in answer["error"]
    assert "input[1] holds a lone surrogate ('\\ud800' at character 0)" in _post(
        f"{api.url}/v1/embeddings", None, raw=BAD[-5][2])[1]["error"]["message"]
    budget = next(body for what, _, body, *_ in BAD if what == "over the token budget")
    assert "triton.max_request_tokens" in _post(f"{api.url}/v1/rerank", budget)[1]["error"]["message"]
    assert _post(f"{api.url}/v1/embeddings", {"model": "embedder", "input": 3})[1]["error"]["message"] == \
        "input: expected a string or a list of strings (got int)"
    for line in request_lines(api.url, [(m.id, m.kind) for m in front_spec(api.repository).models], "tea", keyed=True):
        if line.strip().startswith("curl "):  # as printed, the shell filling in the key
            several = {**os.environ, "WORKBENCH_API_KEY": f"{KEY}, sk-another"}  # the first key is sent
            done = subprocess.run(["bash", "-c", line], env=several,
                                  capture_output=True, text=True, check=True, timeout=60)
            assert "error" not in json.loads(done.stdout), done.stdout
    with urllib.request.urlopen(f"{api.url}/health", timeout=10) as response:
        assert response.status == 200 and json.loads(response.read())["status"] == "ok"
    assert _post(f"{api.url}/v1/embeddings", {"model": "embedder", "input": "still here"})[0] == 200
    request = urllib.request.Request(f"{api.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert sorted(m["id"] for m in json.loads(response.read())["data"]) == ["classifier", "embedder", "reranker"]


def test_a_front_whose_triton_is_gone_says_503(front, tmp_path):
    api, *_ = front
    with ApiFront(api.repository, f"127.0.0.1:{free_port()}", tmp_path / "front") as lost:
        status, answer = _post(f"{lost.url}/v1/embeddings", {"model": "embedder", "input": "a"}, key=None)
        assert status == 503 and answer["error"]["code"] == "triton_unavailable"
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"{lost.url}/health", timeout=10)
        assert health.value.code == 503


def test_tei_routes_answer_as_the_library_does(front, monkeypatch):
    """TEI's /embed (and huggingface_hub's client on it and on /), /rerank, /predict, /tokenize and /info."""
    from huggingface_hub import InferenceClient, constants
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer, pipeline

    api, encoder, reranker, classifier = front
    want = _encode(encoder, TEXTS)
    status, got = _post(f"{api.url}/embed", {"model": "embedder", "inputs": TEXTS})
    assert status == 200 and np.abs(np.asarray(got) - want).max() < 1e-5
    status, cut = _post(f"{api.url}/embed", {"model": "embedder", "inputs": "tea", "dimensions": 8})
    norm = want[2, :8] / np.linalg.norm(want[2, :8])  # TEI's normalize=true, after the cut
    assert status == 200 and np.abs(np.asarray(cut[0]) - norm).max() < 1e-5
    monkeypatch.setattr(constants, "is_offline_mode", lambda: False)  # the suite's offline hub: this is no hub
    for where in ({"base_url": api.url}, {"model": f"{api.url}/embed"}):  # POST / and POST /embed
        vector = InferenceClient(**where, api_key=KEY).feature_extraction(TEXTS[0])
        assert np.abs(np.asarray(vector).ravel() - want[0]).max() < 1e-5, where
    query = "where do cats sit?"
    scores = CrossEncoder(str(reranker), device="cpu").predict([(query, d) for d in TEXTS])
    status, ranked = _post(f"{api.url}/rerank", {"query": query, "texts": TEXTS, "return_text": True})
    assert status == 200 and [r["index"] for r in ranked] == list(np.argsort(-scores, kind="stable"))
    assert np.abs([r["score"] for r in ranked] - np.sort(scores)[::-1]).max() < 1e-5
    assert ranked[0]["text"] == TEXTS[ranked[0]["index"]]
    labelled = pipeline("text-classification", model=str(classifier), device="cpu", top_k=None)(TEXTS[:2])
    status, predicted = _post(f"{api.url}/predict", {"inputs": TEXTS[:2]})
    assert status == 200 and [[p["label"] for p in row] for row in predicted] == \
        [[p["label"] for p in row] for row in labelled]
    assert np.abs(np.asarray([[p["score"] for p in row] for row in predicted]) -
                  [[p["score"] for p in row] for row in labelled]).max() < 1e-5
    status, one = _post(f"{api.url}/predict", {"inputs": TEXTS[0]})
    assert status == 200 and one == predicted[0]
    status, tokens = _post(f"{api.url}/tokenize", {"model": "embedder", "inputs": "The cat sat."})
    ids = AutoTokenizer.from_pretrained(str(encoder))("The cat sat.")["input_ids"]
    assert status == 200 and [t["id"] for t in tokens[0]] == ids and tokens[0][1]["text"].lower() == "the"
    request = urllib.request.Request(f"{api.url}/info?model=classifier", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        info = json.loads(response.read())
    assert info["model_type"]["classifier"]["id2label"] == {str(i): p["label"] for i, p in enumerate(
        sorted(labelled[0], key=lambda p: int(p["label"].split("_")[-1])))} and info["max_input_length"] > 0
    status, pair = _post(f"{api.url}/predict", {"inputs": [["a", "b"]]})
    assert status == 422 and pair["error_type"] == "Validation" and "reads one text" in pair["error"]


def test_cohere_v2_rerank_answers_as_v1_and_metrics_count_each_route(front):
    from prometheus_client.parser import text_string_to_metric_families

    api, *_ = front
    query = "where do cats sit?"
    _, v1 = _post(f"{api.url}/v1/rerank", {"model": "reranker", "query": query, "documents": TEXTS})
    status, v2 = _post(f"{api.url}/v2/rerank", {"model": "reranker", "query": query, "documents": TEXTS, "top_n": 2,
                                                "max_tokens_per_doc": 4096})
    assert status == 200 and v2["results"] == v1["results"][:2] and v2["meta"]["api_version"]["version"] == "2"
    status, short = _post(f"{api.url}/v2/rerank", {"model": "reranker", "query": query, "documents": TEXTS,
                                                   "max_tokens_per_doc": 3})
    assert status == 422 and short["error"]["param"] == "max_tokens_per_doc"
    with urllib.request.urlopen(f"{api.url}/metrics", timeout=10) as response:  # no key asked, as /health
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    counts = {(s.labels["route"], s.labels["status"]): s.value for s in families["workbench_front_requests"].samples
              if s.name.endswith("_total")}
    assert counts[("/v2/rerank", "200")] >= 1 and counts[("/v2/rerank", "422")] >= 1
    tokens = {s.labels["route"]: s.value for s in families["workbench_front_tokens"].samples
              if s.name.endswith("_total")}
    assert tokens["/v2/rerank"] == v1["usage"]["total_tokens"]  # the one v2 request that ran


def test_keys_are_parsed_as_written_and_a_taken_port_names_api_port(front, tmp_path):
    api, *_ = front
    assert parse_keys(" alpha , beta") == ["alpha", "beta"] and parse_keys("") == []
    for bad in (" , ", "alpha,,beta", "alpha,"):
        with pytest.raises(ValueError, match="empty key"):
            parse_keys(bad)
    with pytest.raises(PortInUseError, match="--api-port"):
        check_api_port(api.port, "127.0.0.1")
    with ApiFront(api.repository, f"127.0.0.1:{free_port()}", tmp_path / "keyed", api_key="alpha, beta") as keyed:
        for key, status in (("alpha", 503), ("beta", 503), ("gamma", 401), (None, 401)):  # 503: no Triton there
            assert _post(f"{keyed.url}/v1/embeddings", {"model": "embedder", "input": "a"}, key=key)[0] == status
    late = ApiFront(api.repository, f"127.0.0.1:{free_port()}", tmp_path / "late")
    late.port = api.port  # taken after the check (two serves at once): the front says so and exits
    with pytest.raises(ServerStartError, match="exited with code 3") as failed:
        late.start()
    assert "choose another --api-port" in str(failed.value) and late.process is None


def test_workers_share_one_port_and_their_metrics_and_die_with_their_supervisor(front, tmp_path):
    api, encoder, *_ = front
    with ApiFront(api.repository, api.triton_grpc, tmp_path / "many", api_key=KEY, workers=2) as many:
        supervisor = psutil.Process(many.process.pid)
        workers = supervisor.children()
        assert len(workers) == 2
        for _ in range(6):
            assert _post(f"{many.url}/v1/embeddings", {"model": "embedder", "input": "tea"})[0] == 200
        with urllib.request.urlopen(f"{many.url}/metrics", timeout=10) as response:
            text = response.read().decode()
        assert 'workbench_front_requests_total{route="/v1/embeddings",status="200"} 6.0' in text
        supervisor.kill()
        _, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, ([(p.status(), p.cmdline()[-6:], p.ppid()) for p in alive])


def test_a_split_request_sends_its_pieces_two_at_a_time():
    import asyncio

    running, most = 0, 0

    async def piece(index: int) -> int:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0)
        running -= 1
        return index
    answers = asyncio.run(bounded([lambda i=i: piece(i) for i in range(7)]))
    assert answers == list(range(7)) and most == 2

"""Rerankers: a CrossEncoder exported with pair inputs, its logits and the scores predict() returns, checked
against CrossEncoder.predict() on corpus pairs (a query with near and far documents), ranking included."""
from __future__ import annotations

import numpy as np
import pytest

from workbench.core.config import RunConfig, Tolerance
from workbench.core.data import load_corpus
from workbench.core.record import RunRecord
from workbench.graphs import onnxfiles
from workbench.models.errors import UnsupportedModelError
from workbench.models.text import encode
from workbench.models.tiny import build_cross_encoder
from workbench.precision.compare import OutputParity
from workbench.precision.ranking import NEIGHBOURS, by_query, lab_pairs, query_groups, ranking_agreement
from workbench.serving.client import TritonClient, rerank_arrays
from workbench.serving.errors import RepositoryError, ServedError
from workbench.serving.repository import configs, read_repository, write_repository
from workbench.serving.server import TritonServer
from workbench.steps import export, optimize, parity, triton
from workbench.steps.triton import serving_plan
from workbench.tasks.registry import TASKS, OutputSpec


@pytest.fixture(scope="module")
def rerankers(tmp_path_factory):
    """A one-label cross-encoder (sigmoid scores) and a three-label one (identity), each through export, optimize
    and parity."""
    root = tmp_path_factory.mktemp("rerank")
    runs = {}
    for labels in (1, 3):
        model = build_cross_encoder(root / f"reranker-{labels}", labels)
        config = RunConfig.model_validate({"model": str(model), "task": "rerank", "threads": 1,
                                           "optimize": {"openvino": "never"},
                                           "precisions": ["fp32"], "triton": {
                                               "repository_dir": str(root / "repositories"), "max_documents": 64,
                                               "max_text_chars": 5000}})
        record = RunRecord.create(root / f"run-{labels}", config)
        for step in (export, optimize, parity):
            step.run(config, record)
        runs[labels] = (model, config, record)
    return runs


def test_the_graph_returns_logits_and_the_scores_predict_returns(rerankers):
    from sentence_transformers import CrossEncoder

    for labels, (model, _, record) in rerankers.items():
        path = record.variant("fp32").path
        assert onnxfiles.io_shapes(onnxfiles.load(path))["outputs"] == {"logits": ["batch", labels],
                                                                       "scores": ["batch", labels]}
        pairs = [("a query about tea", "green tea is grown in the hills"), ("a query about tea", "the match ended")]
        import onnxruntime as ort

        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        feed = encode(record.tokenizer(), pairs, tuple(i.name for i in session.get_inputs()))
        logits, scores = session.run(["logits", "scores"], feed)
        want = CrossEncoder(str(model), device="cpu").predict(pairs)
        assert np.allclose(scores.reshape(want.shape), want, atol=1e-5)
        expected = 1 / (1 + np.exp(-logits)) if labels == 1 else logits
        assert np.allclose(scores, expected, atol=1e-6), "sigmoid for one label, the identity for three"


def test_parity_checks_predict_on_corpus_pairs_with_their_ranking(rerankers):
    _, _, record = rerankers[1]
    reference = record.metric("parity.reference")
    assert reference["checked"] and reference["library"] == "CrossEncoder.predict()"
    assert reference["reference"].startswith("CrossEncoder(") and reference["passed"]
    assert any(" || " in worst["text"] for worst in reference["worst_texts"]), "pairs shown as query || document"
    scores = record.metric("parity.variants.fp32.outputs.scores")
    assert scores["passed"] and scores["max_abs"] < 1e-5
    assert scores["ranking"]["queries"] == 16 and scores["ranking"]["agreement_at_1"] == 1.0
    three = rerankers[3][2].metric("parity.variants.fp32.outputs.scores")
    assert three["passed"] and "ranking" not in three, "three labels per pair: compared by label, not ranked"


def test_lab_pairs_hold_each_query_with_its_near_and_far_documents():
    texts = load_corpus()
    pairs = lab_pairs(texts)
    groups = query_groups(pairs)
    assert len(groups) == 16 and all(len(ids) == 8 for ids in groups)
    assert all(pairs[i][0] != pairs[i][1] for i in range(len(pairs)))
    def shared(pair):
        return len(set(pair[0].lower().split()) & set(pair[1].lower().split()))
    near = np.mean([shared(pairs[i]) for ids in groups for i in ids[:NEIGHBOURS]])
    far = np.mean([shared(pairs[i]) for ids in groups for i in ids[NEIGHBOURS:]])
    assert near > far, "the neighbours share more words with their query than the far documents"


def test_the_lab_regroups_a_rerankers_pairs_within_their_query_as_one_request_sends_them(rerankers):
    from functools import partial

    from workbench.models.batches import grouped_batches
    from workbench.models.loading import load_model
    from workbench.serving.plan import served_groups

    model, config, _ = rerankers[1]
    loaded = load_model(config)
    pairs = lab_pairs(load_corpus())
    requests = by_query(pairs)
    batches = grouped_batches(loaded.tokenizer, loaded.input_names, pairs, 128, partial(served_groups, max_tokens=0),
                              max(map(len, requests)), requests=requests)
    assert sorted(i for batch in batches for i in batch.text_ids) == list(range(len(pairs)))
    query_of = {i: number for number, ids in enumerate(requests) for i in ids}
    assert all(len({query_of[i] for i in batch.text_ids}) == 1 for batch in batches), "no batch mixes two queries"
    across = grouped_batches(loaded.tokenizer, loaded.input_names, pairs, 128, partial(served_groups, max_tokens=0),
                             config.batch.max)  # the embedding server's way: requests batched together
    assert any(len({query_of[i] for i in batch.text_ids}) > 1 for batch in across), "the test can tell them apart"


def test_ranking_agreement_and_its_gate():
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    want = {i: float(v) for i, v in enumerate([0.9, 0.5, 0.2, 0.1, 0.8, 0.7, 0.3, 0.1])}
    same = ranking_agreement(dict(want), want, groups)
    assert same == {"queries": 2, "agreement_at_1": 1.0, "kendall_tau": 1.0, "min_kendall_tau": 1.0}
    flipped = {**want, 4: 0.1, 7: 0.8}  # the second query's first and last documents swap
    swapped = ranking_agreement(flipped, want, groups)
    assert swapped["agreement_at_1"] == 0.5 and swapped["min_kendall_tau"] < 0 < swapped["kendall_tau"] < 1
    tied = {**want, 1: 0.9 - 4e-7}  # the reference's two best documents of the first query: 4e-7 apart
    assert ranking_agreement({**tied, 0: 0.9 - 4e-7, 1: 0.9}, tied, groups)["agreement_at_1"] == 1.0
    assert ranking_agreement({**want, 0: 0.5, 1: 0.9}, want, groups)["agreement_at_1"] == 0.5, "0.4 apart: a swap"
    spec = OutputSpec("scores", ("batch", "labels"), "scores")
    gated = OutputParity(spec, Tolerance(min_kendall_tau=0.8, min_agreement_at_1=0.9), groups)
    gated.add("b", list(range(8)), np.array([[flipped[i]] for i in range(8)], np.float32),
              np.array([[want[i]] for i in range(8)], np.float32), np.ones((8, 4)))
    summary = gated.summary()
    assert not summary.passed
    assert any(f.startswith("kendall tau") for f in summary.failures)
    assert any(f.startswith("agreement at 1 0.5000") for f in summary.failures)


def test_a_cross_encoder_folder_runs_rerank_by_default_and_is_refused_for_embeddings(rerankers):
    from workbench.preflight import check_model_limits

    model = rerankers[1][0]
    chosen = RunConfig(model=str(model)).task_choice
    assert chosen.name == "rerank" and "CrossEncoder" in chosen.reason
    check_model_limits(RunConfig(model=str(model)))
    with pytest.raises(UnsupportedModelError) as refused:
        check_model_limits(RunConfig(model=str(model), task="feature-extraction"))
    assert "-p task=rerank" in refused.value.fix
    assert "rerank" in TASKS and TASKS["rerank"].auto_class == "AutoModelForSequenceClassification"


@pytest.fixture(scope="module")
def served(rerankers, tmp_path_factory):
    """The one-label reranker's repository (at most 64 documents a request), served for the module."""
    root = tmp_path_factory.mktemp("served-rerank")
    model, config, record = rerankers[1]
    plan, _ = serving_plan(config, record)
    with TritonServer(write_repository(plan, root / "repository"), root / "server") as server:
        yield model, plan, server


def test_the_repository_is_one_python_model_taking_a_query_and_its_documents(served):
    _, plan, server = served
    parsed = read_repository(server.repository)[plan.name]
    assert parsed.backend == "python" and parsed.max_batch_size == 0
    assert [(i.name, list(i.dims), i.optional) for i in parsed.input] == [
        ("QUERY", [-1], False), ("DOCUMENTS", [-1], False), ("TOP_K", [1], True)]
    assert [o.name for o in parsed.output] == ["logits", "scores", "top_indices", "top_scores", "truncated"]
    assert parsed.parameters["max_documents"].string_value == "64"
    with pytest.raises(RepositoryError, match="triton.layout=fused"):
        configs(plan.__class__(**{**plan.__dict__, "layout": "ensemble"}))


def test_one_query_with_64_documents_is_scored_in_input_order_with_its_top_k(served):
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer

    from workbench.models.batches import token_lengths

    model, plan, server = served
    texts = load_corpus()
    query, documents = texts[3], list(texts[10:74])
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    want = CrossEncoder(str(model), device="cpu").predict([(query, d) for d in documents])
    for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
        with TritonClient(url, protocol) as client:
            got = client.rerank(plan.name, [query], documents, top_k=5)
        assert got["scores"].shape == (64, 1) and np.abs(got["scores"][:, 0] - want).max() < 1e-5
        assert list(got["top_indices"]) == list(np.argsort(-got["scores"][:, 0], kind="stable")[:5])
        assert np.allclose(got["top_scores"], want[got["top_indices"]], atol=1e-5)
        longer = token_lengths(tokenizer, [(query, d) for d in documents]) > plan.max_length
        assert list(got["truncated"]) == list(longer) and longer.any(), "flagged where the pair was cut"


def test_a_batch_of_pairs_is_one_query_per_document(served):
    from sentence_transformers import CrossEncoder

    model, plan, server = served
    pairs = lab_pairs(load_corpus())[:24]
    with TritonClient(server.http_url, "http") as client:
        got = client.rerank(plan.name, [q for q, _ in pairs], [d for _, d in pairs])
    want = CrossEncoder(str(model), device="cpu").predict(list(pairs))
    assert np.abs(got["scores"][:, 0] - want).max() < 1e-5


@pytest.mark.parametrize(("queries", "documents", "top_k", "message"), [
    (["q"], [], None, "DOCUMENTS is empty"),
    (["q"], ["d"] * 10_000, None, "10000 texts in DOCUMENTS; this deployment takes at most 64 in one request "
                                  "\\(triton.max_documents\\)"),
    (["q" * 5001], ["d"], None, "QUERY\\[0\\] has 5001 characters; this deployment takes at most 5000 in one "
                                "text \\(triton.max_text_chars\\)"),
    (["q", "r"], ["d", "e", "f"], None, "2 queries for 3 documents"),
    (["q"], ["d", "e"], 3, "TOP_K 3 is not between 1 and the 2 documents"),
    (["q"], ["d", ""], None, "DOCUMENTS\\[1\\] is empty"),
])
def test_bad_rerank_requests_are_refused_with_a_400_naming_the_problem(served, queries, documents, top_k, message):
    import tritonclient.http
    from tritonclient.utils import InferenceServerException

    _, plan, server = served
    client = tritonclient.http.InferenceServerClient(server.http_url.split("://")[-1])
    inputs = []
    for name, array in rerank_arrays(queries, documents, top_k).items():
        tensor = tritonclient.http.InferInput(name, list(array.shape), "INT64" if name == "TOP_K" else "BYTES")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    with pytest.raises(InferenceServerException, match=message) as info:
        client.infer(plan.name, inputs)
    assert str(info.value.status()) == "400"
    with TritonClient(server.grpc_url, "grpc") as grpc, pytest.raises(ServedError, match="DOCUMENTS"):
        grpc.infer(plan.name, {"QUERY": rerank_arrays(["q"], [])["QUERY"]})  # a query without documents
    assert server.is_ready()


def test_the_triton_step_serves_a_three_label_reranker_equal_to_predict(rerankers):
    _, config, record = rerankers[3]
    triton.run(config, record)
    served = record.metric("triton.served_parity")
    for protocol in ("http", "grpc"):
        scores = served[protocol]["outputs"]["scores"]
        assert served[protocol]["passed"] and scores["max_abs"] < 1e-5 and scores["agreement"] == 1.0
    assert record.metric("triton.served_reference").startswith("CrossEncoder(")


def test_the_bench_step_measures_a_served_reranker_in_requests_and_pairs_per_second(rerankers):
    from workbench.steps import bench
    from workbench.steps.bench import served_section

    _, config, record = rerankers[3]  # deployed by the triton step's test above
    quick = config.model_copy(update={"bench": config.bench.model_copy(update={
        "batches": [1], "sequences": [16], "rounds": 3, "concurrency": [1, 4], "requests_per_level": 8})})
    bench.run(quick, record)
    served = record.metric("bench.served")
    assert set(served["rerank"]) == {"n16", "n64"} and set(served["rerank"]["n64"]) == {"c1", "c4"}
    level = served["rerank"]["n64"]["c4"]
    assert level["errors"] == 0 and level["requests"] == 8 and level["documents"] == 64
    assert level["pairs_per_s"] == pytest.approx(level["throughput"] * 64, rel=1e-3)
    (title, text, figures), = served_section(record.results("bench"))
    assert "grpc" in text and figures


def test_the_peers_benchmark_client_reranks_over_http_json_as_predict_does(served):
    """benchmarks/peers.py --task rerank loads every server through these: the served reranker's JSON, a closed
    loop of a query with its documents per request, and accuracy against predict()."""
    from peerlib.peers import http_level, rerank_accuracy, rerank_all, triton_reranker
    from sentence_transformers import CrossEncoder

    from workbench.measure.load import request_texts

    model, plan, server = served
    texts = load_corpus()
    reranker = triton_reranker("ours", "fp32", server, plan.name)
    requests = [request_texts(texts, i, 6) for i in range(5)]
    assert requests[1][0] == texts[7] and len(requests[1]) == 7
    library = CrossEncoder(str(model), device="cpu")
    want = [library.predict([(r[0], d) for d in r[1:]]) for r in requests]
    found = rerank_accuracy(rerank_all(reranker, requests), want)
    assert found["max_abs"] < 1e-5 and found["texts"] == 5
    # random tiny weights score every pair about 0.499: a top is only certain where it leads by more than the error
    clear = sum(float(np.diff(np.sort(w)[-2:])[0]) > 2 * found["max_abs"] for w in want)
    assert clear >= 1 and found["same_top"] >= clear
    level = http_level(reranker, texts, 2, 6, 60, documents=6)
    assert level.requests == 6 and level.errors == 0


def test_workbench_serve_finds_the_reranker_and_its_printed_curl_answers_scores(served):
    import json
    import shlex
    import subprocess

    from workbench.serving.endpoints import curl_command, text_endpoints

    _, plan, server = served
    (endpoint,) = text_endpoints(server.repository)
    assert endpoint.model == plan.name and endpoint.reranks and endpoint.output == "scores"
    answer = json.loads(subprocess.run(shlex.split(curl_command(server.http_url, endpoint, "tea in the hills")),
                                       capture_output=True, text=True, check=True).stdout)
    scores = next(o for o in answer["outputs"] if o["name"] == "scores")
    assert scores["shape"] == [2, 1] and all(0 < value < 1 for value in scores["data"])


def test_a_reranker_verdict_is_summed_up_by_its_ranking_gate():
    """A one-label reranker's label agreement is 1.0 by construction: the line users read names the ranking
    criterion it fails by, not that."""
    from workbench.core.results import Verdict
    from workbench.report.recommend import gate

    verdict = Verdict.model_validate({"passed": False, "failures": ["scores: agreement at 1 0.6875 < 0.9"],
                                      "outputs": {"scores": {
                                          "passed": False, "max_abs": 1.9e-3, "agreement": 1.0,
                                          "tolerance": {"min_agreement": 0.95, "min_kendall_tau": 0.8,
                                                        "min_agreement_at_1": 0.9},
                                          "ranking": {"queries": 16, "agreement_at_1": 0.6875,
                                                      "kendall_tau": 0.824}}}})
    found = gate(verdict)
    assert found is not None and (found.metric, found.value, found.threshold) == ("agreement@1", 0.6875, 0.9)


@pytest.mark.parametrize("triton_settings", [{"layout": "ensemble"}, {"flavor": "onnxruntime"}])
def test_a_reranker_layout_that_cannot_serve_it_is_refused_before_the_run(triton_settings):
    from pydantic import ValidationError

    from workbench.serving.plan import choose_flavor

    with pytest.raises(ValidationError, match="task rerank is served by one Python model"):
        RunConfig.model_validate({"task": "rerank", "triton": triton_settings})
    assert choose_flavor("auto", "cuda", "rerank").value == "python-ort"

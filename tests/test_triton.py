"""A real tritonserver (the one bundled in nvidia-pytriton) serving generated repositories on 127.0.0.1."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import numpy as np
import psutil
import pytest
from peerlib.peers import accuracy, embed_all, http_level, triton_embedder

from workbench.core.config import RunConfig
from workbench.core.data import load_corpus
from workbench.core.record import RunRecord
from workbench.graphs import onnxfiles
from workbench.graphs.tables import PrecisionDecision
from workbench.measure.errors import UnstableMeasurementError
from workbench.measure.load import perf_analyzer_level, settled_stages, text_level
from workbench.measure.perf_analyzer import PerfAnalyzer
from workbench.models.batches import Batch, long_texts, token_lengths
from workbench.models.loading import load_model
from workbench.models.pins import pin
from workbench.models.text import encode
from workbench.models.tiny import build_encoder
from workbench.precision.tables import ParityMetrics
from workbench.runners.torch import TorchRunner
from workbench.serving.batching import observe_batching
from workbench.serving.client import AsyncTritonClient, TritonClient, text_array
from workbench.serving.errors import PortInUseError, RepositoryError, ServedError, ServerStartError, TritonNotFoundError
from workbench.serving.flavor import Flavor
from workbench.serving.repository import model_files, parse_pbtxt, read_repository, write_models, write_repository
from workbench.serving.server import Ports, TritonServer, find_tritonserver
from workbench.steps import export, optimize, triton
from workbench.steps.triton import serving_plan

pytestmark = pytest.mark.slow
SMALL = {"batch": {"min": 1, "opt": 4, "max": 8}, "sequence": {"min": 1, "opt": 32, "max": 64},
         "precisions": ["fp32"], "threads": 1}


def prepared(model, run_dir, repositories, triton_settings=None, **settings):
    config = RunConfig.model_validate({"model": str(model), **SMALL, **settings,
                                       "triton": {"repository_dir": str(repositories), **(triton_settings or {})}})
    record = RunRecord.create(run_dir, config)
    export.run(config, record)
    optimize.run(config, record)
    return config, record


def _serve(tiny_models, tmp_path_factory, layout):
    """Tiny BERT, python-ort flavor, in `layout`; one server for the module (stopped even when tests fail)."""
    root = tmp_path_factory.mktemp(f"triton-{layout}")
    both = {"outputs": ["token_embeddings", "sentence_embedding"], "layout": layout, "max_text_chars": 5000}
    config, record = prepared(tiny_models["bert"], root / "run", root / "repos", triton_settings=both)
    assert [o.name for o in serving_plan(config.model_copy(update={"triton": config.triton.model_copy(
        update={"outputs": None})}), record)[0].outputs] == ["sentence_embedding"], "embedding alone by default"
    plan, _ = serving_plan(config, record)
    assert plan.layout == layout
    repository = write_repository(plan, root / "repository")
    with TritonServer(repository, root / "server") as server:
        yield config, plan, server


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    """The ensemble layout: tokenizer -> model behind an ensemble."""
    yield from _serve(tiny_models, tmp_path_factory, "ensemble")


@pytest.fixture(scope="module")
def fused(tiny_models, tmp_path_factory):
    """The fused layout: one Python model tokenizes and runs ONNX Runtime."""
    yield from _serve(tiny_models, tmp_path_factory, "fused")


@pytest.fixture(params=["ensemble", "fused"])
def either(request):
    """Each layout in turn: what holds for both."""
    return request.getfixturevalue("served" if request.param == "ensemble" else "fused")


def test_configs_read_back_through_the_protobuf(served, fused):
    _, plan, server = served
    for process in server.group():  # where memory runs out, the server and its stubs go before the CLI
        assert Path(f"/proc/{process.pid}/oom_score_adj").read_text().strip() == "1000", process.cmdline()
    parsed = read_repository(server.repository)
    assert sorted(parsed) == [plan.name, plan.model_name, plan.tokenizer_name]
    model = parsed_model = parsed[plan.model_name]
    model_file = server.repository / plan.model_name / "1" / "model.onnx"
    assert model.backend == "python" and model.max_batch_size == 8
    assert list(model.dynamic_batching.preferred_batch_size) == [4, 8]
    assert all(i.allow_ragged_batch for i in model.input)
    assert model.parameters["intra_op_threads"].string_value == "1"
    assert int(model.parameters["max_tokens"].string_value) == plan.max_tokens > 0, "the batch token budget"
    assert [s.model_name for s in parsed[plan.name].ensemble_scheduling.step] == [plan.tokenizer_name, plan.model_name]
    assert [o.name for o in parsed[plan.tokenizer_name].output][-1] == "truncated"
    _, one, server = fused
    parsed = read_repository(server.repository)
    assert list(parsed) == [one.name] and one.working_models == (one.name,)
    model = parsed[one.name]
    assert model.backend == "python" and model.max_batch_size == 8 and not model.ensemble_scheduling.step
    assert list(model.dynamic_batching.preferred_batch_size) == [4, 8]
    assert [i.name for i in model.input] == ["TEXT"]
    assert [o.name for o in model.output] == [o.name for o in parsed_outputs(served)]
    assert sorted(p.name for p in (server.repository / one.name / "1").iterdir() if p.name != "__pycache__") == [
        "encoder.json", "labels.py", "model.onnx", "model.py", "ort_batches.py", "sparse_terms.py", "stages.py",
        "text_input.py",
        "tokenizer"]
    assert model.instance_group[0].count == 2 and model.parameters["intra_op_threads"].string_value == "1"
    for config, graph in ((parsed_model, model_file), (model, server.repository / one.name / "1" / "model.onnx")):
        given = config.parameters["disabled_optimizers"].string_value if "disabled_optimizers" in config.parameters \
            else ""  # the layer-norm form's: what the Python model's session leaves out
        assert given == ",".join(onnxfiles.disabled_optimizers(graph))


def parsed_outputs(served):
    """The ensemble's outputs, which the fused model answers too."""
    _, plan, server = served
    return read_repository(server.repository)[plan.name].output


def test_served_embeddings_match_pytorch_over_http_and_grpc(either, tiny_models):
    config, plan, server = either
    texts = list(load_corpus()[:6])
    loaded = load_model(config)
    feed = encode(loaded.tokenizer, texts, loaded.input_names, max_length=64)
    with TorchRunner(loaded, config.output_specs) as reference:
        want = reference.infer(Batch("texts", list(range(6)), feed))
    for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
        with TritonClient(url, protocol) as client:
            got = client.infer_texts(plan.name, texts)
        assert np.abs(got["sentence_embedding"] - want["sentence_embedding"]).max() < 1e-4, protocol
        assert got["token_embeddings"].shape == want["token_embeddings"].shape
        long = [len(ids) > 64 for ids in loaded.tokenizer(texts, verbose=False)["input_ids"]]
        assert got["truncated"].ravel().tolist() == long and any(long) and not all(long)


def test_one_http_json_client_for_every_server_and_the_model_stage_times(fused):
    """The peers benchmark's client path on a real server, and the fused model's own timing on its metrics port."""
    _, plan, server = fused
    texts = list(load_corpus()[:8])  # the tiny deployment's max_batch_size
    embedder = triton_embedder("ours", "fp32", server, plan.name, "sentence_embedding")
    before = settled_stages(server.metrics_url, plan.name)  # the module's server has answered other tests
    level = http_level(embedder, texts, 2, 20, 60)
    assert (level.requests, level.errors) == (20, 0) and level.p50 > 0
    with TritonClient(server.grpc_url) as client:
        want = client.infer_texts(plan.name, texts)["sentence_embedding"]
    got = embed_all(embedder, texts, batch=3)
    assert got.shape == want.shape and np.abs(got - want).max() < 1e-5
    assert accuracy(got, want)["min_cosine"] > 0.99999
    after = settled_stages(server.metrics_url, plan.name)  # every instance has sent its sums
    stages = {name: after[name] - before.get(name, 0.0) for name in after}
    assert set(stages) == {"decode", "tokenize", "infer", "respond", "executions"}
    sent = 2 + 20 + 1 + 3  # warm-up, the level, the gRPC reference, embed_all's (dynamic batching joins some)
    assert 1 <= stages["executions"] <= sent and all(value > 0 for value in stages.values())
    assert stages["infer"] > stages["decode"]
    assert embedder.rss() > 0


def test_asyncio_clients_and_dynamic_batching(either):
    _, plan, server = either

    async def many(protocol, url):
        client = AsyncTritonClient(url, protocol)
        try:
            return await asyncio.gather(*(client.infer_texts(plan.name, [f"text number {i}"]) for i in range(32)))
        finally:
            await client.close()

    for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
        answers = asyncio.run(many(protocol, url))
        assert len(answers) == 32 and all(a["sentence_embedding"].shape == (1, 32) for a in answers)
    sizes = burst_batch_sizes(plan, server.workdir.parent / "waiting")
    assert sum(size * count for size, count in sizes.items()) == 32
    assert max(sizes) > 1, f"no request was batched: {sizes}"


def burst_batch_sizes(plan, root) -> dict[int, int]:
    """32 concurrent requests to a copy of the deployment whose batcher waits up to 2 s for a preferred batch: on a
    busy machine requests may trickle in, and with no queue delay each could run alone (this checks the batcher
    forms batches, not how fast requests arrive)."""
    waiting = replace(plan, max_queue_delay_us=2_000_000)
    with TritonServer(write_repository(waiting, root / "repository"), root / "server") as server:
        burst = observe_batching(server, waiting, ["a short text", "another one"], concurrency=32)
    return burst.batch_sizes[plan.working_models[-1]]  # the network's model (the fused model is the only one)


def test_unstable_perf_analyzer_falls_back_to_asyncio(served, tmp_path):
    """perf_analyzer's 'no stable window' (a noisy 2-core host) costs the level its tool, not the whole run."""
    _, plan, server = served
    unstable = tmp_path / "perf_analyzer"
    unstable.write_text("#!/bin/sh\necho 'Failed to obtain stable measurement within 4 measurement windows.'\nexit 2\n")
    unstable.chmod(0o755)
    tool = PerfAnalyzer(unstable)
    with pytest.raises(UnstableMeasurementError, match="no stable window at concurrency 2"):
        perf_analyzer_level(tool, server.http_url, "http", plan.name, [{"TEXT": text_array(["a"])}], 2, 8, 5,
                            tmp_path / "pa")
    level = text_level(tool, server.grpc_url, plan.name, ["a text", "another text"], 2, 8, 5, tmp_path / "pa")
    assert level.tool == "asyncio" and "no stable window" in (level.note or "")
    assert level.requests >= 8 and level.errors == 0 and 0 < level.p50 <= level.p99


@pytest.mark.parametrize("texts, message", [
    ([""], "TEXT\\[0\\] is empty"),
    (["fine", ""], "TEXT\\[1\\] is empty"),
    ([b"\xff\xfe not utf-8"], "TEXT\\[0\\] is not valid UTF-8"),
    (["fine", "x" * 5001], "TEXT\\[1\\] has 5001 characters; this deployment takes at most 5000 in one text "
                           "\\(triton.max_text_chars\\)"),
])
def test_bad_text_is_refused_and_the_server_stays_healthy(either, texts, message):
    """The client's fault: HTTP 400 and gRPC INVALID_ARGUMENT, with the message naming the text."""
    import tritonclient.grpc
    import tritonclient.http
    from tritonclient.utils import InferenceServerException

    _, plan, server = either
    with TritonClient(server.http_url, "http") as client, pytest.raises(ServedError, match=message):
        client.infer_texts(plan.name, texts)
    for module, url, status in ((tritonclient.http, server.http_url, "400"),
                                (tritonclient.grpc, server.grpc_url, "StatusCode.INVALID_ARGUMENT")):
        tensor = module.InferInput("TEXT", [len(texts), 1], "BYTES")
        tensor.set_data_from_numpy(text_array(texts))
        with pytest.raises(InferenceServerException, match=message) as info:
            module.InferenceServerClient(url.split("://")[-1]).infer(plan.name, [tensor])
        assert str(info.value.status()) == status
    assert server.is_ready()


def test_a_bad_request_fails_alone_in_a_dynamic_batch(either):
    """A refused text fails its own request only: the requests batched with it are answered."""
    _, plan, server = either

    async def mixed():
        client = AsyncTritonClient(server.grpc_url, "grpc")
        try:
            texts = [[f"text number {i}"] if i % 4 else [b"\xff not utf-8"] for i in range(16)]
            return await asyncio.gather(*(client.infer_texts(plan.name, t) for t in texts), return_exceptions=True)
        finally:
            await client.close()

    answers = asyncio.run(mixed())
    refused = [i for i, a in enumerate(answers) if isinstance(a, ServedError)]
    assert refused == [0, 4, 8, 12] and all("not valid UTF-8" in str(answers[i]) for i in refused)
    assert all(answers[i]["sentence_embedding"].shape == (1, 32) for i in range(16) if i not in refused)


def test_long_text_is_truncated_and_says_so(either):
    _, plan, server = either
    with TritonClient(server.http_url, "http") as client:
        got = client.infer_texts(plan.name, ["word " * 500, "short"])
    assert got["truncated"].ravel().tolist() == [True, False]
    assert got["token_embeddings"].shape[1] == plan.max_length == 64


def test_a_body_that_is_not_json_is_answered_500_by_tritons_parser_as_documented(fused):
    """docs/triton.md says so (and why no front answers 400 instead): this fails when tritonserver changes it."""
    _, plan, server = fused
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/{plan.name}/infer", b"not json",
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    assert info.value.code == 500
    assert json.loads(info.value.read())["error"].startswith("failed to parse the request JSON buffer")
    assert server.is_ready()


def test_wrong_input_name_and_oversized_batch(either):
    _, plan, server = either
    with TritonClient(server.http_url, "http") as client:
        with pytest.raises(ServedError, match="TXT"):
            client.infer(plan.name, {"TXT": np.array([[b"hello"]], dtype=object)})
        with pytest.raises(ServedError, match="batch"):
            client.infer_texts(plan.name, ["hello"] * (plan.max_batch_size + 1))
    assert server.is_ready()


def _group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_stop_leaves_no_process_and_frees_the_ports(served, tmp_path):
    _, _, running = served
    server = TritonServer(running.repository, tmp_path)
    with server:
        pid, ports = server.process.pid, server.ports
    left = [p for p in psutil.process_iter(["status"]) if _group(p.pid) == pid
            and p.info["status"] != psutil.STATUS_ZOMBIE]
    assert not left, "neither the server nor its Python-backend stubs are left"
    for port in (ports.http, ports.grpc, ports.metrics):
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # closed connections may linger in TIME_WAIT
            sock.bind(("127.0.0.1", port))


def test_a_port_whose_last_connection_lingers_is_free(tmp_path):
    """After a client talked to a server that then stopped, its port sits in TIME_WAIT: a restart may bind it."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()  # the server side closes first: its end of the connection lingers in TIME_WAIT
        client.close()
    assert Ports.pick(http=port).http == port


def test_port_in_use_is_named(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"HTTP port {port} on 127.0.0.1 is already in use"):
            Ports.pick(http=port)


def test_missing_tritonserver_names_the_fix(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setitem(sys.modules, "pytriton", None)
    with pytest.raises(TritonNotFoundError, match="pip install nvidia-pytriton"):
        find_tritonserver()


def test_a_model_the_server_cannot_load_fails_with_its_log(served, tmp_path):
    config, plan, _ = served
    broken = tmp_path / "repository"
    (broken / "m" / "1").mkdir(parents=True)
    (broken / "m" / "config.pbtxt").write_text('name: "m"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 1\n')
    with pytest.raises(ServerStartError, match="(?s)exited with code.*onnxruntime"):
        TritonServer(broken, tmp_path / "server", ready_timeout=60).start()


def test_misspelled_config_is_refused_with_a_position():
    with pytest.raises(RepositoryError, match="1:1"):
        parse_pbtxt('nmae: "x"\n')
    with pytest.raises(RepositoryError, match="KIND_TPU"):
        parse_pbtxt('name: "x"\ninstance_group { kind: KIND_TPU }\n')


def test_user_folders_are_never_overwritten(served, tmp_path):
    _, plan, _ = served
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(RepositoryError, match="not generated by this workbench"):
        write_repository(plan, target)
    assert (target / "notes.txt").read_text() == "mine"
    ours = write_repository(plan, tmp_path / "ours")
    write_repository(plan, ours)  # ours and untouched: regenerated in place
    (ours / plan.working_models[0] / "config.pbtxt").write_text("edited")
    with pytest.raises(RepositoryError, match="was edited"):
        write_repository(plan, ours)
    write_repository(plan, ours, overwrite=True)


def test_gpu_flavors_generate_valid_configs(served, tmp_path):
    _, plan, _ = served
    from dataclasses import replace

    onnx_gpu = replace(plan, flavor=Flavor.ONNXRUNTIME, gpu=True, gpu_accelerator="tensorrt", fp16=True,
                       pad_to=[32, 64])
    trt = replace(plan, flavor=Flavor.TENSORRT_PLAN, gpu=True, profiles=2, pad_to=[32, 64], model_file=plan.model_file)
    parsed = read_repository(write_repository(onnx_gpu, tmp_path / "ort"))
    model = parsed[plan.model_name]
    assert model.platform == "onnxruntime_onnx" and model.instance_group[0].kind == model.instance_group[0].KIND_GPU
    accelerator = model.optimization.execution_accelerators.gpu_execution_accelerator[0]
    assert accelerator.name == "tensorrt" and accelerator.parameters["precision_mode"] == "FP16"
    assert parsed[plan.tokenizer_name].parameters["pad_to"].string_value == "32,64"
    engine = read_repository(write_repository(trt, tmp_path / "trt"))[plan.model_name]
    with pytest.raises(RepositoryError, match="fused layout runs in Triton's Python backend"):
        write_repository(replace(onnx_gpu, layout="fused"), tmp_path / "fused-on-gpu")
    assert engine.platform == "tensorrt_plan" and [list(g.profile) for g in engine.instance_group] == [["0"], ["1"]]
    assert not engine.model_warmup


def test_triton_step_end_to_end(tiny_models, tmp_path):
    config, record = prepared(tiny_models["bert-seqcls"], tmp_path / "run", tmp_path / "repos",
                              task="sequence-classification")
    metrics = triton.run(config, record).metrics
    assert record.data["steps"]["triton"]["status"] == "ok", record.data["steps"]["triton"]
    assert metrics["verified"] and metrics["verification"]["by"] == "triton step", "no parity step ran before it"
    assert metrics["candidates"][0] == metrics["variant"] and set(metrics["candidates"]) <= set(record.variant_names())
    for protocol in ("http", "grpc"):
        served_parity = metrics["served_parity"][protocol]
        assert served_parity["passed"] and served_parity["outputs"]["logits"]["agreement"] == 1.0
    assert metrics["layout"] == "fused" and metrics["models"] == [metrics["name"]], "python-ort serves fused (auto)"
    assert (tmp_path / "repos" / metrics["name"] / metrics["name"] / "config.pbtxt").is_file()
    assert metrics["ready_seconds"] > 0 and metrics["stop_seconds"] > 0
    # The deployment image's ONNX Runtime comes with the CUDA and cuDNN wheels it is built for (tests/test_deploy.py).
    assert pin("transformers").startswith("transformers==")
    assert pin("onnxruntime-gpu").startswith("onnxruntime-gpu[cuda,cudnn]==")


@pytest.mark.parametrize("layout", ["ensemble", "fused"])
def test_labels_and_scores_come_back_for_classification(tiny_models, tmp_path, layout):
    config, record = prepared(tiny_models["bert-seqcls"], tmp_path / "run", tmp_path / "repos",
                              task="sequence-classification", triton_settings={"layout": layout})
    plan, _ = serving_plan(config, record)
    texts = list(load_corpus()[:5])
    loaded = load_model(config)
    feed = encode(loaded.tokenizer, texts, loaded.input_names)
    with TorchRunner(loaded, config.output_specs) as reference:
        logits = reference.infer(Batch("texts", list(range(5)), feed))["logits"]
    with TritonServer(write_repository(plan, tmp_path / "repository"), tmp_path / "server") as server:
        with TritonClient(server.http_url, "http") as client:
            got = client.infer_texts(plan.name, texts)
    labels = [loaded.hf_config.id2label[i] for i in logits.argmax(axis=1)]
    assert [x.decode() for x in got["label"].ravel()] == labels
    probabilities = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert np.allclose(got["score"].ravel(), probabilities.max(axis=1), atol=1e-4)


def multi_label_classifier(dest: Path, labels: int = 5) -> Path:
    """A tiny BERT classifier whose config says problem_type multi_label_classification (wide random weights, std
    0.2: its sigmoid scores lie far enough from 0.5 that float rounding moves no label across it)."""
    model = build_encoder(dest, "bert", "sequence-classification", labels=labels, initializer_range=0.2)
    settings = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**settings, "problem_type": "multi_label_classification"}))
    return model


def test_a_multi_label_classifier_is_served_with_every_labels_sigmoid_score_and_the_labels_above_one_half(tmp_path):
    model = multi_label_classifier(tmp_path / "multi")
    config, record = prepared(model, tmp_path / "run", tmp_path / "repos", task="sequence-classification")
    metrics = triton.run(config, record).metrics
    assert metrics["head"] == "sigmoid" and metrics["verified"], metrics.get("served_parity")
    assert "sigmoid: every label's score, and the labels above 0.5" in "\n".join(triton.lines(record))
    for protocol in ("http", "grpc"):  # gated on the served score against the pipeline's, not on the logits alone
        served = metrics["served_parity"][protocol]
        score = served["outputs"]["score"]
        assert served["passed"] and score["gated"] and score["passed"], served
        assert score["max_abs"] < 1e-5 and score["compared_values"] > 100
    texts = list(load_corpus()[:8])  # one request: batch.max texts
    loaded = load_model(config)
    feed = encode(loaded.tokenizer, texts, loaded.input_names, max_length=loaded.sequence.max)  # cut as served
    with TorchRunner(loaded, config.output_specs) as reference:
        logits = reference.infer(Batch("texts", list(range(len(texts))), feed))["logits"]
    expected = 1 / (1 + np.exp(-logits.astype(np.float64)))
    clear = np.abs(expected - 0.5) > 1e-4  # labels compared where rounding (max_abs < 1e-5 above) cannot move them
    assert clear.mean() > 0.9, "the wide weights put most scores away from the threshold"
    names = [loaded.hf_config.id2label[i] for i in range(5)]
    wanted = [[name if p > 0.5 else "" for name, p in zip(names, row)] for row in expected]
    assert any(sum(map(bool, row)) >= 2 for row in wanted) and any(not all(row) for row in wanted)
    plan, _ = serving_plan(config, record)
    plans = [replace(plan, name=f"multi_{layout}", layout=layout) for layout in ("fused", "ensemble")]
    repository = write_models({name: models for p in plans for name, models in model_files(p).items()},
                              tmp_path / "repository")
    assert read_repository(repository)["multi_ensemble_postprocess"].output[1].dims == [5]
    with TritonServer(repository, tmp_path / "server") as server, TritonClient(server.http_url, "http") as client:
        for served in plans:
            got = client.infer_texts(served.name, texts)
            assert got["score"].shape == (len(texts), 5) and got["label"].shape == (len(texts), 5)
            assert np.allclose(got["score"], expected, atol=1e-5), served.layout
            labels = [[label.decode() for label in row] for row in got["label"]]
            assert [[a for a, c in zip(row, keep) if c] for row, keep in zip(labels, clear)] == \
                [[w for w, c in zip(row, keep) if c] for row, keep in zip(wanted, clear)], served.layout


def test_the_cpu_serving_order_follows_the_measured_int8_decision_else_the_cpus_instructions():
    from workbench.core.results import CpuFeatures
    from workbench.serving.plan import CPU_FP32_FIRST, CPU_INT8_FIRST, preference

    slow = PrecisionDecision(built=False, pays=False, reason="does not pay on this host: 0.95x fp32 at b1 s16")
    order, why = preference(Flavor.PYTHON_ORT, slow, CpuFeatures(int8_dot_product="AMX"))
    assert order == CPU_FP32_FIRST and why == f"fp32 first: int8 {slow.reason}", "the measurement beats the flags"
    fast = PrecisionDecision(built=True, pays=True, reason="pays on this host: 1.3x fp32 at b8 s128")
    order, why = preference(Flavor.PYTHON_ORT, fast, CpuFeatures(int8_dot_product=None))
    assert order == CPU_INT8_FIRST and why == f"int8 first: int8 {fast.reason}"
    order, why = preference(Flavor.PYTHON_ORT, None, CpuFeatures())  # a record without the decision
    assert order == CPU_FP32_FIRST and "no int8 dot-product instructions" in why
    order, why = preference(Flavor.PYTHON_ORT, None, CpuFeatures(int8_dot_product="AMX"))
    assert order == CPU_INT8_FIRST and why == "int8 first: this CPU has AMX"


def test_a_repaired_int8_that_lost_its_race_is_served_after_the_variant_it_lost_to(tiny_bert, tmp_path):
    from workbench.core.results import CpuFeatures, Verdict
    from workbench.graphs.tables import Trial
    from workbench.serving.plan import CPU_INT8_FIRST, candidates, lost_races, preference

    fast = PrecisionDecision(built=True, pays=True, reason="pays on this host: 1.41x fp32 at b8 s128")
    lost = {"int8_repaired": "fp32"}
    order, why = preference(Flavor.PYTHON_ORT, fast, CpuFeatures(), lost)
    assert order == tuple(v for v in CPU_INT8_FIRST if v != "int8_repaired")[:-1] + ("int8_repaired", "original")
    assert why.endswith("; int8_repaired after fp32: it was not clearly faster (metrics.parity.repair)")
    assert preference(Flavor.PYTHON_ORT, fast, CpuFeatures(), {"int8_repaired": "gone"})[0] == CPU_INT8_FIRST
    verdicts = {"fp32": Verdict(passed=True), "int8": Verdict(passed=False), "int8_repaired": Verdict(passed=True)}
    available = set(verdicts) | {"original"}
    assert candidates(available, verdicts.get, Flavor.PYTHON_ORT, None, fast)[:2] == ["int8_repaired", "fp32"]
    assert candidates(available, verdicts.get, Flavor.PYTHON_ORT, None, fast, lost)[:2] == ["fp32", "int8_repaired"]
    assert candidates(available, verdicts.get, Flavor.PYTHON_ORT, "int8_repaired", fast, lost) == ["int8_repaired"]

    record = RunRecord.create(tmp_path / "run", RunConfig(model=str(tiny_bert)))
    assert lost_races(record.results_of(ParityMetrics)) == {}
    race = Trial(against="fp32", ms={"fp32": {"b1 s16": 6.71}, "int8_repaired": {"b1 s16": 8.57}}, kept=False,
                 reason="served after fp32: faster than the fp32 graph at one cell, slower at another")
    record.set_metric("parity.repair.int8", {"precision": "int8", "outcome": "repaired", "units": 27,
                                             "race": race.recorded()})
    record.set_metric("parity.repair.openvino_int8", {"precision": "int8", "outcome": "repaired", "units": 39,
                                                      "race": Trial(against="fp32", kept=True).recorded()})
    assert lost_races(record.results_of(ParityMetrics)) == lost


def test_a_request_of_32_texts_at_8000_tokens_runs_within_the_token_budget(tmp_path):
    """A tiny model with 8192 positions: one request of 32 texts of about 8,000 tokens (unbounded, its attention
    scores alone would be 32 GB) runs one text at a time within batch.max_tokens, each answer the text's own alone,
    and the server stays far below what the whole request would hold."""
    from workbench.models.tiny import build_sentence_encoder

    model = build_sentence_encoder(tmp_path / "long", dense=None, normalize=True, positions=8192, max_seq_length=8192)
    config, record = prepared(model, tmp_path / "run", tmp_path / "repos", triton_settings={
        "max_text_chars": 10**6, "max_request_tokens": 300_000}, sequence={"min": 1, "opt": 64, "max": 8192},
        batch={"min": 1, "opt": 4, "max": 32})
    plan, _ = serving_plan(config, record)
    assert plan.max_tokens == 8192, "auto: one text at sequence.max"
    assert config.triton.model_copy(update={"max_request_tokens": "auto"}).request_tokens(8192, 8192) == 32768, \
        "by default such a request is refused: 4 model calls at the most"
    repository = write_repository(plan, tmp_path / "repository")
    parameters = read_repository(repository)[plan.name].parameters
    assert parameters["max_tokens"].string_value == "8192" and parameters["max_request_tokens"].string_value == \
        "300000"
    loaded = load_model(config)
    texts = long_texts(loaded.tokenizer, load_corpus(), [8000] * 32)
    lengths = token_lengths(loaded.tokenizer, list(texts))
    assert len(set(texts)) == 32 and 8000 <= min(lengths), "past 8192 the served model cuts them, as PyTorch does"
    peak = [0]
    with TritonServer(repository, tmp_path / "server") as server, TritonClient(server.grpc_url) as client:
        idle = server.rss_bytes()
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.1):
                peak[0] = max(peak[0], server.rss_bytes())

        watcher = threading.Thread(target=sample)
        watcher.start()
        try:
            whole = client.infer_texts(plan.name, list(texts))["sentence_embedding"]
        finally:
            done.set()
            watcher.join()
        alone = np.concatenate([client.infer_texts(plan.name, [text])["sentence_embedding"] for text in texts])
    np.testing.assert_allclose(whole, alone, atol=1e-5)
    unbounded = 32 * 4 * 8000**2 * 4  # the whole request's attention scores in one layer: 4 heads, fp32
    assert peak[0] - idle < unbounded / 8, f"{(peak[0] - idle) / 2**30:.1f} GiB over idle"


def test_repositories_publish_where_the_setting_else_the_variable_else_the_project_says(monkeypatch, tmp_path):
    from workbench.serving.plan import PROJECT_REPOSITORIES, repository_root
    from workbench.serving.settings import REPOSITORY_VARIABLE

    monkeypatch.delenv(REPOSITORY_VARIABLE, raising=False)
    assert repository_root(None) == PROJECT_REPOSITORIES
    monkeypatch.setenv(REPOSITORY_VARIABLE, str(tmp_path / "scratch"))
    assert repository_root(None) == tmp_path / "scratch"
    assert repository_root(str(tmp_path / "set")) == tmp_path / "set"

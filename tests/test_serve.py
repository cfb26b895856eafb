"""`workbench serve`: a real tritonserver until a signal, printing URLs and commands that work as printed."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import psutil
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from workbench.cli import main
from workbench.core.config import RunConfig
from workbench.core.errors import ConfigError, MissingArtifactError
from workbench.core.record import RunRecord
from workbench.measure.perf_analyzer import find_perf_analyzer, write_wrapper
from workbench.models.batches import Batch
from workbench.models.loading import load_model
from workbench.models.text import encode
from workbench.runners.torch import TorchRunner
from workbench.serve import check_host, exposure_warning, pick_ports, run_repository
from workbench.serving.client import TritonClient
from workbench.serving.endpoints import SAMPLE_TEXT, curl_command, text_endpoints
from workbench.serving.errors import PortInUseError, RepositoryError, ServedError, ServerStartError
from workbench.serving.repository import ServingPlan, write_models, write_repository
from workbench.serving.server import TritonBinary, TritonServer
from workbench.steps import export, optimize
from workbench.steps.triton import serving_plan

SMALL = {"batch": {"min": 1, "opt": 4, "max": 8}, "sequence": {"min": 1, "opt": 32, "max": 64},
         "precisions": ["fp32"], "threads": 1}


# ---- refused before any server starts ------------------------------------------------------------------------------
def test_a_run_without_a_triton_step_is_refused_naming_the_step(tmp_path, capsys):
    record = RunRecord.create(tmp_path / "run", RunConfig())
    with record.step("export"):
        pass
    assert main(["serve", "--run", str(tmp_path / "run")]) == 2
    error = capsys.readouterr().err
    assert "MissingArtifactError" in error and "(its triton step: not run)" in error
    assert f"workbench run --resume --output-dir {tmp_path / 'run'} --steps triton" in error
    with pytest.raises(RuntimeError), record.step("triton"):
        raise RuntimeError("the server never came up")
    with pytest.raises(MissingArtifactError, match="triton step: failed: RuntimeError: the server never came up"):
        run_repository(tmp_path / "run")


def test_a_missing_or_foreign_repository_is_refused(tmp_path, capsys):
    assert main(["serve", "--repository", str(tmp_path / "nowhere")]) == 2
    assert re.search(r"RepositoryError.*nowhere does not exist", capsys.readouterr().err)
    plain = tmp_path / "plain" / "m"
    plain.mkdir(parents=True)
    (plain / "config.pbtxt").write_text('name: "m"\nbackend: "python"\n')
    assert main(["serve", "--repository", str(tmp_path / "plain")]) == 2
    assert "holds no model that takes a TEXT input (or a reranker's QUERY and DOCUMENTS) from clients" in \
        capsys.readouterr().err
    assert main(["serve", "--run", str(tmp_path / "plain")]) == 2
    assert "run.json does not exist" in capsys.readouterr().err


def test_each_text_model_gets_a_request_for_its_answer(tmp_path):
    for name, outputs in (("cls", ["logits", "label", "score", "truncated"]),
                          ("emb", ["sentence_embedding", "truncated"]), ("states", ["token_embeddings", "truncated"])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.pbtxt").write_text(
            f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: 8\n'
            'input { name: "TEXT" data_type: TYPE_STRING dims: 1 }\n'
            + "".join(f'output {{ name: "{o}" data_type: TYPE_FP32 dims: 1 }}\n' for o in outputs))
    (tmp_path / "fused").mkdir()  # a fused one-hop model takes text itself; a tokenizer behind an ensemble does not
    (tmp_path / "fused" / "config.pbtxt").write_text(
        'name: "fused"\nbackend: "python"\nmax_batch_size: 8\ninput { name: "TEXT" data_type: TYPE_STRING dims: 1 }\n'
        'output { name: "sentence_embedding" data_type: TYPE_FP32 dims: 4 }\n')
    (tmp_path / "emb_tokenizer").mkdir()
    (tmp_path / "emb_tokenizer" / "config.pbtxt").write_text(
        'name: "emb_tokenizer"\nbackend: "python"\ninput { name: "TEXT" data_type: TYPE_STRING dims: 1 }\n')
    emb = tmp_path / "emb" / "config.pbtxt"
    emb.write_text(emb.read_text() + 'ensemble_scheduling { step { model_name: "emb_tokenizer" model_version: -1 } }\n')
    endpoints = text_endpoints(tmp_path)
    assert [(e.model, e.shape, e.output) for e in endpoints] == [
        ("cls", [1, 1], "label"), ("emb", [1, 1], "sentence_embedding"), ("fused", [1, 1], "sentence_embedding"),
        ("states", [1, 1], "token_embeddings")]
    curl = shlex.split(curl_command("127.0.0.1:8000", endpoints[0], "it's a text"))
    assert curl[:3] == ["curl", "-s", "http://127.0.0.1:8000/v2/models/cls/infer"]
    assert json.loads(curl[-1]) == {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1],
                                                "data": ["it's a text"]}]}


def test_a_run_serves_its_published_repository_while_it_holds_what_the_run_checked(tmp_path, capsys):
    record = RunRecord.create(tmp_path / "run", RunConfig())
    files = {"m": (mc.ModelConfig(name="m"), {"model.onnx": b"the graph parity checked"})}
    run_copy = write_models(files, tmp_path / "run" / "model_repository" / "m", about={"name": "m"})
    published = write_models(files, tmp_path / "repos" / "m",
                             about={"name": "m", "run": str((tmp_path / "run").resolve())})  # as the triton step does
    with record.step("triton"):
        record.add_artifact("triton.repository", run_copy, kind="triton-repository")
        record.set_metric("triton", {"repository": str(published), "published": True})
    assert run_repository(tmp_path / "run") == published
    model = run_copy / "m" / "1" / "model.onnx"
    model.write_bytes(b"another valid graph")  # the run's copy replaced: the published one still holds what ran
    assert run_repository(tmp_path / "run") == published
    other = {"m": (mc.ModelConfig(name="m"), {"model.onnx": b"a later run's graph"})}
    write_models(other, published, about={"name": "m", "run": "a later run"})  # republished by another run
    with pytest.raises(RepositoryError, match=r"m/1/model.onnx changed since the triton step wrote it") as refused:
        run_repository(tmp_path / "run")
    assert "--resume --output-dir" in refused.value.fix and "--steps triton" in refused.value.fix
    model.write_bytes(b"the graph parity checked")
    assert run_repository(tmp_path / "run") == run_copy
    assert f"note: {published} no longer holds what this run checked" in capsys.readouterr().err


def test_other_hosts_get_a_loud_warning_and_unknown_addresses_are_refused():
    warning = exposure_warning("0.0.0.0")
    assert warning.startswith("WARNING:") and "every network interface" in warning and "127.0.0.1" in warning
    assert exposure_warning("127.0.0.1") is None
    assert "The API front asks for no key either" in exposure_warning("0.0.0.0", open_front=True)
    for host in ("localhost.invalid", "192.0.2.1"):  # not an address; not one of this machine's (TEST-NET-1)
        with pytest.raises(ConfigError, match=f"--host {host} is not an IPv4 address of this machine"):
            check_host(host)


def test_taken_or_repeated_ports_name_the_options(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"(?s)HTTP port {port} on 127.0.0.1 is already in use.*--http-port"):
            pick_ports(port, 0, 0, "127.0.0.1")
    with pytest.raises(ConfigError, match="(?s)must differ.*0 picks a free one"):
        pick_ports(port, port, 0, "127.0.0.1")
    assert len(set(vars(pick_ports(0, 0, 0, "127.0.0.1")).values())) == 3


def test_the_perf_analyzer_wrapper_sets_the_library_path_and_passes_arguments(tmp_path):
    binary = tmp_path / "tools dir" / "perf_analyzer"
    binary.parent.mkdir()
    binary.write_text('#!/bin/sh\necho "$LD_LIBRARY_PATH"\nfor a in "$@"; do echo "[$a]"; done\n')
    binary.chmod(0o755)
    wrapper = write_wrapper(tmp_path / "bin" / "perf_analyzer", binary, tmp_path / "tools dir" / "lib")
    env = {**os.environ, "LD_LIBRARY_PATH": "/elsewhere"}
    out = subprocess.run([str(wrapper), "-m", "a model"], capture_output=True, text=True, env=env, check=True).stdout
    assert out.splitlines() == [f"{tmp_path / 'tools dir' / 'lib'}:/elsewhere", "[-m]", "[a model]"]
    assert os.access(wrapper, os.X_OK)


# ---- a real server -------------------------------------------------------------------------------------------------
def _alive(pids: set[int], groups: set[int]) -> list[psutil.Process]:
    left = []
    for process in psutil.process_iter(["status"]):
        try:
            if (process.pid in pids or os.getpgid(process.pid) in groups) and \
                    process.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(process)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return left


def _wait_for(condition, what: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.2)


def _kill_leftovers(serve: subprocess.Popen, server_groups: set[int]) -> None:
    """After a failure: the serve's group while it runs, and a tritonserver's group while it leads it."""
    if serve.poll() is None:
        os.killpg(serve.pid, signal.SIGKILL)
    serve.wait()
    for group in server_groups:
        try:
            if "tritonserver" in psutil.Process(group).name() and os.getpgid(group) == group:
                os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass


def _printed(lines: list[str], label: str) -> str:
    """The command printed on the line after the one that starts with `label`."""
    return lines[next(i for i, line in enumerate(lines) if line.startswith(label)) + 1].strip()


@pytest.fixture(scope="module")
def published(tiny_models, tmp_path_factory) -> tuple[RunConfig, ServingPlan, Path]:
    """Tiny BERT exported, optimized and written as a repository."""
    root = tmp_path_factory.mktemp("serve")
    config = RunConfig.model_validate({"model": str(tiny_models["bert"]), **SMALL,
                                       "triton": {"repository_dir": str(root / "repos")}})
    record = RunRecord.create(root / "run", config)
    export.run(config, record)
    optimize.run(config, record)
    plan, _ = serving_plan(config, record)
    return config, plan, write_repository(plan, root / "repository")


def _serve(repository: Path) -> tuple[subprocess.Popen, list[str], int]:
    """`workbench serve` in a session of its own, its lines up to "Ctrl-C ...", and its server's PID."""
    command = [sys.executable, "-m", "workbench", "serve", "--repository", str(repository),
               "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--api-port", "0"]
    serve = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    lines = []
    for line in serve.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("Ctrl-C"):
            break
    assert lines and lines[-1].startswith("Ctrl-C"), (lines, serve.stderr.read() if serve.poll() else "")
    return serve, lines, int(re.match(r"tritonserver \(pid (\d+)\) serves ", lines[0]).group(1))


@pytest.mark.slow
def test_serve_killed_with_sigkill_takes_its_server_and_folder_along(published):
    serve, lines, server_pid = _serve(published[2])
    try:
        server = psutil.Process(server_pid)
        folder = Path(next(a for a in server.cmdline() if a.startswith("--backend-directory=")).split("=", 1)[1]
                      ).parent
        stubs = {p.pid for p in server.children(recursive=True)}
        assert folder.name.startswith("workbench-serve-") and folder.is_dir() and stubs
        http = int(re.search(r"HTTP:\s+http://127.0.0.1:(\d+)", "\n".join(lines)).group(1))
        front = int(re.search(r"API: http://127.0.0.1:(\d+)/v1 \(pid (\d+)", "\n".join(lines)).group(2))
        serve.send_signal(signal.SIGKILL)
        serve.wait()
        _wait_for(lambda: not _alive({server_pid, *stubs, front}, {server_pid, front}),
                  "the server, its stubs and the API front gone", 60)
        _wait_for(lambda: not folder.exists(), f"{folder} removed", 10)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", http), timeout=2).close()
    finally:
        _kill_leftovers(serve, {server_pid})


@pytest.mark.slow
def test_serve_answers_the_printed_requests_and_stops_cleanly_on_sigterm(published):
    config, plan, repository = published
    serve, lines, server_pid = _serve(repository)
    watchdog = threading.Timer(600, serve.kill)  # a hung serve fails the test instead of hanging it
    watchdog.start()
    groups = {serve.pid, server_pid}
    try:
        urls = dict(re.match(r"\s+(\w+):\s+(\S+)", line).groups() for line in lines[1:5])
        assert urls["HTTP"].startswith("http://127.0.0.1:") and urls["gRPC"].startswith("127.0.0.1:")

        curl = _printed(lines, f"one text through {plan.name} (its answer: sentence_embedding):")
        assert curl.startswith("curl ")
        answer = json.loads(subprocess.run(curl, shell=True, capture_output=True, text=True, check=True,
                                           timeout=120).stdout)
        outputs = {o["name"]: o for o in answer["outputs"]}
        assert outputs["truncated"]["data"] == [False]
        output = outputs["sentence_embedding"]
        loaded = load_model(config)
        with TorchRunner(loaded, config.output_specs) as reference:
            want = reference.infer(Batch("sample", [0], encode(loaded.tokenizer, [SAMPLE_TEXT], loaded.input_names,
                                                               max_length=64)))["sentence_embedding"]
        width = plan.output_dims["sentence_embedding"]
        assert output["name"] == "sentence_embedding" and output["shape"] == [1, *width] == list(want.shape)
        assert np.abs(np.asarray(output["data"]) - want.ravel()).max() < 1e-4
        with TritonClient(urls["gRPC"], "grpc") as client:
            assert client.infer_texts(plan.name, [SAMPLE_TEXT])["sentence_embedding"].shape == want.shape
        front = json.loads(subprocess.run(_printed(lines, f"embed a text with {plan.name}"), shell=True,
                                          capture_output=True, text=True, check=True, timeout=120).stdout)
        assert front["model"] == plan.name and front["usage"]["prompt_tokens"] > 0
        assert np.abs(np.asarray(front["data"][0]["embedding"]) - want.ravel()).max() < 1e-4
        start = lines.index("the same from Python, with the openai client:") + 1
        client, call = "\n".join(line.strip() for line in lines[start:start + 2]), lines[start + 2].strip()
        printed = subprocess.run([sys.executable, "-c", f"{client}\nprint({call})"], capture_output=True, text=True,
                                 check=True, timeout=120).stdout
        assert np.abs(np.asarray(json.loads(printed)) - want.ravel()).max() < 1e-4
        with urllib.request.urlopen(urls["metrics"], timeout=30) as response:
            assert b"nv_inference_request_success" in response.read()

        measure = _printed(lines, "latency and throughput at concurrency 1")
        if find_perf_analyzer() is not None:  # it ran as printed: a measurement, or the host was too noisy for one
            done = subprocess.run(measure, shell=True, capture_output=True, text=True, timeout=300)
            said = done.stdout + done.stderr
            assert (done.returncode == 0 and "Throughput:" in said) or "Failed to obtain stable measurement" in said, \
                said[-3000:]

        started = {p.pid for p in psutil.Process(serve.pid).children(recursive=True)} | {serve.pid}
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=120) == 128 + signal.SIGTERM
        assert "stopped (SIGTERM): tritonserver and its model processes are gone" in serve.stderr.read()
        _wait_for(lambda: not _alive(started, groups), "every process of the serve and server groups gone", 30)
    finally:
        watchdog.cancel()
        _kill_leftovers(serve, groups - {serve.pid})


SLOW_SERVER = """#!{python}
import http.server, sys, time
args = dict(a.lstrip("-").split("=", 1) for a in sys.argv[1:] if "=" in a)
for _ in range(int({loading_steps})):  # a busy host loading models: slow, and saying so
    print("loading...", flush=True)
    time.sleep(0.3)
if {stall}:
    time.sleep(60)
class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
http.server.HTTPServer((args["http-address"], int(args["http-port"])), Ready).serve_forever()
"""


def _slow_server(tmp_path: Path, loading_steps: int, stall: bool) -> TritonBinary:
    script = tmp_path / "tritonserver"
    script.write_text(SLOW_SERVER.format(python=sys.executable, loading_steps=loading_steps, stall=stall))
    script.chmod(0o755)
    return TritonBinary(script, tmp_path, "PATH")


def test_a_server_that_starts_slowly_but_makes_progress_is_waited_for(tmp_path):
    """Readiness waits while the server's log grows or its processes use CPU time: a loaded host's slow start is no
    failure, however much longer than the stall limit it takes."""
    binary = _slow_server(tmp_path, loading_steps=10, stall=False)  # about 3 s of progress, then ready
    with TritonServer(tmp_path, tmp_path / "server", binary=binary, ready_timeout=1.0) as server:
        assert server.timings["ready_seconds"] > 2.0 and server.is_ready()


def test_a_server_that_stalls_while_starting_fails_with_its_log(tmp_path):
    binary = _slow_server(tmp_path, loading_steps=2, stall=True)
    with pytest.raises(ServerStartError, match=r"tritonserver stalled while starting: no log output and no CPU time "
                                               r"for 1 s, not ready:\nloading...\nloading..."):
        TritonServer(tmp_path, tmp_path / "server", binary=binary, ready_timeout=1.0).start()


@pytest.mark.slow
def test_a_request_past_its_token_budget_is_refused_and_a_server_losing_its_ports_is_never_ready(published,
                                                                                                 tmp_path):
    import dataclasses

    import tritonclient.http

    _, plan, _ = published
    budget = dataclasses.replace(plan, max_tokens=64, max_request_tokens=256)
    repository = write_repository(budget, tmp_path / "repository")
    within, over = ["a text of some twenty words " * 3] * 4, ["many words " * 30] * 8
    with TritonServer(repository, tmp_path / "server") as server, TritonClient(server.http_url, "http") as client:
        second = TritonServer(repository, tmp_path / "second", ports=server.ports)  # the same ports, checked free
        with pytest.raises(PortInUseError, match=f"could not bind HTTP port {server.ports.http}, gRPC port "):
            second.start()  # its readiness probe reaches the first server, which must not count
        assert second.returncode is not None and server.is_ready()
        assert client.infer_texts(plan.name, within)["sentence_embedding"].shape[0] == 4, "within it: in pieces"
        with pytest.raises(ServedError, match=r"holds \d+ tokens .*at most 256 in one request "
                                              r"\(triton.max_request_tokens\)"):
            client.infer_texts(plan.name, over)
        raw = tritonclient.http.InferenceServerClient(server.http_url.split("://")[-1])
        tensor = tritonclient.http.InferInput("TEXT", [8, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[t.encode()] for t in over], dtype=object))
        with pytest.raises(Exception) as answered:
            raw.infer(plan.name, [tensor])
        assert str(answered.value.status()) == "400" and server.is_ready()


def test_empty_api_keys_are_refused_before_anything_starts(tmp_path, capsys, monkeypatch):
    for value, where in ((" , ", "(entries 1 and 2 of 2"), ("alpha,,beta", "(entry 2 of 3")):
        monkeypatch.setenv("WORKBENCH_API_KEY", value)
        assert main(["serve", "--repository", str(tmp_path)]) == 2
        error = capsys.readouterr().err
        assert f"WORKBENCH_API_KEY has an empty key {where}" in error and "alpha,beta" in error
    monkeypatch.delenv("WORKBENCH_API_KEY")
    assert main(["serve", "--repository", str(tmp_path), "--api-key", "alpha,"]) == 2
    assert "--api-key has an empty key (entry 2 of 2" in capsys.readouterr().err


@pytest.mark.slow
def test_a_changed_repository_or_a_taken_api_port_is_refused_by_name(published, tmp_path, capsys):
    copy = tmp_path / "repository"
    shutil.copytree(published[2], copy)
    graph = next(copy.rglob("*.onnx"))
    graph.write_bytes(graph.read_bytes() + b"\0")
    assert main(["serve", "--repository", str(copy)]) == 2
    error = capsys.readouterr().err
    assert "no longer holds what its triton step checked" in error and graph.name in error and "--unverified" in error
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert main(["serve", "--repository", str(published[2]), "--http-port", "0", "--grpc-port", "0",
                     "--metrics-port", "0", "--api-port", str(port)]) == 2
    error = capsys.readouterr().err
    assert f"API front port {port} on 127.0.0.1 is already in use" in error and "another --api-port" in error


@pytest.mark.slow
def test_a_front_killed_under_serve_stops_serve_naming_it(published):
    serve, lines, server_pid = _serve(published[2])
    try:
        front = psutil.Process(int(re.search(r"API: http://127.0.0.1:\d+/v1 \(pid (\d+)", "\n".join(lines)).group(1)))
        front.send_signal(signal.SIGKILL)
        assert serve.wait(timeout=60) == 2
        error = serve.stderr.read()
        assert f"the API front (pid {front.pid}, port" in error and "exited with code -9 while serving" in error
        _wait_for(lambda: not _alive({server_pid, front.pid}, {server_pid}), "the server and the front gone", 60)
    finally:
        _kill_leftovers(serve, {server_pid})

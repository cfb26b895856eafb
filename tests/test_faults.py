"""Faults found early and typed: corrupt models before publishing, a dead server named by every client."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import threading
from dataclasses import replace

import psutil
import pytest

from workbench.graphs.errors import OnnxModelError
from workbench.measure.load import asyncio_level
from workbench.serving.backend.ort_batches import instances_folder
from workbench.serving.client import AsyncTritonClient, TritonClient
from workbench.serving.errors import RepositoryError, ServedError, ServerUnreachableError
from workbench.serving.flavor import Flavor
from workbench.serving.repository import write_repository
from workbench.serving.server import TritonServer, free_port
from workbench.steps.triton import serving_plan

from .test_triton import prepared

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def plan(tiny_models, tmp_path_factory):
    """The python-ort plan of tiny BERT after export and optimize."""
    root = tmp_path_factory.mktemp("faults")
    config, record = prepared(tiny_models["bert"], root / "run", root / "repos")
    return serving_plan(config, record)[0]


def published(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_truncated_onnx_is_refused_before_anything_is_written(plan, tmp_path):
    truncated = tmp_path / "model.onnx"
    data = plan.model_file.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(OnnxModelError, match=f"(?s){truncated} fails onnx.checker: Unable to parse.*truncated"):
        write_repository(replace(plan, model_file=truncated), tmp_path / "repository")
    assert published(tmp_path) == ["model.onnx"], "no repository and no .partial folder"


def test_truncated_external_data_is_refused_by_onnx_runtime(plan, tmp_path):
    """The graph passes onnx.checker; its weights are cut short, which only a session finds."""
    import onnx

    model = tmp_path / "model.onnx"
    onnx.save_model(onnx.load(str(plan.model_file)), str(model), save_as_external_data=True,
                    location="model.onnx.data")
    weights = tmp_path / "model.onnx.data"
    os.truncate(weights, weights.stat().st_size // 2)
    onnx.checker.check_model(str(model))
    with pytest.raises(OnnxModelError, match=f"{model} does not load in ONNX Runtime: .*out of bounds"):
        write_repository(replace(plan, model_file=model), tmp_path / "repository")
    assert published(tmp_path) == ["model.onnx", "model.onnx.data"]


def test_an_empty_engine_is_refused(plan, tmp_path):
    engine = tmp_path / "model.plan"
    engine.touch()
    with pytest.raises(RepositoryError, match=f"TensorRT engine {engine} is missing or empty"):
        write_repository(replace(plan, flavor=Flavor.TENSORRT_PLAN, gpu=True, model_file=engine),
                         tmp_path / "repository")
    assert published(tmp_path) == ["model.plan"]


def sync_error(url: str, protocol: str, model: str) -> ServerUnreachableError:
    with TritonClient(url, protocol, timeout=10) as client, pytest.raises(ServerUnreachableError) as caught:
        client.infer_texts(model, ["hello"])
    return caught.value


async def async_errors(clients: dict[str, AsyncTritonClient], model: str) -> dict[str, ServerUnreachableError]:
    errors = {}
    for protocol, client in clients.items():
        with pytest.raises(ServerUnreachableError) as caught:
            await client.infer_texts(model, ["hello"])
        errors[protocol] = caught.value
    return errors


def test_a_port_where_nothing_listens_is_refused(plan):
    port = free_port()
    url = f"127.0.0.1:{port}"
    errors = [sync_error(url, protocol, plan.name) for protocol in ("http", "grpc")]

    async def both() -> dict[str, ServerUnreachableError]:
        clients = {p: AsyncTritonClient(url, p) for p in ("http", "grpc")}
        try:
            return await async_errors(clients, plan.name)
        finally:
            for client in clients.values():
                await client.close()

    errors += asyncio.run(both()).values()
    assert [e.problem for e in errors] == [f"no answer from Triton at {url} for {plan.name}: connection refused"] * 4
    assert all(f"tritonserver is running and listening at {url}" in e.fix for e in errors)


def running(repository) -> list[str]:
    """Live processes whose command line names `repository` (killed ones awaiting their reaper have none)."""
    found = subprocess.run(["pgrep", "-af", str(repository)], capture_output=True, text=True)
    return found.stdout.splitlines()


def test_every_client_names_a_killed_server(plan, tmp_path):
    repository = write_repository(plan, tmp_path / "repository")
    server = TritonServer(repository, tmp_path / "server")
    with server:
        urls, pid = {"http": server.http_url, "grpc": server.grpc_url}, server.process.pid
        assert len(running(repository)) == 1 + len(plan.working_models) * plan.instances, \
            "the server and a stub per Python model instance"

        async def send(client: AsyncTritonClient, index: int) -> object:
            return await client.infer_texts("no_such_model", [f"text {index}"])

        with pytest.raises(ServedError, match=f"all 2 requests at concurrency 2 to {server.http_url} failed; the "
                                              "first: no_such_model refused the request"):
            asyncio_level(server.http_url, "http", send, 2, 8, 30)

        async def kill_between_requests() -> dict[str, ServerUnreachableError]:
            clients = {p: AsyncTritonClient(url, p) for p, url in urls.items()}
            try:
                for client in clients.values():
                    assert (await client.infer_texts(plan.name, ["hello"]))["sentence_embedding"].shape == (1, 32)
                os.killpg(pid, signal.SIGKILL)
                server.process.wait()
                return await async_errors(clients, plan.name)  # their open connections are gone
            finally:
                for client in clients.values():
                    await client.close()

        errors = asyncio.run(kill_between_requests())
        # aiohttp reuses its open connection: the loop was blocked while the server died, so the close is found on
        # the next request; gRPC's own threads may notice first and reconnect, to be refused.
        assert errors["http"].problem == \
            f"no answer from Triton at {urls['http']} for {plan.name}: server closed the connection"
        assert re.fullmatch(f"no answer from Triton at {urls['grpc']} for {plan.name}: "
                            "(server closed the connection|connection refused)", errors["grpc"].problem)
        for protocol, url in urls.items():
            assert sync_error(url, protocol, plan.name).problem == \
                f"no answer from Triton at {url} for {plan.name}: connection refused"

        async def answer(client: AsyncTritonClient, index: int) -> object:
            return await client.infer_texts(plan.name, [f"text {index}"])

        with pytest.raises(ServerUnreachableError, match=f"{server.http_url} for {plan.name}: connection refused"):
            asyncio_level(server.http_url, "http", answer, 2, 8, 30)
    assert running(repository) == [], "neither the server nor its Python-backend stubs are left"


def test_a_server_killed_mid_load_is_named_by_every_call(plan, tmp_path):
    """SIGKILL to tritonserver alone (not its group) while asyncio load (HTTP and gRPC, 16 in flight each) and
    blocking calls run: every call raises ServerUnreachableError naming the URL, why, and how the server ended; the
    manager reports -9; no Python-backend stub outlives it."""
    server = TritonServer(write_repository(plan, tmp_path / "repository"), tmp_path / "server")
    answered = {name: threading.Event() for name in ("http async", "grpc async", "http sync", "grpc sync")}
    errors: dict[str, Exception] = {}

    def load(name: str) -> None:
        protocol, kind = name.split()
        url = server.http_url if protocol == "http" else server.grpc_url

        async def send(client: AsyncTritonClient, index: int) -> object:
            answer = await client.infer_texts(plan.name, [f"text {index}"])
            answered[name].set()
            return answer

        try:
            with server.watch():
                if kind == "async":
                    asyncio_level(url, protocol, send, 16, 10**9, 10**6)  # ends only when the server is gone
                else:
                    with TritonClient(url, protocol) as client:
                        while True:
                            client.infer_texts(plan.name, ["hello"])
                            answered[name].set()
        except Exception as error:  # noqa: BLE001 - checked below
            errors[name] = error
        finally:
            answered[name].set()  # a load that failed early must not leave the kill waiting

    stale = instances_folder(next((tmp_path / "repository").glob("*/[0-9]*")))
    stale.mkdir(exist_ok=True)  # what an instance killed before it finalized leaves
    (stale / "bert_0_0.lock").touch()
    with server:
        stubs = psutil.Process(server.pid).children(recursive=True)
        assert stubs and all(p.name() == "triton_python_backend_stub" for p in stubs), "a stub per Python model"
        loads = [threading.Thread(target=load, args=(name,)) for name in answered]
        for thread in loads:
            thread.start()
        for event in answered.values():
            event.wait()
        os.kill(server.pid, signal.SIGKILL)
        for thread in loads:
            thread.join()
    assert server.returncode == -9
    assert sorted(errors) == sorted(answered)
    for name, error in errors.items():
        url = server.http_url if name.startswith("http") else server.grpc_url
        assert isinstance(error, ServerUnreachableError), f"{name}: {error!r}"
        # in flight: closed; sent after the listening socket went (or a gRPC reconnect): refused
        assert re.fullmatch(f"no answer from Triton at {url} for {plan.name}: (server closed the connection|"
                            f"connection refused); tritonserver \\(pid {server.pid}\\) was killed by SIGKILL "
                            "\\(exit status -9\\)", error.problem), f"{name}: {error.problem}"
    left = [p for p in stubs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left and not server.group(), "no stub outlives the server"
    assert not stale.exists(), "stopping the server takes its instances' lock folders with it"

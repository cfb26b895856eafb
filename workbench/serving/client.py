"""Clients for a served model: texts (or token arrays) in, numpy outputs out, over HTTP or gRPC, sync or asyncio.

A tritonclient HTTP client must not be shared across threads: make one per thread (or per asyncio task group).
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from workbench.serving.errors import ServedError, ServerUnreachableError

PROTOCOLS = ("http", "grpc")
DATATYPES = {"int64": "INT64", "int32": "INT32", "float32": "FP32", "bool": "BOOL"}
NO_ANSWER_STATUSES = ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")  # gRPC: the server never answered
CLOSED_WORDS = ("closed", "disconnected", "reset", "stream removed", "broken pipe", "end of tcp stream", "goaway")


def _module(protocol: str, asynchronous: bool) -> Any:
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if protocol == "http":
        import tritonclient.http as sync_http
        import tritonclient.http.aio as async_http

        return async_http if asynchronous else sync_http
    import tritonclient.grpc as sync_grpc
    import tritonclient.grpc.aio as async_grpc

    return async_grpc if asynchronous else sync_grpc


def _network_errors() -> tuple[type[BaseException], ...]:
    """What the HTTP clients raise when no answer came (gRPC's arrive as InferenceServerException)."""
    import aiohttp
    from geventhttpclient.response import HTTPConnectionClosed

    return OSError, asyncio.TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, \
        HTTPConnectionClosed


def _closed(exc: BaseException) -> bool:
    """Did a connection that was open break (the server died or closed it mid-request)?"""
    import aiohttp
    from geventhttpclient.response import HTTPConnectionClosed

    if isinstance(exc, aiohttp.ClientOSError) and not isinstance(exc, aiohttp.ClientConnectorError):
        return True  # an OS error on an established connection, e.g. "Can not write request body"
    return isinstance(exc, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError, HTTPConnectionClosed,
                            aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError)) or \
        any(word in str(exc).lower() for word in CLOSED_WORDS)


def _why_no_answer(exc: BaseException) -> str:
    """'timed out', 'connection refused' or 'server closed the connection', else the error itself. A connection
    error's cause counts too: aiohttp's ClientConnectorError wraps a refused connect, or one the dying server's
    listening socket accepted and then reset."""
    causes = [exc, *([exc.__cause__] if exc.__cause__ is not None else [])]
    if any(isinstance(e, (TimeoutError, asyncio.TimeoutError)) or "deadline" in str(e).lower() for e in causes):
        return "timed out"
    if any(isinstance(e, ConnectionRefusedError) or "refused" in str(e).lower() for e in causes):
        return "connection refused"
    if any(_closed(e) for e in causes):
        return "server closed the connection"
    return f"{type(exc).__name__}: {exc}"


def _unreachable(url: str, model: str, exc: BaseException) -> ServerUnreachableError:
    return ServerUnreachableError(
        f"no answer from Triton at {url} for {model}: {_why_no_answer(exc)}",
        f"check that tritonserver is running and listening at {url}; its log (tritonserver.log in the server's "
        "work folder) says why it stopped")


@contextmanager
def _answered(url: str, model: str) -> Iterator[None]:
    """Turn the client libraries' errors into ServedError (the server refused the request) or
    ServerUnreachableError (no answer: connection refused, closed, timed out), both naming `url`."""
    from tritonclient.utils import InferenceServerException

    try:
        yield
    except InferenceServerException as exc:
        if str(exc.status()) in NO_ANSWER_STATUSES:
            raise _unreachable(url, model, exc) from None
        raise ServedError(f"{model} refused the request: {exc.message()}", "fix the request as the message says"
                          ) from None
    except _network_errors() as exc:
        raise _unreachable(url, model, exc) from None


def text_array(texts: list[str | bytes]) -> np.ndarray:
    """[n, 1] BYTES tensor; str is UTF-8 encoded, bytes are sent as they are."""
    return np.array([[t.encode("utf-8") if isinstance(t, str) else t] for t in texts], dtype=object)


def rerank_arrays(queries: list[str], documents: list[str], top_k: int | None = None) -> dict[str, np.ndarray]:
    """A reranker's request: one query for all `documents` (or one per document), and TOP_K when asked."""
    def strings(texts: list[str]) -> np.ndarray:
        return np.array([t.encode("utf-8") for t in texts], dtype=object)
    arrays = {"QUERY": strings(queries), "DOCUMENTS": strings(documents)}
    return {**arrays, "TOP_K": np.array([top_k], dtype=np.int64)} if top_k is not None else arrays


def _inputs(module: Any, arrays: dict[str, np.ndarray]) -> list[Any]:
    inputs = []
    for name, array in arrays.items():
        datatype = "BYTES" if array.dtype == object else DATATYPES[str(array.dtype)]
        tensor = module.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _outputs(module: Any, names: list[str] | None) -> list[Any] | None:
    return [module.InferRequestedOutput(name) for name in names] if names else None


def _result(response: Any, names: list[str] | None) -> dict[str, np.ndarray]:
    if names is None:
        payload = response.get_response()
        outputs = payload["outputs"] if isinstance(payload, dict) else payload.outputs
        names = [o["name"] if isinstance(o, dict) else o.name for o in outputs]
    return {name: response.as_numpy(name) for name in names}


class TritonClient:
    """Blocking client for one server; gRPC unless told (`url` is the server's address for `protocol`)."""

    def __init__(self, url: str, protocol: str = "grpc", timeout: float = 120.0) -> None:
        self.url, self.protocol = url, protocol
        self.module = _module(protocol, asynchronous=False)
        kwargs = {"network_timeout": timeout, "connection_timeout": timeout} if protocol == "http" else {}
        self.client = self.module.InferenceServerClient(url=url, **kwargs)

    def infer(self, model: str, arrays: dict[str, np.ndarray], outputs: list[str] | None = None,
              parameters: dict[str, str] | None = None) -> dict[str, Any]:
        """`parameters`: request parameters, e.g. {"prompt_name": "query"} for a model with prompts."""
        with _answered(self.url, model):
            response = self.client.infer(model, _inputs(self.module, arrays), outputs=_outputs(self.module, outputs),
                                         parameters=parameters)
        return _result(response, outputs)

    def infer_texts(self, model: str, texts: list[str | bytes], outputs: list[str] | None = None,
                    parameters: dict[str, str] | None = None) -> dict[str, Any]:
        return self.infer(model, {"TEXT": text_array(texts)}, outputs, parameters)

    def rerank(self, model: str, queries: list[str], documents: list[str], top_k: int | None = None,
               outputs: list[str] | None = None) -> dict[str, Any]:
        """A reranker's scores of `documents` against one query (or one query per document), in their order; with
        `top_k`, also `top_indices` and `top_scores`, best first."""
        return self.infer(model, rerank_arrays(queries, documents, top_k), outputs)

    def statistics(self, model: str) -> dict[str, Any]:
        with _answered(self.url, model):
            stats = self.client.get_inference_statistics(model, as_json=True) if self.protocol == "grpc" else \
                self.client.get_inference_statistics(model)
        return stats["model_stats"][0]

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> TritonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncTritonClient:
    """asyncio client (tritonclient.grpc.aio unless told, or http.aio) for concurrent load."""

    def __init__(self, url: str, protocol: str = "grpc") -> None:
        self.url = url
        self.module = _module(protocol, asynchronous=True)
        self.client = self.module.InferenceServerClient(url=url)

    async def infer(self, model: str, arrays: dict[str, np.ndarray],
                    outputs: list[str] | None = None) -> dict[str, Any]:
        with _answered(self.url, model):
            response = await self.client.infer(model, _inputs(self.module, arrays),
                                               outputs=_outputs(self.module, outputs))
        return _result(response, outputs)

    async def infer_texts(self, model: str, texts: list[str | bytes],
                          outputs: list[str] | None = None) -> dict[str, Any]:
        return await self.infer(model, {"TEXT": text_array(texts)}, outputs)

    async def close(self) -> None:
        await self.client.close()


def run_async(coroutine: Any) -> Any:
    """asyncio.run, also from inside a running event loop (a Jupyter kernel): then on a worker thread."""
    import asyncio
    import concurrent.futures

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()

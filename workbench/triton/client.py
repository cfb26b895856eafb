"""Clients for a served model: texts (or token arrays) in, numpy outputs out, over HTTP or gRPC, sync or asyncio.

A tritonclient HTTP client must not be shared across threads: make one per thread (or per asyncio task group).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from workbench.errors import ServedError

PROTOCOLS = ("http", "grpc")
DATATYPES = {"int64": "INT64", "int32": "INT32", "float32": "FP32", "bool": "BOOL"}


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


def text_array(texts: list[str | bytes]) -> np.ndarray:
    """[n, 1] BYTES tensor; str is UTF-8 encoded, bytes are sent as they are."""
    return np.array([[t.encode("utf-8") if isinstance(t, str) else t] for t in texts], dtype=object)


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
    """Blocking client for one server."""

    def __init__(self, url: str, protocol: str = "http", timeout: float = 120.0) -> None:
        self.protocol = protocol
        self.module = _module(protocol, asynchronous=False)
        kwargs = {"network_timeout": timeout, "connection_timeout": timeout} if protocol == "http" else {}
        self.client = self.module.InferenceServerClient(url=url, **kwargs)

    def infer(self, model: str, arrays: dict[str, np.ndarray], outputs: list[str] | None = None) -> dict[str, Any]:
        from tritonclient.utils import InferenceServerException

        try:
            response = self.client.infer(model, _inputs(self.module, arrays), outputs=_outputs(self.module, outputs))
        except InferenceServerException as exc:
            raise ServedError(f"{model} refused the request: {exc.message()}", "fix the request as the message says"
                              ) from None
        return _result(response, outputs)

    def infer_texts(self, model: str, texts: list[str | bytes], outputs: list[str] | None = None) -> dict[str, Any]:
        return self.infer(model, {"TEXT": text_array(texts)}, outputs)

    def statistics(self, model: str) -> dict[str, Any]:
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
    """asyncio client (tritonclient.http.aio / grpc.aio) for concurrent load."""

    def __init__(self, url: str, protocol: str = "http") -> None:
        self.module = _module(protocol, asynchronous=True)
        self.client = self.module.InferenceServerClient(url=url)

    async def infer(self, model: str, arrays: dict[str, np.ndarray],
                    outputs: list[str] | None = None) -> dict[str, Any]:
        from tritonclient.utils import InferenceServerException

        try:
            response = await self.client.infer(model, _inputs(self.module, arrays),
                                               outputs=_outputs(self.module, outputs))
        except InferenceServerException as exc:
            raise ServedError(f"{model} refused the request: {exc.message()}", "fix the request as the message says"
                              ) from None
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

"""What the API front's routes share: the served models with their tokenizers and prompts, one gRPC client to Triton,
reading a request body into its API's shape (every fault a typed ApiError), and the model calls each kind answers
with: vectors, sparse terms, rerank scores and class logits. A request that needs several Triton requests sends them
a few at a time, so others' requests interleave. Imports nothing from the workbench (copied beside api_front.py)."""
from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import orjson
import tritonclient.grpc.aio as grpcclient
from aiohttp import web
from pydantic import BaseModel, ValidationError
from tritonclient.utils import InferenceServerException

if __package__:  # imported from the workbench package, or run with -m
    from .api_metrics import FrontMetrics
    from .api_schema import ANSWERS, KINDS, ApiError, ServedModel, check_unicode, too_large
    from .text_input import Prompts, RequestBudget, TextEncoder
else:  # files copied beside each other (the deployment image)
    from api_metrics import FrontMetrics
    from api_schema import ANSWERS, KINDS, ApiError, ServedModel, check_unicode, too_large
    from text_input import Prompts, RequestBudget, TextEncoder

INLINE_CHARS = 4096  # a request this short is tokenized on the event loop: a thread's hop would cost more
PIECES_AT_ONCE = 2  # Triton requests one front request has in flight at a time
BODY_READ_S = 60.0  # a body that has not arrived by then is refused (408)
EXPECTED = {"input": "a string or a list of strings", "inputs": "a string or a list of strings",
            "documents": "a list of strings or of {\"text\": ...} objects", "texts": "a list of strings"}
Shape = TypeVar("Shape", bound=BaseModel)
T = TypeVar("T")


class Front:
    """The models, their tokenizers, prompts and routes' metrics, and the Triton client the routes share."""

    def __init__(self, models: list[ServedModel], repository: Path, triton_url: str, keys: list[str]) -> None:
        self.models = {m.id: m for m in models}
        self.encoders = {m.id: TextEncoder(repository / m.tokenizer, m.max_length, ["input_ids"]) for m in models}
        self.prompts = {m.id: Prompts({"prompts": json.dumps(m.prompts), "default_prompt_name": m.default_prompt_name})
                        for m in models}
        self.triton_url, self.keys = triton_url, [k.encode() for k in keys]
        self.metrics = FrontMetrics()
        self.client: grpcclient.InferenceServerClient | None = None  # made in the server's event loop

    def only(self, kind: str, route: str) -> str:
        """The one model of `kind` a request that names none means; 400 where there are several."""
        found = [m.id for m in self.models.values() if m.kind == kind]
        if len(found) > 1:
            raise ApiError(400, f"this deployment serves several {KINDS[kind]}s ({', '.join(found)}): name one in "
                                "'model'", "model", "model_required")
        if not found:
            raise ApiError(404, f"this deployment serves no {KINDS[kind]}, which {route} answers for; GET /v1/models "
                                "lists what it serves", "model", "model_not_found")
        return found[0]

    def model(self, name: str | None, kind: str, route: str) -> ServedModel:
        """The served model `name` (None: the only one of `kind`), 404 where it is not one of `kind`."""
        if name is None:
            name = self.only(kind, route)
        served = self.models.get(name)
        if served is not None and served.kind != kind:
            raise ApiError(404, f"model {name!a} is {article(KINDS[served.kind])}: POST {ANSWERS[served.kind]} answers "
                                f"it, not {route}; GET /v1/models lists each model's kind", "model", "model_not_found")
        if served is None:
            these = ", ".join(m.id for m in self.models.values() if m.kind == kind) or "none"
            raise ApiError(404, f"model {name!a} is not served here for {route}; this deployment serves: {these} "
                                "(GET /v1/models lists them)", "model", "model_not_found")
        return served

    def authorized(self, request: web.Request) -> bool:
        if not self.keys:
            return True
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and any(hmac.compare_digest(key.strip().encode(), k) for k in self.keys)

    def prompted(self, model: ServedModel, texts: list[str], parameters: dict[str, str]) -> list[str]:
        """`texts` after the prompt the request asks for (as encode() puts it); 400 naming an unknown prompt_name."""
        if "prompt" in parameters:
            check_unicode(parameters["prompt"], "prompt", "prompt")
        try:
            return self.prompts[model.id].apply(texts, json.dumps(parameters))[0]
        except ValueError as exc:
            raise ApiError(400, str(exc), "prompt_name", "unknown_prompt") from None

    async def tokens(self, name: str, texts: list[str] | list[tuple[str, str]]) -> list[int]:
        """Each text's (or pair's) tokens as the served model runs it (cut at its max_length); a long request is
        counted on a thread, so the loop goes on answering others."""
        lengths = self.encoders[name].lengths
        short = sum(len(t) if isinstance(t, str) else len(t[0]) + len(t[1]) for t in texts) <= INLINE_CHARS
        return lengths(texts) if short else await asyncio.to_thread(lengths, texts)

    def within_budget(self, model: ServedModel, tokens: int, param: str) -> None:
        """Refused (413) past the deployment's token budget, in the served model's own words."""
        problem = RequestBudget({"max_request_tokens": str(model.max_request_tokens or 0)}).refusal(tokens)
        if problem:
            raise too_large(problem, param, "too_many_tokens")

    async def infer(self, model: str, inputs: dict[str, np.ndarray], outputs: tuple[str, ...], route: str,
                    parameters: dict[str, str] | None = None) -> list[np.ndarray]:
        """One Triton request answering `outputs`, in their order; its refusal is a 400 with Triton's message, no
        answer a 503."""
        assert self.client is not None, "the application's startup connects the client"
        tensors = []
        for name, array in inputs.items():
            tensor = grpcclient.InferInput(name, list(array.shape), "BYTES")
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        started = time.perf_counter()
        try:
            result = await self.client.infer(model, tensors, parameters=parameters or None,
                                             outputs=[grpcclient.InferRequestedOutput(name) for name in outputs])
        except InferenceServerException as exc:
            status = str(exc.status())
            if status == "StatusCode.INVALID_ARGUMENT":
                raise ApiError(400, exc.message() or str(exc), None, "invalid_input") from None
            raise ApiError(503, f"Triton at {self.triton_url} did not answer ({status}): {exc.message()}", None,
                           "triton_unavailable", "server_error") from None
        finally:
            self.metrics.triton.labels(route).observe(time.perf_counter() - started)
        return [result.as_numpy(name) for name in outputs]

    async def pieces(self, model: ServedModel, texts: list[str], lengths: list[int] | None, outputs: tuple[str, ...],
                     route: str, parameters: dict[str, str]) -> list[list[np.ndarray]]:
        """`texts` through `model` in as many Triton requests as its limits ask (`split`), PIECES_AT_ONCE at a
        time: per request, its `outputs`."""
        runs = split(lengths or [0] * len(texts), model.batch, model.max_request_tokens if lengths else None)
        return await bounded([lambda s=start, e=stop: self.infer(
            model.id, {"TEXT": strings(texts[s:e]).reshape(-1, 1)}, outputs, route, parameters)
            for start, stop in runs])


def article(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def split(lengths: list[int], texts: int, tokens: int | None) -> list[tuple[int, int]]:
    """Consecutive (start, stop) runs of texts, each within `texts` texts (0: any) and `tokens` tokens (None: any):
    the Triton requests one front request becomes, each within the deployment's limits."""
    runs, start, held = [], 0, 0
    for index, length in enumerate(lengths):
        if index > start and ((texts and index - start == texts) or (tokens and held + length > tokens)):
            runs.append((start, index))
            start, held = index, 0
        held += length
    return [*runs, (start, len(lengths))]


async def bounded(calls: list[Callable[[], Awaitable[T]]], at_once: int = PIECES_AT_ONCE) -> list[T]:
    """Each call's answer in order, `at_once` running at a time; one call runs inline. Cancelled (the client went
    away), the calls not started never start."""
    if len(calls) == 1:
        return [await calls[0]()]
    gate = asyncio.Semaphore(at_once)

    async def one(call: Callable[[], Awaitable[T]]) -> T:
        async with gate:
            return await call()
    return list(await asyncio.gather(*(one(call) for call in calls)))


def strings(texts: list[str]) -> np.ndarray:
    return np.array([t.encode("utf-8") for t in texts], dtype=object)


async def read_json(request: web.Request) -> object:
    """The request's body as JSON: 408 when it does not arrive within BODY_READ_S, 400 naming what is wrong when it
    is not JSON or nests too deep. orjson first; a body it refuses is read again by the standard parser, which takes
    a lone surrogate (refused later, naming its field) and says where the syntax breaks."""
    try:
        raw = await asyncio.wait_for(request.read(), BODY_READ_S)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {BODY_READ_S:.0f} s: send it whole", None,
                       "body_timeout") from None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the body nests arrays or objects too deep to read: the APIs here take a JSON object "
                            "whose texts are strings or lists of strings", None, "invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON ({exc}): send a JSON object", None, "invalid_json") from None


def validated(data: object, shape: type[Shape]) -> Shape:
    """`data` as `shape`: 422 naming the first field that is wrong."""
    try:
        return shape.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else None
        expected = EXPECTED.get(param or "") if len(first["loc"]) > 1 else None  # a union: say what it takes
        why = f"expected {expected} (got {type(first['input']).__name__})" if expected else first["msg"]
        raise ApiError(422, f"{param or 'body'}: {why}", param, "invalid_value") from None


async def body(request: web.Request, shape: type[Shape]) -> Shape:
    return validated(await read_json(request), shape)


def answer(data: object) -> web.Response:
    """A JSON answer, numpy arrays written as JSON numbers by orjson."""
    return web.Response(body=orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY), content_type="application/json")


async def vectors(front: Front, model: ServedModel, texts: list[str], parameters: dict[str, str], route: str,
                  count: bool) -> tuple[np.ndarray, int]:
    """Each text's vector as the served model answers it ([texts, dimensions] float32), and the request's tokens
    when `count` or the deployment's token budget asks for them (else 0)."""
    lengths = await front.tokens(model.id, front.prompted(model, texts, parameters)) \
        if count or model.max_request_tokens else None
    answers = await front.pieces(model, texts, lengths, (model.output,), route, parameters)
    return np.concatenate([a[0] for a in answers]).astype("<f4").reshape(len(texts), -1), sum(lengths or [])


async def sparse_terms(front: Front, model: ServedModel, texts: list[str], parameters: dict[str, str],
                       route: str) -> list[list[dict[str, float]]]:
    """Per text, its active vocabulary terms as [{"index": id, "value": weight}], heaviest first, as the served
    SparseEncoder answers them."""
    lengths = await front.tokens(model.id, front.prompted(model, texts, parameters)) \
        if model.max_request_tokens else None
    answers = await front.pieces(model, texts, lengths, ("sparse_indices", "sparse_values"), route, parameters)
    return [[{"index": int(i), "value": float(v)} for i, v in zip(ids, weights) if i >= 0]
            for ids_piece, weights_piece in answers for ids, weights in zip(ids_piece, weights_piece)]


async def rerank_scores(front: Front, model: ServedModel, query: str, documents: list[str], route: str,
                        param: str) -> tuple[np.ndarray, int]:
    """Each document's score against `query` as the served reranker gives it, and the request's tokens (413 past
    the deployment's budget)."""
    tokens = sum(await front.tokens(model.id, [(query, d) for d in documents]))
    front.within_budget(model, tokens, param)
    (scores,) = await front.infer(model.id, {"QUERY": strings([query]), "DOCUMENTS": strings(documents)},
                                  (model.output,), route)
    return scores.reshape(len(documents), -1)[:, 0], tokens


async def class_logits(front: Front, model: ServedModel, texts: list[str], route: str) -> np.ndarray:
    """Each text's logits [texts, labels]. The ensemble is asked for all three outputs (tritonserver 2.51 fails a
    classification ensemble's request without all of logits, label and score)."""
    lengths = await front.tokens(model.id, texts) if model.max_request_tokens else None
    answers = await front.pieces(model, texts, lengths, (model.output, "label", "score"), route, {})
    return np.concatenate([a[0] for a in answers]).astype(np.float64).reshape(len(texts), -1)


def class_scores(logits: np.ndarray, activation: str) -> np.ndarray:
    """The scores the model's head gives (transformers' text-classification pipeline): softmax, sigmoid for a
    multi-label model, the logits themselves for a regression."""
    if activation == "softmax":
        shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
        return shifted / shifted.sum(axis=-1, keepdims=True)
    if activation == "sigmoid":
        with np.errstate(over="ignore"):
            return 1.0 / (1.0 + np.exp(-logits))
    return logits

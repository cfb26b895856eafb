"""The API front: OpenAI's embeddings API, a Cohere-style rerank API and text-embeddings-inference's sparse route in
front of a running Triton, so the clients of the retrieval stack (openai, LangChain, LlamaIndex, litellm, TEI's
clients and the vector databases' SPLADE hooks) use the verified deployment as they are.

    python api_front.py --spec front.json --repository /models --triton 127.0.0.1:8001 [--host H] [--port 8080]

`POST /v1/embeddings`, `POST /v1/rerank`, `POST /embed_sparse`, `GET /v1/models`, `GET /health` (ready when Triton's
models are). Each
request is checked against the deployment's limits (the same settings, the same messages' sense) and tokenized with
the served tokenizer (for `usage` and the token budget) before it goes to Triton over one shared gRPC channel, as it
comes, so Triton's dynamic batcher still forms the batches; the model runs in Triton alone. Errors are OpenAI's
shape: `{"error": {"message", "type", "param", "code"}}`. API keys: WORKBENCH_API_KEY (several: comma-separated),
asked as `Authorization: Bearer <key>` on /v1/ routes and /embed_sparse. Runs from the workbench package or as a
file copied beside text_input.py (the deployment image).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import hmac
import json
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal

import numpy as np
import tritonclient.grpc.aio as grpcclient
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tritonclient.utils import InferenceServerException

if __package__:  # imported from the workbench package, or run with -m
    from .text_input import Prompts, RequestBudget, TextEncoder
else:  # run as a file copied beside text_input.py (the deployment image)
    from text_input import Prompts, RequestBudget, TextEncoder

KEY_VARIABLE = "WORKBENCH_API_KEY"
BODY_SLACK = 2**20  # bytes a request body may hold past its texts (JSON syntax, the other fields)
UTF8_BYTES = 4  # at most, per character
EXPECTED = {"input": "a string or a list of strings", "documents": "a list of strings or of {\"text\": ...} objects"}
# Each kind of served model's route: OpenAI's, Cohere's and text-embeddings-inference's.
ROUTES = {"embeddings": "/v1/embeddings", "rerank": "/v1/rerank", "sparse": "/embed_sparse"}
KINDS = {"embeddings": "embedding model", "rerank": "reranker", "sparse": "sparse encoder"}
SPARSE_INDICES, SPARSE_VALUES = "sparse_indices", "sparse_values"  # a sparse encoder's served outputs
INLINE_CHARS = 4096  # a request this short is tokenized on the event loop: a thread's hop would cost more


class ServedModel(BaseModel):
    """One model the front answers for: its Triton name (the API's `model`), what it does, and the limits and
    tokenizer of the deployment (`workbench.serving.front.front_spec` reads them from the repository)."""

    id: str
    kind: Literal["embeddings", "rerank", "sparse"]
    output: str  # the Triton output that answers: the embedding, or the scores
    dimensions: int = 0  # an embedding's width
    tokenizer: str  # the folder (under the repository) with the served tokenizer
    max_length: int  # tokens the model reads of one text (or pair)
    batch: int = 0  # texts one Triton request may carry (its max_batch_size; 0: unbatched)
    max_texts: int | None = None
    max_text_chars: int | None = None
    max_documents: int | None = None
    max_request_tokens: int | None = None
    prompts: dict[str, str] = Field(default_factory=dict)
    default_prompt_name: str = ""

    def body_bytes(self) -> int:
        """The largest request body its limits allow."""
        texts = (self.max_documents or 1024) + 1 if self.kind == "rerank" else self.max_texts or 2048
        return texts * (self.max_text_chars or 100_000) * UTF8_BYTES + BODY_SLACK


class FrontSpec(BaseModel):
    """What `front.json` holds: the models the front serves."""

    models: list[ServedModel]


class EmbeddingsRequest(BaseModel):
    """OpenAI's embeddings request, and the model's prompt (`prompt_name`, or the `prompt` text itself)."""

    model_config = ConfigDict(extra="ignore")
    input: str | list[str] | list[int] | list[list[int]]
    model: str
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    prompt_name: str | None = None
    prompt: str | None = None


class SparseRequest(BaseModel):
    """text-embeddings-inference's /embed_sparse request; `model` (an extra field) names one where the front serves
    several sparse encoders."""

    model_config = ConfigDict(extra="ignore")
    inputs: str | list[str]
    truncate: bool | None = None  # texts are cut at the model's limit, as SparseEncoder.encode() cuts them
    prompt_name: str | None = None
    model: str | None = None


class Document(BaseModel):
    text: str


class RerankRequest(BaseModel):
    """The rerank request of Cohere, Jina and text-embeddings-inference."""

    model_config = ConfigDict(extra="ignore")
    model: str
    query: str
    documents: list[str | Document]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = False


class ApiError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> web.Response:
        return web.json_response({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                            "code": self.code}}, status=self.status)


def too_large(message: str, param: str, code: str) -> ApiError:
    return ApiError(413, message, param, code)


def check_texts(texts: list[str], param: str, model: ServedModel, count_limit: int | None,
                count_setting: str) -> None:
    """The request's texts within the deployment's limits: ApiError naming the text or the limit and its setting."""
    if not texts:
        raise ApiError(400, f"'{param}' is empty: send at least one text", param, "empty_input")
    if count_limit and len(texts) > count_limit:
        raise too_large(f"{len(texts)} texts in '{param}'; this deployment takes at most {count_limit} in one "
                        f"request ({count_setting}): send them in smaller requests (LangChain's OpenAIEmbeddings: "
                        f"chunk_size={count_limit})", param, "too_many_inputs")
    for index, text in enumerate(texts):
        if not text:  # whitespace alone is a text: encode() embeds it
            raise ApiError(400, f"{param}[{index}] is empty: send at least one character", param, "empty_input")
        if model.max_text_chars and len(text) > model.max_text_chars:
            raise too_large(f"{param}[{index}] has {len(text)} characters; this deployment takes at most "
                            f"{model.max_text_chars} in one text (triton.max_text_chars): send the part the model "
                            f"reads (it reads {model.max_length} tokens)", param, "text_too_long")


class Front:
    """The models, their tokenizers and the Triton client the routes share."""

    def __init__(self, spec: FrontSpec, repository: Path, triton_url: str, keys: list[str]) -> None:
        self.models = {m.id: m for m in spec.models}
        self.encoders = {m.id: TextEncoder(repository / m.tokenizer, m.max_length, ["input_ids"])
                         for m in spec.models}
        self.prompts = {m.id: Prompts({"prompts": json.dumps(m.prompts), "default_prompt_name": m.default_prompt_name})
                        for m in spec.models}
        self.triton_url, self.keys = triton_url, [k.encode() for k in keys]
        self.client: grpcclient.InferenceServerClient | None = None  # made in the server's event loop

    def only(self, kind: str) -> str:
        """The one model of `kind` a request that names none means; 400 where there are several."""
        found = [m.id for m in self.models.values() if m.kind == kind]
        if len(found) > 1:
            raise ApiError(400, f"this deployment serves several {kind} models ({', '.join(found)}): name one in "
                                "'model'", "model", "model_required")
        if not found:
            raise ApiError(404, f"this deployment serves no {KINDS[kind]}, which {ROUTES[kind]} answers for; "
                                "GET /v1/models lists what it serves", "model", "model_not_found")
        return found[0]

    def model(self, name: str, kind: str) -> ServedModel:
        served = self.models.get(name)
        if served is not None and served.kind != kind:
            raise ApiError(404, f"model {name!r} is a {KINDS[served.kind]}: POST {ROUTES[served.kind]} answers it, "
                                f"not {ROUTES[kind]}", "model", "model_not_found")
        if served is None:
            these = ", ".join(m.id for m in self.models.values() if m.kind == kind) or "none"
            raise ApiError(404, f"model {name!r} is not served here for {ROUTES[kind]}; this deployment serves: "
                                f"{these} (GET /v1/models lists them)", "model", "model_not_found")
        return served

    def authorized(self, request: web.Request) -> bool:
        if not self.keys:
            return True
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and any(hmac.compare_digest(key.strip().encode(), k) for k in self.keys)

    async def tokens(self, name: str, texts: list[str] | list[tuple[str, str]]) -> list[int]:
        """Each text's (or pair's) tokens as the served model runs it (cut at its max_length); a long request is
        counted on a thread, so the loop goes on answering others."""
        lengths = self.encoders[name].lengths
        short = sum(len(t) if isinstance(t, str) else len(t[0]) + len(t[1]) for t in texts) <= INLINE_CHARS
        return lengths(texts) if short else await asyncio.to_thread(lengths, texts)

    def within_budget(self, model: ServedModel, tokens: int) -> None:
        """Refused (413) past the deployment's token budget, in the served model's own words."""
        problem = RequestBudget({"max_request_tokens": str(model.max_request_tokens or 0)}).refusal(tokens)
        if problem:
            raise too_large(problem, "documents", "too_many_tokens")

    async def infer(self, model: str, inputs: dict[str, np.ndarray], output: str,
                    parameters: dict[str, str] | None = None) -> np.ndarray:
        """One Triton request answering `output`; its refusal is a 400 with Triton's message, no answer a 503."""
        return (await self.infer_outputs(model, inputs, (output,), parameters))[0]

    async def infer_outputs(self, model: str, inputs: dict[str, np.ndarray], outputs: tuple[str, ...],
                            parameters: dict[str, str] | None = None) -> list[np.ndarray]:
        """One Triton request answering `outputs`, in their order."""
        assert self.client is not None, "the application's startup connects the client"
        tensors = []
        for name, array in inputs.items():
            tensor = grpcclient.InferInput(name, list(array.shape), "BYTES")
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        try:
            result = await self.client.infer(model, tensors, parameters=parameters or None,
                                             outputs=[grpcclient.InferRequestedOutput(name) for name in outputs])
        except InferenceServerException as exc:
            status = str(exc.status())
            if status == "StatusCode.INVALID_ARGUMENT":
                raise ApiError(400, exc.message() or str(exc), None, "invalid_input") from None
            raise ApiError(503, f"Triton at {self.triton_url} did not answer ({status}): {exc.message()}", None,
                           "triton_unavailable", "server_error") from None
        return [result.as_numpy(name) for name in outputs]


def pieces(lengths: list[int], texts: int, tokens: int | None) -> list[tuple[int, int]]:
    """Consecutive (start, stop) runs of texts, each within `texts` texts (0: any) and `tokens` tokens (None: any):
    the Triton requests one embeddings request becomes, each within the deployment's limits."""
    runs, start, held = [], 0, 0
    for index, length in enumerate(lengths):
        if index > start and ((texts and index - start == texts) or (tokens and held + length > tokens)):
            runs.append((start, index))
            start, held = index, 0
        held += length
    return [*runs, (start, len(lengths))]


def strings(texts: list[str]) -> np.ndarray:
    return np.array([t.encode("utf-8") for t in texts], dtype=object)


async def body(request: web.Request, shape: type[BaseModel]) -> BaseModel:
    """The request's JSON body as `shape`: 400 when it is not JSON, 422 naming the first field that is wrong."""
    try:
        data = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON ({exc}): send a JSON object", None, "invalid_json") from None
    try:
        return shape.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else None
        expected = EXPECTED.get(param or "") if len(first["loc"]) > 1 else None  # a union: say what it takes
        why = f"expected {expected} (got {type(first['input']).__name__})" if expected else first["msg"]
        raise ApiError(422, f"{param or 'body'}: {why}", param, "invalid_value") from None


async def embeddings(request: web.Request) -> web.Response:
    front: Front = request.app["front"]
    asked = await body(request, EmbeddingsRequest)
    model = front.model(asked.model, "embeddings")
    texts = [asked.input] if isinstance(asked.input, str) else asked.input
    if texts and not all(isinstance(t, str) for t in texts):
        raise ApiError(400, "'input' holds token ids: this deployment tokenizes with the model's own tokenizer, send "
                            "strings (LangChain's OpenAIEmbeddings: check_embedding_ctx_length=False)", "input",
                       "token_ids_not_supported")
    if asked.dimensions is not None and not 1 <= asked.dimensions <= model.dimensions:
        raise ApiError(400, f"dimensions={asked.dimensions}: {model.id} answers at most {model.dimensions} "
                            f"dimensions; ask for 1 to {model.dimensions}, or leave 'dimensions' out",
                       "dimensions", "dimensions_not_supported")
    check_texts(texts, "input", model, model.max_texts, "triton.max_texts")
    parameters = {k: v for k, v in (("prompt_name", asked.prompt_name), ("prompt", asked.prompt)) if v is not None}
    try:
        prompted, _ = front.prompts[model.id].apply(texts, json.dumps(parameters))
    except ValueError as exc:
        raise ApiError(400, str(exc), "prompt_name", "unknown_prompt") from None
    lengths = await front.tokens(model.id, prompted)
    tokens = sum(lengths)
    calls = [front.infer(model.id, {"TEXT": strings(texts[start:stop]).reshape(-1, 1)}, model.output, parameters)
             for start, stop in pieces(lengths, model.batch, model.max_request_tokens)]
    chunks = [await calls[0]] if len(calls) == 1 else await asyncio.gather(*calls)
    # encode(truncate_dim=d): the first d values, not renormalized (docs/api.md)
    vectors = np.concatenate(chunks).astype("<f4").reshape(len(texts), -1)[:, :asked.dimensions]
    encode: Callable[[np.ndarray], object] = (
        (lambda v: base64.b64encode(v.tobytes()).decode("ascii")) if asked.encoding_format == "base64"
        else (lambda v: v.tolist()))
    return web.json_response({"object": "list", "model": model.id,
                              "data": [{"object": "embedding", "index": i, "embedding": encode(v)}
                                       for i, v in enumerate(vectors)],
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def embed_sparse(request: web.Request) -> web.Response:
    """text-embeddings-inference's sparse embeddings: per text, its active vocabulary terms as
    [{"index": id, "value": weight}], heaviest first, as the served SparseEncoder answers them."""
    front: Front = request.app["front"]
    asked = await body(request, SparseRequest)
    model = front.model(asked.model or front.only("sparse"), "sparse")
    texts = [asked.inputs] if isinstance(asked.inputs, str) else asked.inputs
    check_texts(texts, "inputs", model, model.max_texts, "triton.max_texts")
    parameters = {"prompt_name": asked.prompt_name} if asked.prompt_name is not None else {}
    try:
        prompted, _ = front.prompts[model.id].apply(texts, json.dumps(parameters))
    except ValueError as exc:
        raise ApiError(400, str(exc), "prompt_name", "unknown_prompt") from None
    lengths = await front.tokens(model.id, prompted)
    calls = [front.infer_outputs(model.id, {"TEXT": strings(texts[start:stop]).reshape(-1, 1)},
                                 (SPARSE_INDICES, SPARSE_VALUES), parameters)
             for start, stop in pieces(lengths, model.batch, model.max_request_tokens)]
    answers = [await calls[0]] if len(calls) == 1 else await asyncio.gather(*calls)
    terms = [[{"index": int(i), "value": float(v)} for i, v in zip(ids, weights) if i >= 0]
             for ids_piece, weights_piece in answers for ids, weights in zip(ids_piece, weights_piece)]
    return web.json_response(terms)


async def rerank(request: web.Request) -> web.Response:
    front: Front = request.app["front"]
    asked = await body(request, RerankRequest)
    model = front.model(asked.model, "rerank")
    documents = [d if isinstance(d, str) else d.text for d in asked.documents]
    check_texts([asked.query], "query", model, None, "")
    check_texts(documents, "documents", model, model.max_documents, "triton.max_documents")
    tokens = sum(await front.tokens(model.id, [(asked.query, d) for d in documents]))
    front.within_budget(model, tokens)
    scores = (await front.infer(model.id, {"QUERY": strings([asked.query]), "DOCUMENTS": strings(documents)},
                                model.output)).reshape(len(documents), -1)[:, 0]
    order = np.argsort(-scores, kind="stable")[:asked.top_n]
    results = [{"index": int(i), "relevance_score": float(scores[i]),
                **({"document": {"text": documents[i]}} if asked.return_documents else {})} for i in order]
    return web.json_response({"id": str(uuid.uuid4()), "model": model.id, "results": results,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                              "meta": {"billed_units": {"search_units": 1}}})


async def models(request: web.Request) -> web.Response:
    front: Front = request.app["front"]
    created = request.app["started"]
    return web.json_response({"object": "list", "data": [
        {"id": m.id, "object": "model", "created": created, "owned_by": "transformer-workbench", "kind": m.kind}
        for m in front.models.values()]})


async def health(request: web.Request) -> web.Response:
    """200 once Triton has every model ready, else 503."""
    front: Front = request.app["front"]
    try:
        ready = [await front.client.is_model_ready(name) for name in front.models]
    except Exception as exc:  # noqa: BLE001  (any failure to ask is "not ready")
        return web.json_response({"status": "unavailable", "why": f"Triton at {front.triton_url}: {exc}"}, status=503)
    waiting = [name for name, ok in zip(front.models, ready) if not ok]
    if waiting:
        return web.json_response({"status": "loading", "why": f"not ready in Triton: {', '.join(waiting)}"},
                                 status=503)
    return web.json_response({"status": "ok"})


@web.middleware
async def openai_errors(request: web.Request,
                        handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Keys asked on /v1/ routes; every error (ours, a wrong route or method, a body past the limit) in OpenAI's
    shape."""
    try:
        keyed = request.path.startswith("/v1/") or request.path == ROUTES["sparse"]
        if keyed and not request.app["front"].authorized(request):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", None,
                           "invalid_api_key", "authentication_error")
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPRequestEntityTooLarge as exc:
        return too_large(f"the body is larger than this deployment takes ({exc.text}): send fewer or shorter "
                         "texts", None, "body_too_large").response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status)
        return ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}; the routes are POST "
                                    "/v1/embeddings, POST /v1/rerank, POST /embed_sparse, GET /v1/models, GET "
                                    "/health", None, code).response()


def application(spec: FrontSpec, repository: Path, triton_url: str, keys: list[str]) -> web.Application:
    front = Front(spec, repository, triton_url, keys)
    app = web.Application(middlewares=[openai_errors],
                          client_max_size=max(m.body_bytes() for m in spec.models))
    app["front"], app["started"] = front, int(time.time())

    async def connect(app: web.Application) -> None:
        front.client = grpcclient.InferenceServerClient(url=triton_url)

    async def close(app: web.Application) -> None:
        if front.client is not None:
            await front.client.close()

    app.on_startup.append(connect)
    app.on_cleanup.append(close)
    app.add_routes([web.post(ROUTES["embeddings"], embeddings), web.post(ROUTES["rerank"], rerank),
                    web.post(ROUTES["sparse"], embed_sparse),
                    web.get("/v1/models", models), web.get("/health", health)])
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", type=Path, required=True, help="front.json: the models to serve")
    parser.add_argument("--repository", type=Path, required=True, help="the Triton repository (tokenizers)")
    parser.add_argument("--triton", required=True, help="Triton's gRPC address, host:port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args(argv)
    spec = FrontSpec.model_validate_json(args.spec.read_text(encoding="utf-8"))
    keys = [k for k in os.environ.get(KEY_VARIABLE, "").split(",") if k.strip()]
    app = application(spec, args.repository, args.triton, keys)
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

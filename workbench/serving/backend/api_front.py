"""The API front: OpenAI's embeddings API, Cohere's rerank API (v1 and v2) and text-embeddings-inference's routes
(`api_tei.py`) in front of a running Triton, so the clients of the retrieval stack (openai, LangChain, LlamaIndex,
litellm, cohere, huggingface_hub, the vector databases' TEI hooks) use the verified deployment as they are.

    python api_front.py --spec front.json --repository /models --triton 127.0.0.1:8001 [--host H] [--port 8080]
        [--workers N]

`POST /v1/embeddings`, `POST /v1/rerank`, `POST /v2/rerank`, TEI's `POST /embed`, `/embed_sparse`, `/rerank`,
`/predict`, `/tokenize`, `GET /info`; `GET /v1/models`, `GET /health` (ready when Triton's models are), `GET
/metrics` (Prometheus). Each request is checked against the deployment's limits (the same settings, the same
messages' sense) before it goes to Triton over one shared gRPC channel, so Triton's dynamic batcher still forms
the batches; the model runs in Triton alone. Every refusal is a 4xx in the API's error shape naming the field.
API keys: WORKBENCH_API_KEY (several: comma-separated), asked as `Authorization: Bearer <key>` on every route but
/health and /metrics. `--workers N`: N processes accept on the one port. Runs from the workbench package or as a
file copied beside its siblings (the deployment image).
"""
from __future__ import annotations

import argparse
import base64
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import tritonclient.grpc.aio as grpcclient
from aiohttp import web

if __package__:  # imported from the workbench package, or run with -m
    from .api_core import Front, answer, body, rerank_scores, vectors
    from .api_metrics import CONTENT_TYPE, MULTIPROCESS_VARIABLE
    from .api_schema import (
        ANSWERS,
        KEY_VARIABLE,
        ApiError,
        EmbeddingsRequest,
        FrontSpec,
        RerankRequest,
        RerankV2Request,
        check_texts,
        parse_keys,
        too_large,
    )
    from .api_tei import TEI_PATHS
    from .api_tei import routes as tei_routes
else:  # run as a file copied beside its siblings (the deployment image)
    from api_core import Front, answer, body, rerank_scores, vectors
    from api_metrics import CONTENT_TYPE, MULTIPROCESS_VARIABLE
    from api_schema import (
        ANSWERS,
        KEY_VARIABLE,
        ApiError,
        EmbeddingsRequest,
        FrontSpec,
        RerankRequest,
        RerankV2Request,
        check_texts,
        parse_keys,
        too_large,
    )
    from api_tei import TEI_PATHS
    from api_tei import routes as tei_routes

__all__ = ["KEY_VARIABLE", "ROUTES", "FrontSpec", "application", "main"]
# Each kind of served model's route: OpenAI's, Cohere's and text-embeddings-inference's.
ROUTES = ANSWERS
RERANK_V2 = "/v2/rerank"
OPEN = frozenset({"/health", "/metrics"})  # asked for no key
PR_SET_PDEATHSIG = 1  # prctl(2): a worker gets SIGTERM when its supervisor dies
SHUTDOWN_S = 5.0  # a stopping front waits this long for the requests in flight


async def embeddings(request: web.Request) -> web.Response:
    front: Front = request.app["front"]
    asked = await body(request, EmbeddingsRequest)
    model = front.model(asked.model, "embeddings", ROUTES["embeddings"])
    texts = [asked.input] if isinstance(asked.input, str) else asked.input
    if texts and not all(isinstance(t, str) for t in texts):
        raise ApiError(400, "'input' holds token ids: this deployment tokenizes with the model's own tokenizer, send "
                            "strings (LangChain's OpenAIEmbeddings: check_embedding_ctx_length=False)", "input",
                       "token_ids_not_supported")
    if asked.dimensions is not None and not 1 <= asked.dimensions <= model.dimensions:
        raise ApiError(400, f"dimensions={asked.dimensions}: {model.id} answers at most {model.dimensions} "
                            f"dimensions; ask for 1 to {model.dimensions}, or leave 'dimensions' out",
                       "dimensions", "dimensions_not_supported")
    check_texts(texts, "input", model, model.max_texts, "triton.max_texts")  # type: ignore[arg-type]
    parameters = {k: v for k, v in (("prompt_name", asked.prompt_name), ("prompt", asked.prompt)) if v is not None}
    found, tokens = await vectors(front, model, texts, parameters, ROUTES["embeddings"], count=True)  # type: ignore[arg-type]
    front.metrics.tokens.labels(ROUTES["embeddings"]).inc(tokens)
    found = found[:, :asked.dimensions]  # encode(truncate_dim=d): the first d values, not renormalized (docs/api.md)
    encode: Callable[[np.ndarray], object] = (
        (lambda v: base64.b64encode(v.tobytes()).decode("ascii")) if asked.encoding_format == "base64" else
        (lambda v: v))
    return answer({"object": "list", "model": model.id,
                   "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(found)],
                   "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def rerank(request: web.Request) -> web.Response:
    """Cohere's v1 rerank (and Jina's): the documents' scores as CrossEncoder.predict() gives them, best first."""
    front: Front = request.app["front"]
    asked = await body(request, RerankRequest)
    model = front.model(asked.model, "rerank", ROUTES["rerank"])
    documents = [d if isinstance(d, str) else d.text for d in asked.documents]
    check_texts([asked.query], "query", model, None, "")
    check_texts(documents, "documents", model, model.max_documents, "triton.max_documents")
    scores, tokens = await rerank_scores(front, model, asked.query, documents, ROUTES["rerank"], "documents")
    front.metrics.tokens.labels(ROUTES["rerank"]).inc(tokens)
    order = np.argsort(-scores, kind="stable")[:asked.top_n]
    results = [{"index": int(i), "relevance_score": float(scores[i]),
                **({"document": {"text": documents[i]}} if asked.return_documents else {})} for i in order]
    return answer({"id": str(uuid.uuid4()), "model": model.id, "results": results,
                   "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                   "meta": {"billed_units": {"search_units": 1}}})


async def rerank_v2(request: web.Request) -> web.Response:
    """Cohere's v2 rerank (`cohere.ClientV2`): documents are strings; `max_tokens_per_doc` may not cut below what
    the model reads of a pair, as the deployment cuts pairs as CrossEncoder does."""
    front: Front = request.app["front"]
    asked = await body(request, RerankV2Request)
    model = front.model(asked.model, "rerank", RERANK_V2)
    if asked.max_tokens_per_doc is not None and asked.max_tokens_per_doc < model.max_length:
        raise ApiError(422, f"max_tokens_per_doc={asked.max_tokens_per_doc}: this deployment reads each query and "
                            f"document together up to {model.max_length} tokens, as CrossEncoder.predict() does, and "
                            f"cuts no shorter; leave it out or give {model.max_length} or more",
                       "max_tokens_per_doc", "unsupported")
    check_texts([asked.query], "query", model, None, "")
    check_texts(asked.documents, "documents", model, model.max_documents, "triton.max_documents")
    scores, tokens = await rerank_scores(front, model, asked.query, asked.documents, RERANK_V2, "documents")
    front.metrics.tokens.labels(RERANK_V2).inc(tokens)
    order = np.argsort(-scores, kind="stable")[:asked.top_n]
    return answer({"id": str(uuid.uuid4()),
                   "results": [{"index": int(i), "relevance_score": float(scores[i])} for i in order],
                   "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1}}})


async def models(request: web.Request) -> web.Response:
    front: Front = request.app["front"]
    created = request.app["started"]
    return answer({"object": "list", "data": [
        {"id": m.id, "object": "model", "created": created, "owned_by": "transformer-workbench", "kind": m.kind}
        for m in front.models.values()]})


async def health(request: web.Request) -> web.Response:
    """200 once Triton has every model ready, else 503; `instance` names this front (`--instance`), so whoever
    started it knows the answer is its own."""
    front: Front = request.app["front"]
    mine = {"instance": request.app["instance"]}
    assert front.client is not None, "the application's startup connects the client"
    try:
        ready = [await front.client.is_model_ready(name) for name in front.models]
    except Exception as exc:  # noqa: BLE001  (any failure to ask is "not ready")
        return web.json_response({"status": "unavailable", "why": f"Triton at {front.triton_url}: {exc}", **mine},
                                 status=503)
    waiting = [name for name, ok in zip(front.models, ready) if not ok]
    if waiting:
        return web.json_response({"status": "loading", "why": f"not ready in Triton: {', '.join(waiting)}", **mine},
                                 status=503)
    return web.json_response({"status": "ok", **mine})


async def metrics(request: web.Request) -> web.Response:
    front: Front = request.app["front"]
    return web.Response(body=front.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})


def refusal(error: ApiError, tei: bool) -> web.Response:
    """`error` in its API's shape (stdlib json: a message may quote a lone surrogate, escaped)."""
    return web.Response(text=json.dumps(error.body(tei)), status=error.status, content_type="application/json")


async def answered(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                   front: Front, tei: bool) -> web.StreamResponse:
    """The handler's answer; every failure a JSON error: ours, a wrong route or method, a body past the limit, and
    any other exception (500, its traceback in the log)."""
    try:
        if request.path not in OPEN and not front.authorized(request):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", None,
                           "invalid_api_key", "authentication_error")
        return await handler(request)
    except ApiError as exc:
        return refusal(exc, tei)
    except web.HTTPRequestEntityTooLarge as exc:
        return refusal(too_large(f"the body is larger than this deployment takes ({exc.text}): send fewer or "
                                 "shorter texts", "body", "body_too_large"), tei)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status)
        return refusal(ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}; the routes are "
                                            f"{', '.join(request.app['routes'])}", None, code), tei)
    except Exception as exc:  # noqa: BLE001  (a fault of the front's own: answered, never a text/plain 500)
        traceback.print_exc()
        return refusal(ApiError(500, f"the API front failed on this request ({type(exc).__name__}); its log has the "
                                     "traceback", None, "internal_error", "server_error"), tei)


@web.middleware
async def guarded(request: web.Request,
                  handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Keys asked, errors in the route's API shape, and the route's metrics."""
    front: Front = request.app["front"]
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "other"
    started, in_front = time.perf_counter(), front.metrics.in_front.labels(route)
    in_front.inc()
    status = "499"  # the client went away: its handler is cancelled
    try:
        response = await answered(request, handler, front, route in TEI_PATHS)
        status = str(response.status)
        return response
    finally:
        in_front.dec()
        front.metrics.requests.labels(route, status).inc()
        front.metrics.latency.labels(route).observe(time.perf_counter() - started)


def application(spec: FrontSpec, repository: Path, triton_url: str, keys: list[str],
                instance: str = "") -> web.Application:
    front = Front(spec.models, repository, triton_url, keys)
    app = web.Application(middlewares=[guarded], client_max_size=max(m.body_bytes() for m in spec.models))
    app["front"], app["started"], app["instance"] = front, int(time.time()), instance

    async def connect(app: web.Application) -> None:
        front.client = grpcclient.InferenceServerClient(url=triton_url)

    async def close(app: web.Application) -> None:
        if front.client is not None:
            await front.client.close()

    app.on_startup.append(connect)
    app.on_cleanup.append(close)
    app.add_routes([web.post(ROUTES["embeddings"], embeddings), web.post(ROUTES["rerank"], rerank),
                    web.post(RERANK_V2, rerank_v2), *tei_routes(),
                    web.get("/v1/models", models), web.get("/health", health), web.get("/metrics", metrics)])
    app["routes"] = [f"{route.method} {route.resource.canonical}" for route in app.router.routes()
                     if route.resource is not None and route.method != "HEAD"]
    return app


def listen(host: str, port: int) -> socket.socket:
    """The front's listening socket; OSError when the port is taken (no SO_REUSEPORT: a second front on a port
    fails to start rather than share it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def serve(app: web.Application, sock: socket.socket) -> None:
    """`app` on `sock` until SIGTERM or SIGINT, on uvloop where it is installed; a client that goes away cancels its
    request (and the Triton requests it has not sent)."""
    try:
        import uvloop
    except ImportError:
        loop = None
    else:
        loop = uvloop.new_event_loop()
    web.run_app(app, sock=sock, access_log=None, handler_cancellation=True, loop=loop, shutdown_timeout=SHUTDOWN_S,
                print=lambda line: print(line, flush=True))


def supervise(command: list[str], sock: socket.socket, workers: int) -> int:
    """`workers` processes of `command`, each accepting on `sock` (the fd they inherit), sharing their metrics'
    files; until SIGTERM or SIGINT, or until one exits (then the rest are stopped): its exit code."""
    shared = tempfile.mkdtemp(prefix="workbench-front-metrics-")
    env = {**os.environ, MULTIPROCESS_VARIABLE: shared}
    children = [subprocess.Popen([*command, "--worker-fd", str(sock.fileno()), "--supervisor", str(os.getpid())],
                                 env=env, pass_fds=(sock.fileno(),)) for _ in range(workers)]
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    code = 0
    while not stopping:
        ended = [child for child in children if child.poll() is not None]
        if ended:
            code = ended[0].returncode or 1
            print(f"a front worker (pid {ended[0].pid}) exited with code {ended[0].returncode}: stopping the others",
                  flush=True)
            break
        time.sleep(0.2)
    for child in children:
        if child.poll() is None:
            child.terminate()
    for child in children:
        child.wait()
    for name in os.listdir(shared):
        os.unlink(os.path.join(shared, name))
    os.rmdir(shared)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", type=Path, required=True, help="front.json: the models to serve")
    parser.add_argument("--repository", type=Path, required=True, help="the Triton repository (tokenizers)")
    parser.add_argument("--triton", required=True, help="Triton's gRPC address, host:port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--workers", type=int, default=1, help="processes accepting on the port")
    parser.add_argument("--instance", default="", help="a name /health answers with")
    parser.add_argument("--worker-fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--supervisor", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        keys = parse_keys(os.environ.get(KEY_VARIABLE, ""))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    spec = FrontSpec.model_validate_json(args.spec.read_text(encoding="utf-8"))
    if args.worker_fd is not None:  # a worker: dies with its supervisor, even one that died before this line
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != args.supervisor:
            return 0
        serve(application(spec, args.repository, args.triton, keys, args.instance),
              socket.socket(fileno=args.worker_fd))
        return 0
    try:
        sock = listen(args.host, args.port)
    except OSError as exc:
        print(f"error: the API front cannot listen on {args.host}:{args.port} ({exc.strerror}): another process "
              "holds that port; choose another --api-port (0 picks a free one) or stop what listens there",
              file=sys.stderr, flush=True)
        return 3
    if args.workers <= 1:
        serve(application(spec, args.repository, args.triton, keys, args.instance), sock)
        return 0
    itself = [sys.executable, "-m", __spec__.name] if __spec__ is not None else [sys.executable, __file__]
    return supervise([*itself, *(argv if argv is not None else sys.argv[1:])], sock, args.workers)


if __name__ == "__main__":
    sys.exit(main())

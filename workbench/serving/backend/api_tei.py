"""text-embeddings-inference's routes, so TEI's clients (huggingface_hub's InferenceClient, the vector databases'
TEI hooks, TEI's documented curl) use the deployment unchanged: `/embed`, `/embed_sparse`, `/rerank`, `/predict`,
`/tokenize`, `/info` and `POST /` (TEI's route for whichever kind it serves). Errors in TEI's shape,
`{"error", "error_type"}`. Where the front serves several models of a kind, `model` (an extra field) names one.
Imports nothing from the workbench (copied beside api_front.py)."""
from __future__ import annotations

import numpy as np
from aiohttp import web

if __package__:
    from .api_core import (
        Front,
        answer,
        class_logits,
        class_scores,
        read_json,
        rerank_scores,
        sparse_terms,
        validated,
        vectors,
    )
    from .api_schema import (
        ApiError,
        EmbedRequest,
        PredictRequest,
        ServedModel,
        TeiRequest,
        TeiRerankRequest,
        TokenizeRequest,
        check_texts,
    )
else:
    from api_core import (
        Front,
        answer,
        class_logits,
        class_scores,
        read_json,
        rerank_scores,
        sparse_terms,
        validated,
        vectors,
    )
    from api_schema import (
        ApiError,
        EmbedRequest,
        PredictRequest,
        ServedModel,
        TeiRequest,
        TeiRerankRequest,
        TokenizeRequest,
        check_texts,
    )

ROUTES = {"embeddings": "/embed", "sparse": "/embed_sparse", "rerank": "/rerank", "classify": "/predict"}
TEI_PATHS = frozenset({*ROUTES.values(), "/tokenize", "/info", "/"})  # answered in TEI's error shape


def any_model(front: Front, name: str | None) -> ServedModel:
    """The served model `name`, of any kind (None: the first served); 404 naming it where it is not served."""
    if name is None:
        return next(iter(front.models.values()))
    if name not in front.models:
        raise ApiError(404, f"model {name!a} is not served here; GET /v1/models lists what is", "model",
                       "model_not_found")
    return front.models[name]


def tei_fields(data: object) -> object:
    """The request with InferenceClient's nested `parameters` lifted beside `inputs`."""
    if isinstance(data, dict) and isinstance(data.get("parameters"), dict):
        return {**data["parameters"], **{k: v for k, v in data.items() if k != "parameters"}}
    return data


def prompt_of(asked: TeiRequest) -> dict[str, str]:
    return {"prompt_name": asked.prompt_name} if asked.prompt_name is not None else {}


async def embed_data(front: Front, data: object) -> web.Response:
    asked = validated(tei_fields(data), EmbedRequest)
    model = front.model(asked.model, "embeddings", ROUTES["embeddings"])
    texts = [asked.inputs] if isinstance(asked.inputs, str) else asked.inputs
    check_texts(texts, "inputs", model, model.max_texts, "triton.max_texts")
    if asked.dimensions is not None and not 1 <= asked.dimensions <= model.dimensions:
        raise ApiError(422, f"dimensions={asked.dimensions}: {model.id} answers at most {model.dimensions}; ask for "
                            f"1 to {model.dimensions}, or leave it out", "dimensions", "dimensions_not_supported")
    found, _ = await vectors(front, model, texts, prompt_of(asked), ROUTES["embeddings"], count=False)
    found = found[:, :asked.dimensions]
    if asked.normalize:  # TEI's default; a model whose last module normalizes is unchanged
        found = found / np.maximum(np.linalg.norm(found, axis=1, keepdims=True), 1e-12)
    return answer(found)


async def embed(request: web.Request) -> web.Response:
    return await embed_data(request.app["front"], await read_json(request))


async def embed_sparse_data(front: Front, data: object) -> web.Response:
    asked = validated(tei_fields(data), EmbedRequest)
    model = front.model(asked.model, "sparse", ROUTES["sparse"])
    texts = [asked.inputs] if isinstance(asked.inputs, str) else asked.inputs
    check_texts(texts, "inputs", model, model.max_texts, "triton.max_texts")
    return answer(await sparse_terms(front, model, texts, prompt_of(asked), ROUTES["sparse"]))


async def embed_sparse(request: web.Request) -> web.Response:
    return await embed_sparse_data(request.app["front"], await read_json(request))


async def rerank_data(front: Front, data: object) -> web.Response:
    """Each text's score against the query as CrossEncoder.predict() gives it, best first: [{"index", "score"(,
    "text")}]."""
    asked = validated(tei_fields(data), TeiRerankRequest)
    model = front.model(asked.model, "rerank", ROUTES["rerank"])
    check_texts([asked.query], "query", model, None, "")
    check_texts(asked.texts, "texts", model, model.max_documents, "triton.max_documents")
    if asked.raw_scores:
        raise ApiError(422, "raw_scores=true: this deployment answers the scores CrossEncoder.predict() gives (its "
                            "activation applied); leave raw_scores out", "raw_scores", "unsupported")
    scores, _ = await rerank_scores(front, model, asked.query, asked.texts, ROUTES["rerank"], "texts")
    order = np.argsort(-scores, kind="stable")
    return answer([{"index": int(i), "score": float(scores[i]), **({"text": asked.texts[i]} if asked.return_text
                                                                  else {})} for i in order])


async def rerank(request: web.Request) -> web.Response:
    return await rerank_data(request.app["front"], await read_json(request))


def predict_texts(inputs: str | list[str] | list[list[str]]) -> list[str]:
    """The texts of /predict's inputs: one, a list, or a list of one-text lists; a pair is refused (the served
    classifiers read one text)."""
    if isinstance(inputs, str):
        return [inputs]
    texts = []
    for index, item in enumerate(inputs):
        if isinstance(item, list) and len(item) != 1:
            raise ApiError(422, f"inputs[{index}] holds {len(item)} texts: this classifier reads one text; send "
                                "inputs as a list of strings", "inputs", "pairs_not_supported")
        texts.append(item if isinstance(item, str) else item[0])
    return texts


async def predict_data(front: Front, data: object) -> web.Response:
    """Per text, every label with its score, best first: [{"score", "label"}] (a list of those for a batch)."""
    asked = validated(tei_fields(data), PredictRequest)
    model = front.model(asked.model, "classify", ROUTES["classify"])
    texts = predict_texts(asked.inputs)
    check_texts(texts, "inputs", model, model.max_texts, "triton.max_texts")
    logits = await class_logits(front, model, texts, ROUTES["classify"])
    scores = logits if asked.raw_scores else class_scores(logits, model.activation)
    found = [[{"score": float(row[i]), "label": model.labels[i]} for i in np.argsort(-row, kind="stable")]
             for row in scores]
    return answer(found[0] if isinstance(asked.inputs, str) else found)


async def predict(request: web.Request) -> web.Response:
    return await predict_data(request.app["front"], await read_json(request))


async def tokenize(request: web.Request) -> web.Response:
    """Per text, its tokens as the served model reads them (after the prompt; cut at its max_length): [{"id",
    "text", "special", "start", "stop"}], start and stop the character offsets in the text sent."""
    front: Front = request.app["front"]
    asked = validated(tei_fields(await read_json(request)), TokenizeRequest)
    model = any_model(front, asked.model)
    texts = [asked.inputs] if isinstance(asked.inputs, str) else asked.inputs
    check_texts(texts, "inputs", model, model.max_texts, "triton.max_texts")
    encoder = front.encoders[model.id]
    if encoder.backend is None:
        raise ApiError(501, f"{model.id}'s tokenizer has no fast backend to give offsets", "inputs", "unsupported")
    prompted = front.prompted(model, texts, prompt_of(asked))
    found = []
    for text in prompted:
        encoding = encoder.backend.encode(text, add_special_tokens=asked.add_special_tokens)
        found.append([{"id": token, "text": text[start:stop] if not special else piece, "special": bool(special),
                       "start": start, "stop": stop}
                      for token, piece, special, (start, stop) in zip(encoding.ids, encoding.tokens,
                                                                      encoding.special_tokens_mask, encoding.offsets)])
    return answer(found)


def model_type(model: ServedModel) -> dict[str, object]:
    if model.kind in ("classify", "rerank"):
        labels = model.labels or ["LABEL_0"]
        return {"classifier" if model.kind == "classify" else "reranker": {
            "id2label": {str(i): label for i, label in enumerate(labels)},
            "label2id": {label: i for i, label in enumerate(labels)}}}
    return {"embedding": {}}


async def info(request: web.Request) -> web.Response:
    """TEI's /info for the model `?model=` names (else the first served): its id, kind and limits."""
    front: Front = request.app["front"]
    model = any_model(front, request.query.get("model"))
    return answer({"model_id": model.id, "model_sha": None, "model_dtype": "as deployed", "model_type": model_type(
        model), "max_input_length": model.max_length, "max_client_batch_size": model.max_texts or 0,
        "max_batch_tokens": model.max_request_tokens or 0, "max_batch_requests": model.batch or None,
        "auto_truncate": True, "tokenization_workers": 1, "version": "transformer-workbench api front"})


async def root(request: web.Request) -> web.Response:
    """TEI's `POST /`: a query with texts is a rerank; else the kind served (an embedding model first)."""
    front: Front = request.app["front"]
    data = await read_json(request)
    if isinstance(data, dict) and "query" in data and "texts" in data:
        return await rerank_data(front, data)
    kinds = {m.kind for m in front.models.values()}
    for kind, route in (("embeddings", embed_data), ("classify", predict_data), ("sparse", embed_sparse_data)):
        if kind in kinds:
            return await route(front, data)
    raise ApiError(422, "POST / takes a query with texts here (this deployment serves a reranker): send "
                        "{\"query\": ..., \"texts\": [...]}, or POST /rerank", "query", "invalid_value")


def routes() -> list[web.RouteDef]:
    return [web.post(ROUTES["embeddings"], embed), web.post(ROUTES["sparse"], embed_sparse),
            web.post(ROUTES["rerank"], rerank), web.post(ROUTES["classify"], predict),
            web.post("/tokenize", tokenize), web.get("/info", info), web.post("/", root)]

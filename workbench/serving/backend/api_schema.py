"""What the API front serves and takes: the served models (`front.json`), the requests of OpenAI's, Cohere's (v1 and
v2) and text-embeddings-inference's APIs, their errors in each API's shape, the deployment's limits and the API keys.
Imports nothing from the workbench (copied beside api_front.py into the deployment image)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

KEY_VARIABLE = "WORKBENCH_API_KEY"
BODY_SLACK = 2**20  # bytes a request body may hold past its texts (JSON syntax, the other fields)
UTF8_BYTES = 4  # at most, per character
Kind = Literal["embeddings", "rerank", "sparse", "classify"]
KINDS: dict[str, str] = {"embeddings": "embedding model", "rerank": "reranker", "sparse": "sparse encoder",
                         "classify": "classifier"}
ANSWERS: dict[str, str] = {"embeddings": "/v1/embeddings", "rerank": "/v1/rerank", "sparse": "/embed_sparse",
                           "classify": "/predict"}  # the route that answers each kind


class ServedModel(BaseModel):
    """One model the front answers for: its Triton name (the API's `model`), what it does, and the limits and
    tokenizer of the deployment (`workbench.serving.front.front_spec` reads them from the repository)."""

    id: str
    kind: Kind
    output: str  # the Triton output that answers: the embedding, the scores, or a classifier's logits
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
    labels: list[str] = Field(default_factory=list)  # a classifier's, in id order
    activation: str = ""  # a classifier's head: softmax, sigmoid (multi-label) or none (regression)

    def body_bytes(self) -> int:
        """The largest request body its limits allow."""
        texts = (self.max_documents or 1024) + 1 if self.kind == "rerank" else self.max_texts or 2048
        return texts * (self.max_text_chars or 100_000) * UTF8_BYTES + BODY_SLACK


class FrontSpec(BaseModel):
    """What `front.json` holds: the models the front serves."""

    models: list[ServedModel]


class Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class EmbeddingsRequest(Request):
    """OpenAI's embeddings request, and the model's prompt (`prompt_name`, or the `prompt` text itself)."""

    input: str | list[str] | list[int] | list[list[int]]
    model: str
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    prompt_name: str | None = None
    prompt: str | None = None


class Document(BaseModel):
    text: str


class RerankRequest(Request):
    """The rerank request of Cohere's v1 API and Jina's."""

    model: str
    query: str
    documents: list[str | Document]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = False


class RerankV2Request(Request):
    """Cohere's v2 rerank request (`cohere.ClientV2.rerank`): documents are strings; `max_tokens_per_doc` cuts each
    document."""

    model: str
    query: str
    documents: list[str]
    top_n: int | None = Field(default=None, ge=1)
    max_tokens_per_doc: int | None = Field(default=None, ge=1)


class TeiRequest(Request):
    """What text-embeddings-inference's routes share: `model` (an extra field) names one where the front serves
    several of a kind; `parameters` holds the fields of huggingface_hub's InferenceClient, which nests them."""

    model: str | None = None
    truncate: bool | None = None  # texts are cut at the model's limit, as sentence-transformers cuts them
    truncation_direction: Literal["right", "Right", "left", "Left"] | None = None
    prompt_name: str | None = None
    parameters: dict[str, object] | None = None


class EmbedRequest(TeiRequest):
    """TEI's /embed (and /embed_sparse)."""

    inputs: str | list[str]
    normalize: bool = True
    dimensions: int | None = None


class TeiRerankRequest(TeiRequest):
    """TEI's /rerank."""

    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False


class PredictRequest(TeiRequest):
    """TEI's /predict: one text, a pair, or a batch of either."""

    inputs: str | list[str] | list[list[str]]
    raw_scores: bool = False


class TokenizeRequest(TeiRequest):
    """TEI's /tokenize."""

    inputs: str | list[str]
    add_special_tokens: bool = True


class ApiError(Exception):
    """A refused request: its status, message (naming the field and the fix), field and code; answered in OpenAI's
    shape, or in text-embeddings-inference's on its routes (`tei`)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self, tei: bool) -> dict[str, object]:
        if tei:  # TEI's ErrorResponse: its error_type by status
            kind = {401: "Unauthorized", 413: "Validation", 422: "Validation", 503: "Unhealthy"}.get(
                self.status, "Backend" if self.status >= 500 else "Validation")
            return {"error": self.message, "error_type": kind}
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def too_large(message: str, param: str, code: str) -> ApiError:
    return ApiError(413, message, param, code)


def check_texts(texts: list[str], param: str, model: ServedModel, count_limit: int | None,
                count_setting: str) -> None:
    """The request's texts within the deployment's limits and valid Unicode: ApiError naming the text, or the limit
    and its setting."""
    if not texts:
        raise ApiError(400, f"'{param}' is empty: send at least one text", param, "empty_input")
    if count_limit and len(texts) > count_limit:
        raise too_large(f"{len(texts)} texts in '{param}'; this deployment takes at most {count_limit} in one "
                        f"request ({count_setting}): send them in smaller requests (LangChain's OpenAIEmbeddings: "
                        f"chunk_size={count_limit})", param, "too_many_inputs")
    for index, text in enumerate(texts):
        where = f"{param}[{index}]" if len(texts) > 1 or param not in ("query", "input", "inputs") else param
        if not text:  # whitespace alone is a text: encode() embeds it
            raise ApiError(400, f"{where} is empty: send at least one character", param, "empty_input")
        if model.max_text_chars and len(text) > model.max_text_chars:
            raise too_large(f"{where} has {len(text)} characters; this deployment takes at most "
                            f"{model.max_text_chars} in one text (triton.max_text_chars): send the part the model "
                            f"reads (it reads {model.max_length} tokens)", param, "text_too_long")
        check_unicode(text, where, param)


def check_unicode(text: str, where: str, param: str) -> None:
    """400 naming `where` for a text with a lone surrogate (half of a character, as JavaScript sends a cut emoji):
    it has no UTF-8 form, so no tokenizer reads it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{where} holds a lone surrogate ({text[exc.start]!a} at character {exc.start}), half of "
                            "a character with no UTF-8 form: send whole characters (a cut emoji's two halves "
                            "together, or neither)", param, "invalid_unicode") from None


def parse_keys(value: str, source: str = KEY_VARIABLE) -> list[str]:
    """The API keys in `value` as users write them ("alpha, beta": each stripped); ValueError naming an empty entry
    (a stray comma, or spaces alone) of `source`. An empty value: no keys."""
    if not value:
        return []
    entries = [entry.strip() for entry in value.split(",")]
    empty = [str(index + 1) for index, entry in enumerate(entries) if not entry]
    if empty:
        which = f"entry {empty[0]}" if len(empty) == 1 else f"entries {', '.join(empty[:-1])} and {empty[-1]}"
        raise ValueError(f"{source} has an empty key ({which} of {len(entries)}, comma-separated): remove the stray "
                         "comma, or leave it unset to ask for no key")
    return entries

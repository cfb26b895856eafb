"""What a served repository answers: its models that take text from clients (ensembles, fused one-hop models, or a
reranker's query and documents), and one-line `curl` and `perf_analyzer` commands for them."""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from workbench.serving.errors import RepositoryError
from workbench.serving.repository import read_repository

TEXT_INPUT = "TEXT"
RERANK_INPUTS = ("QUERY", "DOCUMENTS")  # a reranker's (serving/backend/rerank_model.py)
# The output that answers, when the ensemble has it: a label (classification), an embedding, generated text.
ANSWERS = ("label", "sentence_embedding", "OUTPUT_TEXT")
SAMPLE_TEXT = "Triton serves this sentence through the workbench."
SAMPLE_DOCUMENT = "A second document, scored against the same query."


@dataclass(frozen=True)
class TextEndpoint:
    """A model clients send text to: its name, the shape of one text, and the output that answers."""

    model: str
    shape: list[int]
    output: str
    reranks: bool = False  # takes a query and its documents


def text_endpoints(repository: Path) -> list[TextEndpoint]:
    """Every model in `repository` that takes TEXT and is no ensemble's step (the ensemble, not its tokenizer; a
    fused model), or a reranker's query and documents; RepositoryError when the folder is missing or has none."""
    fix = "pass the folder the triton step published (model_repository/<name>), or serve a run with --run <run folder>"
    if not repository.is_dir():
        raise RepositoryError(f"model repository {repository} does not exist or is not a folder", fix)
    endpoints = []
    models = read_repository(repository)
    steps = {step.model_name for config in models.values() for step in config.ensemble_scheduling.step}
    for name, config in models.items():
        if {i.name for i in config.input} >= set(RERANK_INPUTS):
            endpoints.append(TextEndpoint(name, [-1], "scores", reranks=True))
        elif name not in steps and any(i.name == TEXT_INPUT for i in config.input):
            dims = [d if d > 0 else 1 for d in next(i.dims for i in config.input if i.name == TEXT_INPUT)]
            outputs = [o.name for o in config.output]
            output = next((o for o in ANSWERS if o in outputs), outputs[0])
            endpoints.append(TextEndpoint(name, [1, *dims] if config.max_batch_size > 0 else dims, output))
    if not endpoints:
        raise RepositoryError(f"{repository} holds no model that takes a {TEXT_INPUT} input (or a reranker's "
                              f"{' and '.join(RERANK_INPUTS)}) from clients", fix)
    return endpoints


def curl_command(http_url: str, endpoint: TextEndpoint, text: str) -> str:
    """A KServe v2 JSON request for `text` (BYTES, one per batch row). It names no outputs, so every output comes
    back: tritonserver 2.51 (nvidia-pytriton) fails a request that names the label alone, or any set of a
    classification ensemble's outputs without all of logits, label and score ("unexpected deadlock, at least one
    output is not set while no more ensemble steps can be made")."""
    body = {"inputs": [{"name": TEXT_INPUT, "datatype": "BYTES", "shape": endpoint.shape, "data": [text]}]}
    if endpoint.reranks:  # the text as the query, with itself and one more document
        body = {"inputs": [{"name": "QUERY", "datatype": "BYTES", "shape": [1], "data": [text]},
                           {"name": "DOCUMENTS", "datatype": "BYTES", "shape": [2], "data": [text, SAMPLE_DOCUMENT]}]}
    return shlex.join(["curl", "-s", f"http://{http_url}/v2/models/{endpoint.model}/infer",
                       "-H", "Content-Type: application/json", "-d", json.dumps(body, separators=(",", ":"))])


def perf_analyzer_command(executable: list[str], grpc_url: str, endpoint: TextEndpoint, input_data: Path,
                          options: list[str]) -> str:
    """perf_analyzer at concurrency 1 over gRPC (the workbench's load protocol), one text per request from
    `input_data`."""
    return shlex.join([*executable, "-m", endpoint.model, "-u", grpc_url, "-i", "grpc", "-b", "1",
                       "--input-data", str(input_data), "--concurrency-range", "1:1", *options])


def request_lines(url: str, models: list[tuple[str, str]], sample: str, keyed: bool) -> list[str]:
    """A curl per (model, kind) through the front at `url`, and the openai client's three lines for an embedder;
    `keyed`: the requests send $WORKBENCH_API_KEY."""
    from workbench.serving.backend.api_front import KEY_VARIABLE, ROUTES

    # the shell fills the key in: the first of several (comma-separated)
    key = f' -H "Authorization: Bearer ${{{KEY_VARIABLE}%%,*}}"' if keyed else ""

    def curl(kind: str, body: dict[str, object]) -> str:
        return (f"  curl -s {url}{ROUTES[kind]} -H 'Content-Type: application/json'{key} -d "
                f"{shlex.quote(json.dumps(body))}")
    lines = []
    for model, kind in models:
        if kind == "rerank":
            lines += [f"rerank two documents with {model}:", curl("rerank", {
                "model": model, "query": sample, "documents": [sample, SAMPLE_DOCUMENT], "top_n": 1})]
            continue
        if kind == "classify":
            lines += [f"classify a text with {model} (text-embeddings-inference's predict API):",
                      curl("classify", {"model": model, "inputs": sample})]
            continue
        if kind == "sparse":
            lines += [f"a text's active terms with {model} (text-embeddings-inference's sparse API):",
                      curl("sparse", {"model": model, "inputs": [sample]})]
            continue
        lines += [f"embed a text with {model} (OpenAI's embeddings API):",
                  curl("embeddings", {"model": model, "input": [sample]}),
                  "the same from Python, with the openai client:",
                  "  from openai import OpenAI",
                  f"  client = OpenAI(base_url=\"{url}/v1\", api_key=\"{'<your key>' if keyed else 'none'}\")",
                  f"  client.embeddings.create(model=\"{model}\", input=[\"{sample}\"]).data[0].embedding"]
    return lines

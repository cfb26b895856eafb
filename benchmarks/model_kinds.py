"""Every model kind of issue 77, as a new user runs it: the CLI's exit and wall, what is served, and the served
answers against the model's own library.

    .venv/bin/python benchmarks/model_kinds.py [--kinds e5_prompts,splade,...] [--out DIR]

Each kind is a tiny random-weight model built here (`workbench/models/tiny.py`, no hub) and run with every setting at
its default: `workbench run --model <folder> --steps export,optimize,parity,triton` (the deployment published under
DIR/repos, a fresh reference cache under DIR), timed as a whole. For a kind that deploys, a Triton server of the
published repository and the API front before it answer the corpus texts (their tokens counted by the run's
tokenizer: <=16, 17-64, >64) over HTTP, gRPC and the front, against the library the model ships for, cut where the
deployment cuts (its max_seq_length set to the deployment's limit): `SentenceTransformer.encode()` (max abs / min
cosine), `SparseEncoder.encode()` (top-20 term overlap / dot-product relative error), the text-classification
pipeline's `top_k=None` scores, transformers' token logits and `CrossEncoder.predict()` (max abs). A kind with prompts
is asked with `prompt_name=query`; a kind the front has no route for says so. A refused kind reports its message's
first line (paths relative to DIR). Printed: one Markdown table (kind | exit | wall s | served variant | gate | HTTP |
gRPC | API front per bucket | note): the served variant with its embedding width or classifier head; the gate, its
recorded parity criterion (run.json metrics.parity, the one it passes by the least) and how many of the triton step's
served checks passed (metrics.triton). Writes DIR/model_kinds.json; exits 0 whatever a kind does (a measurement,
not a test).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from timeline import ROOT

from workbench.core.data import load_corpus
from workbench.core.record import RunRecord
from workbench.graphs.tables import ExportMetrics
from workbench.interrupt import script_exit
from workbench.models import tiny
from workbench.precision.sparse import sparse_agreement, terms
from workbench.report.recommend import gate
from workbench.serving.backend.sparse_terms import dense_rows
from workbench.serving.client import TritonClient
from workbench.serving.errors import RepositoryError
from workbench.serving.front import ApiFront
from workbench.serving.server import TritonServer
from workbench.serving.tables import TritonMetrics

STEPS = "export,optimize,parity,triton"
BUCKETS = (("<=16", 0, 16), ("17-64", 17, 64), (">64", 65, 10**9))
CHUNK = 8  # texts (or documents) per request
E5_PROMPTS = {"query": "query: ", "passage": "passage: "}
CUSTOM_ENCODER = '''from transformers import BertConfig, BertModel


class MyConfig(BertConfig):
    model_type = "my-encoder"


class MyModel(BertModel):
    config_class = MyConfig
'''


def _edit_json(path: Path, **changes: Any) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text(encoding="utf-8")), **changes}), encoding="utf-8")


def matryoshka(dest: Path) -> Path:
    """Mean pooling, Dense to 48, Normalize, truncate_dim 16 in config_sentence_transformers.json."""
    tiny.build_sentence_encoder(dest, pooling="mean", dense=48, normalize=True)
    _edit_json(dest / "config_sentence_transformers.json", truncate_dim=16)
    return Path(dest)


def custom_module(dest: Path) -> Path:
    """The Matryoshka model with the model's own module (scale_module.Scale) appended to modules.json."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        return tiny.with_custom_module(matryoshka(Path(scratch) / "matryoshka"), dest)


def multi_label(dest: Path) -> Path:
    tiny.build_encoder(dest, "bert", "sequence-classification", labels=5)
    _edit_json(dest / "config.json", problem_type="multi_label_classification")
    return dest


def spiece_only(dest: Path) -> Path:
    """A sentence-T5 whose tokenizer is only `spiece.model` (trained here, T5's ids: pad 0, eos 1, unk 2), as T5,
    ALBERT and XLNet checkpoints ship it."""
    import sentencepiece

    tiny.build_sentence_t5(dest)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (dest / name).unlink(missing_ok=True)
    corpus = dest.parent / f"{dest.name}-corpus.txt"
    corpus.write_text("\n".join(load_corpus()), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(dest / "spiece"), vocab_size=300, model_type="unigram",
        hard_vocab_limit=False, character_coverage=0.999, pad_id=0, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
    (dest / "spiece.vocab").unlink()
    corpus.unlink()
    (dest / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "T5Tokenizer",
                                                            "model_max_length": tiny.MAX_POSITIONS}), encoding="utf-8")
    return dest


def auto_map(dest: Path) -> Path:
    """A tiny BERT whose config.json loads its classes from my_encoder.py in the folder (auto_map)."""
    tiny.build_encoder(dest)
    (dest / "my_encoder.py").write_text(CUSTOM_ENCODER, encoding="utf-8")
    _edit_json(dest / "config.json", auto_map={"AutoConfig": "my_encoder.MyConfig", "AutoModel": "my_encoder.MyModel"})
    return dest


def gemma(dest: Path) -> Path:
    return tiny.build_gemma_embedder(dest, truncate_dim=32)


@dataclass(frozen=True)
class Kind:
    """A model kind: how it is built, how its answers are read (embed, sparse, classify, tokens, rerank, refused),
    the run's `-p` settings beyond the defaults, and the prompt it is asked with."""

    name: str
    build: Callable[[Path], Path]
    reads: str
    settings: tuple[str, ...] = ()
    prompt: str | None = None
    new: bool = True

    @property
    def trusted(self) -> bool:
        return "trust_remote_code=true" in self.settings


KINDS = [
    Kind("matryoshka", matryoshka, "embed"),
    Kind("sentence_t5", tiny.build_sentence_t5, "embed"),
    Kind("custom_module", custom_module, "embed", ("trust_remote_code=true",)),
    Kind("custom_module_untrusted", custom_module, "refused"),
    Kind("multi_label", multi_label, "classify"),
    Kind("splade", lambda d: tiny.build_sparse_encoder(d, prompts={"query": "query: ", "document": ""}), "sparse",
         prompt="query"),
    Kind("spiece_only", spiece_only, "embed"),
    Kind("embedding_gemma", gemma, "embed", prompt="query"),
    Kind("e5_prompts", lambda d: tiny.build_sentence_encoder(d, prompts=E5_PROMPTS), "embed", prompt="query",
         new=False),
    Kind("do_lower_case", lambda d: tiny.build_sentence_encoder(d, do_lower_case=True), "embed", new=False),
    Kind("lowercasing_tokenizer", tiny.build_sentence_encoder, "embed", new=False),
    Kind("qwen3_last_token", lambda d: tiny.build_decoder_embedder(d, family="qwen3"), "embed", prompt="query",
         new=False),
    Kind("cross_encoder_1", lambda d: tiny.build_cross_encoder(d, labels=1), "rerank", new=False),
    Kind("cross_encoder_3", lambda d: tiny.build_cross_encoder(d, labels=3), "rerank", new=False),
    Kind("classifier_3", lambda d: tiny.build_encoder(d, "bert", "sequence-classification", labels=3), "classify",
         new=False),
    Kind("token_classifier", lambda d: tiny.build_encoder(d, "bert", "token-classification"), "tokens", new=False),
    Kind("auto_map_untrusted", auto_map, "refused", new=False),
]


def refusal(stderr: str) -> str:
    """The first line of the CLI's error, else the last line it wrote."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and not line.startswith("Executing")]
    return next((line for line in lines if line.startswith(("error (", "stopped ("))), lines[-1] if lines else "")


def run_cli(folder: Path, run_dir: Path, out: Path, settings: tuple[str, ...]) -> tuple[int, float, str]:
    """The CLI run as a user types it: exit code, wall seconds, stderr (all output kept in run_dir.log)."""
    command = [str(ROOT / ".venv" / "bin" / "workbench"), "run", "--model", str(folder), "--steps", STEPS,
               "--output-dir", str(run_dir), "--overwrite", f"-p=triton.repository_dir={out / 'repos'}",
               f"-p=parity.reference_cache_dir={out / 'reference-cache'}", *[f"-p={s}" for s in settings]]
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.time() - started
    run_dir.with_suffix(".log").write_text(f"$ {' '.join(command)}\n{done.stdout}\n{done.stderr}", encoding="utf-8")
    return done.returncode, wall, done.stderr


# ---- the model's own library, cut where the deployment cuts -----------------------------------------------------

def library_answers(kind: Kind, folder: Path, texts: list[str], query: str, cut: int) -> np.ndarray:
    """What the model's library returns for `texts` (rerank: `query` against each as a document)."""
    prompt = {"prompt_name": kind.prompt} if kind.prompt else {}
    if kind.reads in ("embed", "sparse"):
        from sentence_transformers import SentenceTransformer, SparseEncoder

        model = (SparseEncoder if kind.reads == "sparse" else SentenceTransformer)(
            str(folder), device="cpu", trust_remote_code=kind.trusted)
        model.max_seq_length = cut
        if kind.reads == "sparse":
            return model.encode(texts, convert_to_sparse_tensor=False, **prompt).numpy()
        return model.encode(texts, convert_to_numpy=True, **prompt)
    if kind.reads == "rerank":
        from sentence_transformers import CrossEncoder

        return np.asarray(CrossEncoder(str(folder), device="cpu", max_length=cut).predict([(query, t) for t in texts]))
    if kind.reads == "classify":
        from transformers import pipeline

        pipe = pipeline("text-classification", model=str(folder), top_k=None, device="cpu")
        ids = {label: int(i) for i, label in pipe.model.config.id2label.items()}
        rows = np.zeros((len(texts), len(ids)), dtype=np.float32)
        for row, answers in zip(rows, pipe(texts, truncation=True, max_length=cut)):
            for answer in answers:
                row[ids[answer["label"]]] = answer["score"]
        return rows
    import torch
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModelForTokenClassification.from_pretrained(folder)
    with torch.no_grad():
        return [model(**tokenizer(t, truncation=True, max_length=cut, return_tensors="pt")).logits[0].numpy()
                for t in texts]


# ---- what the deployment answers -------------------------------------------------------------------------------

def triton_answers(kind: Kind, client: TritonClient, name: str, texts: list[str], query: str,
                   width: int) -> Any:
    parameters = {"prompt_name": kind.prompt} if kind.prompt else None
    rows: list[Any] = []
    for start in range(0, len(texts), CHUNK):
        chunk = texts[start:start + CHUNK]
        if kind.reads == "rerank":
            rows.append(client.rerank(name, [query], chunk, outputs=["scores"])["scores"])
        elif kind.reads == "sparse":
            got = client.infer_texts(name, chunk, outputs=["sparse_indices", "sparse_values"], parameters=parameters)
            rows.append(dense_rows(got["sparse_indices"], got["sparse_values"], width))
        elif kind.reads == "tokens":
            rows.extend(client.infer_texts(name, chunk, outputs=["logits"])["logits"])
        else:
            output = "score" if kind.reads == "classify" else "sentence_embedding"
            rows.append(client.infer_texts(name, chunk, outputs=[output], parameters=parameters)[output])
    return rows if kind.reads == "tokens" else np.concatenate(rows)


def _post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def front_answers(kind: Kind, api: ApiFront, name: str, texts: list[str], query: str, width: int) -> np.ndarray:
    prompt = {"prompt_name": kind.prompt} if kind.prompt else {}
    rows = []
    for start in range(0, len(texts), CHUNK):
        chunk = texts[start:start + CHUNK]
        if kind.reads == "rerank":
            results = _post(f"{api.url}/v1/rerank", {"model": name, "query": query, "documents": chunk})["results"]
            rows.append(np.array([r["relevance_score"] for r in sorted(results, key=lambda r: r["index"])]))
        elif kind.reads == "sparse":
            answer = _post(f"{api.url}/embed_sparse", {"model": name, "inputs": chunk, **prompt})
            dense = np.zeros((len(chunk), width), dtype=np.float32)
            for row, found in zip(dense, answer):
                row[[t["index"] for t in found]] = [t["value"] for t in found]
            rows.append(dense)
        else:
            answer = _post(f"{api.url}/v1/embeddings", {"model": name, "input": chunk, "encoding_format": "float",
                                                        **prompt})
            rows.append(np.array([d["embedding"] for d in sorted(answer["data"], key=lambda d: d["index"])]))
    return np.concatenate(rows)


def agreement(kind: Kind, got: Any, want: Any) -> dict[str, float]:
    """max abs / min cosine (embeddings), top-20 overlap / dot error (sparse), max abs (scores, logits)."""
    if kind.reads == "sparse":
        found = sparse_agreement(dict(enumerate(map(terms, got))), dict(enumerate(map(terms, want))), want.shape[1])
        return {"top_k_overlap": found["top_k_overlap"], "dot_rel_error": found["dot_rel_error"]}
    if kind.reads == "tokens":
        return {"max_abs": max(float(np.abs(g[:len(w)] - w).max()) for g, w in zip(got, want))}
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if kind.reads == "classify" and got.shape[-1] == 1:  # a softmax head serves the best label's probability
        want = want.max(axis=-1, keepdims=True)
    got = got.reshape(want.shape)  # a one-label reranker: [N, 1] served, [N] predicted
    if kind.reads != "embed":
        return {"max_abs": float(np.abs(got - want).max())}
    cosine = np.sum(got * want, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    return {"max_abs": float(np.abs(got - want).max()), "min_cosine": float(cosine.min())}


def served_check(kind: Kind, folder: Path, record: RunRecord, scratch: Path) -> tuple[dict[str, Any], str]:
    """Per protocol and bucket, the served answers against the library's; and what the front said if it has no
    route for this model."""
    deployment = record.current(TritonMetrics)
    name, repository = deployment.name, Path(deployment.repository)
    cut = record.needed(ExportMetrics).max_sequence
    tokenizer = record.tokenizer()
    corpus = list(load_corpus())
    lengths = [len(ids) for ids in tokenizer(corpus, verbose=False)["input_ids"]]
    buckets = {label: [t for t, n in zip(corpus, lengths) if low <= n <= high] for label, low, high in BUCKETS}
    query = min(corpus, key=len)  # a reranker's query: the shortest text
    want = {label: library_answers(kind, folder, texts, query, cut) for label, texts in buckets.items()}
    width = next(iter(want.values())).shape[-1] if kind.reads == "sparse" else 0
    found: dict[str, Any] = {}
    no_route = ""
    with TritonServer(repository, scratch / "server") as server:
        for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
            with TritonClient(url, protocol) as client:
                found[protocol] = {label: agreement(kind, triton_answers(kind, client, name, texts, query, width),
                                                    want[label]) for label, texts in buckets.items()}
        try:
            api = ApiFront(repository, server.grpc_url, scratch / "front")
        except RepositoryError as exc:
            no_route = f"API front: {exc.problem.replace(str(repository), name)}"
        else:
            with api:
                found["front"] = {label: agreement(kind, front_answers(kind, api, name, texts, query, width),
                                                   want[label]) for label, texts in buckets.items()}
    found["texts"] = {label: len(texts) for label, texts in buckets.items()}
    return found, no_route


def recorded_gate(record: RunRecord) -> str:
    """The served variant's parity criterion with the least margin, and the triton step's served checks passed."""
    deployment = record.current(TritonMetrics)
    verdict = record.verdicts().get(deployment.variant)
    judged = gate(verdict) if verdict else None
    criterion = (f"{judged.metric} {judged.value:.6g} vs {judged.threshold:g} on {judged.output}" if judged
                 else "no parity gate")
    checks = deployment.served_passed
    return f"{criterion}; served {sum(checks.values())}/{len(checks)} checks pass"


def measure_kind(kind: Kind, out: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"kind": kind.name, "new": kind.new, "settings": list(kind.settings)}
    if kind.build is gemma and not hasattr(tiny, "build_gemma_embedder"):
        return {**row, "exit": None, "note": "not built yet"}
    folder = out / "models" / kind.name
    shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        kind.build(folder)
    except Exception as exc:  # a builder that no longer runs here: its row says so
        return {**row, "exit": None, "note": f"not built: {type(exc).__name__}: {exc}".splitlines()[0]}
    run_dir = out / f"run-{kind.name}"
    code, wall, stderr = run_cli(folder, run_dir, out, kind.settings)
    row.update(exit=code, wall_seconds=round(wall, 1))
    if code != 0:
        return {**row, "note": refusal(stderr).replace(f"{out}/", "")}
    if kind.reads == "refused":
        return {**row, "note": "ran, though a refusal was expected"}
    record = RunRecord.load(run_dir)
    deployment = record.current(TritonMetrics)
    width = record.needed(ExportMetrics).io.outputs.get("sentence_embedding", [None])[-1]
    shown = [f"{width}-d" if isinstance(width, int) else "", f"{deployment.head} head" if deployment.head else ""]
    row.update(served=" ".join([deployment.variant, *filter(None, shown)]), gate=recorded_gate(record))
    try:
        row["agreement"], row["note"] = served_check(kind, folder, record, out / "serve" / kind.name)
    except Exception as exc:  # a measurement: one kind's failure is its row, the others still run
        row["note"] = f"served check failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return row


def _cell(found: dict[str, dict[str, float]] | None) -> str:
    if not found:
        return "-"
    parts = []
    for label, _, _ in BUCKETS:
        value = found[label]
        if "top_k_overlap" in value:
            parts.append(f"{value['top_k_overlap']:.3f} / {value['dot_rel_error']:.1e}")
        elif "min_cosine" in value:
            parts.append(f"{value['max_abs']:.1e} / {value['min_cosine']:.7f}")
        else:
            parts.append(f"{value['max_abs']:.1e}")
    return " · ".join(parts)


def table(rows: list[dict[str, Any]]) -> list[str]:
    buckets = " · ".join(label for label, _, _ in BUCKETS)
    lines = [f"| kind | exit | wall s | served variant | gate | HTTP ({buckets}) | gRPC | API front | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        found = row.get("agreement") or {}
        wall = f"{row['wall_seconds']:.0f}" if row.get("wall_seconds") is not None else "-"
        exit_code = "-" if row.get("exit") is None else str(row["exit"])
        name = row["kind"] + ("" if row["new"] else " (regression)")
        lines.append(f"| {name} | {exit_code} | {wall} | {row.get('served') or '-'} | {row.get('gate') or '-'} | "
                     f"{_cell(found.get('http'))} | {_cell(found.get('grpc'))} | "
                     f"{_cell(found.get('front'))} | {row.get('note') or ''} |")
    return lines


def measure(kinds: list[Kind], out: Path) -> None:
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging

    disable_progress_bars()  # the builders' and loaders' bars: this script prints a table
    logging.disable_progress_bar()
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    rows = []
    for kind in kinds:
        row = measure_kind(kind, out)
        rows.append(row)
        print(f"{kind.name}: exit {row.get('exit')}, {row.get('wall_seconds', 0):.0f} s; {row.get('note') or 'ok'}",
              flush=True)
    total = time.time() - started
    print(f"\nread per bucket of corpus texts by the run's tokens ({', '.join(b for b, _, _ in BUCKETS)}): "
          "max abs / min cosine; sparse: top-20 term overlap / dot-product relative error; scores and logits: max "
          f"abs. Total {total / 60:.1f} min.\n")
    print("\n".join(table(rows)))
    (out / "model_kinds.json").write_text(json.dumps({"steps": STEPS, "buckets": [b for b, _, _ in BUCKETS],
                                                      "total_seconds": round(total, 1), "rows": rows}, indent=1),
                                          encoding="utf-8")
    print(f"written: {out / 'model_kinds.json'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--kinds", default=",".join(k.name for k in KINDS), help="comma-separated kinds")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "model-kinds"),
                        help="folder for the models, runs, repositories and model_kinds.json (rewritten each run)")
    args = parser.parse_args()
    known = {k.name: k for k in KINDS}
    names = [n for n in args.kinds.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown kinds {unknown}: choose among {', '.join(known)}")
    return script_exit(lambda: measure([known[n] for n in names], Path(args.out)), "model_kinds.json not written")


if __name__ == "__main__":
    sys.exit(main())

"""Served answers against the model's own library as it ships, per pipeline case and per text length.

    .venv/bin/python benchmarks/fidelity.py [--out DIR] [--cases NAME,NAME]

Each case is a model built with sentence-transformers' own classes (tiny random weights, 512 positions and
max_seq_length 512, as e5/bge/gte-style models ship) or the embedded all-MiniLM-L6-v2, run through export, optimize,
parity and triton (fp32) with the case's settings; the published repository is then served by a real Triton and
asked, over HTTP, for corpus texts and texts joined from the corpus to about 300, 450 and 600 tokens. Printed per
case and length row (up to the run's cut, past the cut up to the model's limit, past the limit): texts, max abs and
min cosine between the served sentence embeddings and `SentenceTransformer(folder).encode()` as the model ships
(its own max_seq_length; the case's prompt given to encode() as its users give it), and the verdict line the run
printed. Writes DIR/fidelity.json; exits 0 (the numbers are the product, not a gate).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from peerlib.pages import add_page_argument, printed_to

from workbench.core.config import RunConfig  # noqa: E402
from workbench.core.data import load_corpus  # noqa: E402
from workbench.core.record import RunRecord  # noqa: E402
from workbench.interrupt import script_exit  # noqa: E402
from workbench.models.batches import long_texts, token_lengths  # noqa: E402
from workbench.models.loading import resolve_source  # noqa: E402
from workbench.models.tiny import build_encoder, build_sentence_encoder  # noqa: E402
from workbench.serving.client import TritonClient  # noqa: E402
from workbench.serving.server import TritonServer  # noqa: E402
from workbench.steps import export, optimize, parity, triton, verdict_line  # noqa: E402

LONG = (300, 450, 600)
PROMPTS = {"query": "query: ", "passage": "passage: "}


@dataclass(frozen=True)
class Case:
    """A model (built into a folder, or the embedded one) and how it is run and asked."""

    name: str
    model: dict[str, Any] | None  # build_sentence_encoder's arguments; None: the embedded model; {} a plain folder
    settings: dict[str, Any] = field(default_factory=dict)
    parameters: dict[str, str] = field(default_factory=dict)  # the request's parameters
    encode: dict[str, str] = field(default_factory=dict)  # what encode() is given for the same


BASE = {"positions": 512, "max_seq_length": 512, "similarity": "cosine"}
CASES = (
    Case("mean + Normalize, defaults", {**BASE, "pooling": "mean", "dense": None, "normalize": True}),
    Case("mean + Normalize, sequence.max=256", {**BASE, "pooling": "mean", "dense": None, "normalize": True},
         {"sequence": {"max": 256}}),
    Case("last-token, defaults", {**BASE, "pooling": "lasttoken", "dense": None}),
    Case("CLS+mean -> Dense 64->24, defaults", {**BASE, "pooling": ("cls", "mean"), "dense": 24}),
    Case("include_prompt false, custom prompt", {**BASE, "pooling": "mean", "dense": None, "prompts": PROMPTS,
                                                 "include_prompt": False},
         parameters={"prompt": "Represent this sentence: "}, encode={"prompt": "Represent this sentence: "}),
    Case("include_prompt false, prompt_name=query", {**BASE, "pooling": "mean", "dense": None, "prompts": PROMPTS,
                                                     "include_prompt": False},
         parameters={"prompt_name": "query"}, encode={"prompt_name": "query"}),
    Case("do_lower_case (older folder)", {**BASE, "pooling": "mean", "dense": None, "do_lower_case": True}),
    Case("plain folder, prompt_name=query", {}, parameters={"prompt_name": "query"}, encode={"prompt_name": "query"}),
    Case("all-MiniLM-L6-v2 (embedded), defaults", None),
)


def build(case: Case, folder: Path) -> str:
    if case.model is None:
        return RunConfig().model
    if not case.model:
        return str(build_encoder(folder, positions=512))
    return str(build_sentence_encoder(folder, **case.model))


def texts_for(tokenizer: Any) -> list[str]:
    """Mixed-case corpus texts and texts joined to about LONG tokens."""
    corpus = load_corpus()
    return [text.upper() if i % 3 == 0 else text for i, text in enumerate(corpus[:24])] + list(
        long_texts(tokenizer, corpus, LONG))


def served(repository: Path, name: str, texts: list[str], parameters: dict[str, str], folder: Path) -> np.ndarray:
    with TritonServer(repository, folder / "server") as server, TritonClient(server.http_url, "http") as client:
        return np.concatenate([client.infer_texts(name, texts[i:i + 4], parameters=parameters or None)[
            "sentence_embedding"] for i in range(0, len(texts), 4)])


def rows(got: np.ndarray, want: np.ndarray, lengths: np.ndarray, cut: int, limit: int) -> list[dict[str, Any]]:
    cosine = np.sum(got * want, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    groups = {f"<= {cut} tokens": lengths <= cut, f"{cut + 1}-{limit} tokens": (lengths > cut) & (lengths <= limit),
              f"> {limit} tokens": lengths > limit}
    return [{"texts": int(mask.sum()), "lengths": name, "max_abs": float(np.abs(got - want)[mask].max()),
             "min_cosine": float(cosine[mask].min())} for name, mask in groups.items() if mask.any()]


def run_case(case: Case, root: Path) -> dict[str, Any]:
    from sentence_transformers import SentenceTransformer

    model = build(case, root / "model")
    config = RunConfig.model_validate({"model": model, "precisions": ["fp32"], **case.settings,
                                       "triton": {"repository_dir": str(root / "repos")}})
    record = RunRecord.create(root / "run", config)
    for step in (export, optimize, parity, triton):
        entry = step.run(config, record)
        if entry.status != "ok":
            return {"case": case.name, "failed": f"{step.STEP}: {entry.detail}"}
    library = SentenceTransformer(resolve_source(model).location, device="cpu")
    texts = texts_for(library.tokenizer)
    prompt = library.prompts.get(case.encode.get("prompt_name", ""), "") or case.encode.get("prompt", "")
    lengths = token_lengths(library.tokenizer, [prompt + text for text in texts])
    want = library.encode(texts, **case.encode)
    name = record.metric("triton.name")
    got = served(root / "repos" / name, name, texts, case.parameters, root)
    sequence = record.metric("export.sequence")
    return {"case": case.name, "cut": sequence["max"], "limit": record.metric("export.max_sequence"),
            "rows": rows(got, want, lengths, sequence["max"], record.metric("export.max_sequence")),
            "verdict": [line for line in verdict_line("triton", record).splitlines() if "cut" in line]}


def main() -> int:
    """Run the cases (exit 0); errors and signals end it as `script_exit` says."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for the runs and fidelity.json (default: a temporary one)")
    parser.add_argument("--cases", default=None, help="comma-separated case names to run (default: all)")
    add_page_argument(parser)
    args = parser.parse_args()
    return script_exit(lambda: printed_to(args.page, "Served answers against the library: benchmarks/fidelity.py",
                                          lambda: measure(args.out, args.cases)), "fidelity.json not written")


def measure(out_dir: str | None, names: str | None) -> None:
    chosen = [c for c in CASES if not names or c.name in names.split(",")]
    with tempfile.TemporaryDirectory(prefix="fidelity-") as scratch:
        out = Path(out_dir or scratch)
        results = [run_case(case, out / f"case{index}") for index, case in enumerate(chosen)]
        print("| case | texts by length | max abs | min cosine |\n|---|---|---|---|")
        for result in results:
            if "failed" in result:
                print(f"| {result['case']} | failed: {result['failed'][:200]} | | |")
                continue
            for row in result["rows"]:
                print(f"| {result['case']} | {row['texts']} texts, {row['lengths']} | {row['max_abs']:.2g} | "
                      f"{row['min_cosine']:.6f} |")
        for result in results:
            for line in result.get("verdict", []):
                print(f"{result['case']}: {line}")
        if out_dir:
            (out / "fidelity.json").write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())

"""The workbench's ONNX graphs beside Optimum's of the same model, in one process, measured side by side.

    .venv/bin/python benchmarks/graphs.py --install    # once: Optimum's environment (.peers/infinity, shared with
                                                       # benchmarks/peers.py: infinity-emb brings optimum-onnx)
    .venv/bin/python benchmarks/graphs.py [--run outputs/<run>] [--rounds 40] [--threads N]

Without --run it first runs export, optimize and parity (fp32 and int8) on the embedded all-MiniLM-L6-v2. Optimum's
graphs are built from the same model folder in their own environment (benchmarks/peer_optimum.py): the plain export,
`--optimize O2` and `O3`, and O2 after the dynamic int8 preset for this CPU, per channel and per tensor. Then, with
every graph in this process's ONNX Runtime and the same session settings (N threads that sleep when idle, every
graph optimization): median ms of one call at b1 s16, b1 s128 and b8 s128 filled with real text, all graphs
interleaved; PyTorch eager in phases of its own before and after them (the lower kept) as the speedup's reference;
every graph's sentence embedding on the corpus against `SentenceTransformer.encode()` (Optimum's `last_hidden_state`
mean-pooled and normalized as its users do, outside the timed call). Prints the table and issue #26's checks
(PASS/MISS, never an assertion), writes <run>/graphs/graphs.json, exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from workbench.core.batches import cell_feeds
from workbench.core.config import RunConfig
from workbench.core.data import load_corpus
from workbench.core.errors import MissingArtifactError
from workbench.core.interrupt import script_exit
from workbench.core.machine import cpu_features, others_busy
from workbench.core.record import RunRecord
from workbench.core.timing import median_ms
from workbench.measure.graphs import GraphRow, accuracy, embeddings, sessions, table, time_graphs, verdicts
from workbench.measure.peers import (
    OPTIMUM_FILES,
    PeerNotInstalledError,
    build_optimum,
    install_infinity,
    require_positive,
)
from workbench.models.loading import resolve_source
from workbench.pipeline import run_pipeline

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VENV = ROOT / ".peers" / "infinity"
CELLS = ((1, 16), (1, 128), (8, 128))
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
OURS = {"original": "workbench original (unfused export)", "fp32": "workbench fp32", "int8": "workbench int8",
        "int8_repaired": "workbench int8_repaired"}
THEIRS = {"plain": ("Optimum plain export", "fp32"), "fp32": ("Optimum O2", "fp32"), "O3": ("Optimum O3", "fp32"),
          "int8": ("Optimum O2 int8, per channel", "int8"), "int8_per_tensor": ("Optimum O2 int8, per tensor", "int8")}
PAIRS = [("workbench original (unfused export)", "Optimum plain export"), ("workbench fp32", "Optimum O2"),
         ("workbench fp32", "Optimum O3"), ("workbench int8", "Optimum O2 int8, per channel"),
         ("workbench int8", "Optimum O2 int8, per tensor")]


def main() -> int:
    """Run the comparison (exit 0); errors and signals end it as `script_exit` says, graphs.json not written."""
    return script_exit(lambda: compare(arguments()), "graphs.json not written")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="a run whose optimize and parity steps are done")
    parser.add_argument("--peer-venv", type=Path, default=DEFAULT_VENV, help="Optimum's own environment")
    parser.add_argument("--install", action="store_true", help="create --peer-venv, then exit")
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds per cell")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="intra-op threads of every graph")
    args = parser.parse_args()
    require_positive([("--rounds", args.rounds), ("--threads", args.threads)])
    return args


def compare(args: argparse.Namespace) -> None:
    if args.install:
        print(f"installed: {install_infinity(args.peer_venv)}")
        return
    if args.run is not None and not (args.run / "run.json").is_file():
        raise MissingArtifactError(f"{args.run} is not a run folder (no run.json)",
                                   "leave out --run (export, optimize and parity run first, about 6 minutes on a "
                                   "quiet 2-core host), or give a run whose optimize and parity steps are done")
    python = args.peer_venv / "bin" / "python"
    if not (args.peer_venv / "bin" / "optimum-cli").is_file():
        raise PeerNotInstalledError(f"Optimum is not installed in {args.peer_venv}",
                                    f"{sys.executable} {Path(__file__).resolve()} --install --peer-venv "
                                    f"{args.peer_venv.resolve()} "
                                    "(a virtual environment of about 1.5 GB, about a minute)")
    if args.run is None:
        args.run = ROOT / "outputs" / f"graphs-{time.strftime('%Y%m%d-%H%M%S')}"
        run_pipeline(RunConfig(steps=["export", "optimize", "parity"], precisions=["fp32", "int8"]), args.run)
    record = RunRecord.load(args.run)
    missing = [variant for variant in OURS if f"onnx.{variant}" not in record.data["artifacts"]]
    if missing:
        raise MissingArtifactError(f"{args.run} has no {', '.join(missing)} graph",
                                   f"run `workbench run --output-dir {args.run} --resume --steps optimize,parity` "
                                   "with int8 among the precisions (int8_repaired exists once int8 failed parity "
                                   "and was repaired)")
    features = cpu_features()
    preset = "avx512_vnni" if "avx512_vnni" in features["flags"] else "avx2"
    model_dir = resolve_source(record.config.model).location
    work = args.run / "graphs"
    build_optimum(python, ROOT / "benchmarks" / "peer_optimum.py", model_dir, work / "optimum", preset, list(THEIRS))
    rows = [GraphRow(label, "workbench", "int8" if variant.startswith("int8") else "fp32",
                     record.artifact(f"onnx.{variant}"), "sentence_embedding") for variant, label in OURS.items()]
    rows += [GraphRow(label, "optimum", precision, work / "optimum" / folder / OPTIMUM_FILES[folder],
                      "last_hidden_state") for folder, (label, precision) in THEIRS.items()]
    tokenizer = record.tokenizer()
    texts = list(load_corpus(record.config.corpus))
    feeds = cell_feeds(tokenizer, INPUTS, texts, CELLS)
    busy = others_busy()
    before = pytorch_ms(model_dir, feeds, args.threads, args.rounds)
    opened = sessions(rows, args.threads)
    print(f"timing {len(rows)} graphs, {args.rounds} interleaved rounds per cell", flush=True)
    time_graphs(rows, opened, feeds, args.rounds)
    after = pytorch_ms(model_dir, feeds, args.threads, args.rounds)  # a spell of load hits one phase, rarely both
    torch_ms = {cell: min(before[cell], after[cell]) for cell in feeds}
    from sentence_transformers import SentenceTransformer

    library = SentenceTransformer(model_dir, device="cpu")
    reference = library.encode(texts, batch_size=32)
    for row in rows:
        row.accuracy = accuracy(embeddings(row, opened[row.name], tokenizer, texts, library.max_seq_length),
                                reference)
    lines = verdicts(rows, PAIRS, OURS["int8_repaired"])
    result = {"host": {**features, "date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "busy_before": busy},
              "run": str(args.run), "threads": args.threads, "rounds": args.rounds, "pytorch_ms": torch_ms,
              "rows": [row.record() for row in rows], "checks": lines}
    (work / "graphs.json").write_text(json.dumps(result, indent=2))
    report(result, rows, torch_ms, lines)


def pytorch_ms(model_dir: str, feeds: dict[str, dict[str, np.ndarray]], threads: int, rounds: int) -> dict[str, float]:
    """PyTorch eager: the SentenceTransformer's forward on each cell's tokens, median ms, in a phase of its own (its
    threads do not wait beside the ONNX Runtime sessions); run before and after the graphs, the lower kept."""
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    model = SentenceTransformer(model_dir, device="cpu").eval()
    found = {}
    for cell, feed in feeds.items():
        features = {name: torch.from_numpy(array) for name, array in feed.items()}

        def call(features: dict[str, torch.Tensor] = features) -> object:
            with torch.inference_mode():
                return model(dict(features))
        found[cell] = round(median_ms(call, max(10, rounds // 2), warmup=2), 4)
    return found


def report(result: dict, rows: list[GraphRow], torch_ms: dict[str, float], lines: list[str]) -> None:
    host = result["host"]
    print(f"\n{host['date']}; CPU flags: {' '.join(host['flags'])}; int8 dot product: "
          f"{host['int8_dot_product'] or 'none'}; one process, {result['threads']} threads, {result['rounds']} "
          "interleaved rounds per cell, medians in ms (speedup over PyTorch eager)\n")
    if host["busy_before"] > (host["cores"] or 1) / 2:
        print(f"BUSY HOST: other processes kept {host['busy_before']:.1f} of {host['cores']} cores busy when measuring "
              "began: the graphs' ratios to each other hold (interleaved), the speedups over PyTorch (timed in "
              "phases of its own) may not; re-run on a quiet host\n")
    print(table(rows, torch_ms))
    print()
    for line in lines:
        print(line)
    print(f"\nwritten: {result['run']}/graphs/graphs.json")


if __name__ == "__main__":
    sys.exit(main())

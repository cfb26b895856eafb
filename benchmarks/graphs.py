"""The workbench's ONNX graphs beside Optimum's and OpenVINO's of the same model, in one process, measured side by side.

    .venv/bin/python benchmarks/graphs.py --install    # once: Optimum's environment (.peers/infinity, shared with
                                                       # benchmarks/peers.py) and OpenVINO's (.peers/openvino)
    .venv/bin/python benchmarks/graphs.py [--model FOLDER | --run outputs/<run>] [--rounds 40] [--threads N]

Without --run it first runs export, optimize and parity (fp32, int8 and the OpenVINO variant) on --model (a
sentence-transformers or transformers encoder folder; default: the embedded all-MiniLM-L6-v2; benchmarks/families.py
builds random-weight ones of other families). The peers' graphs are built from the same model folder in their own
environments:
Optimum's (benchmarks/peer_optimum.py) the plain export, `--optimize O2` and `O3`, and O2 after the dynamic int8
preset for this CPU, per channel and per tensor; OpenVINO's (benchmarks/peer_openvino.py) the fp32 IR
sentence-transformers exports, compiled at f32 and, where it differs, at the CPU plugin's default inference precision
on this host, and that IR after NNCF int8 calibrated on the corpus texts. A peer that cannot build a graph for the
family leaves a row saying why. Then one process (benchmarks/peer_timing.py, run by OpenVINO's environment, which
holds the workbench's onnxruntime too) times every graph with N threads (ONNX Runtime's sleep when idle and apply
every graph optimization): median ms of one call at b1 s16, b1 s128 and b8 s128 filled with real text. The graphs
of one precision class (the table's fp32, bf16 or int8: a row's precision as named) are open and interleaved
together, one class after another, and in each class one graph (an OpenVINO one where there is one) is opened
twice and both copies timed: that A/A control's ratio is the run's noise. PyTorch eager runs in phases of its own
before and after them (the lower kept) as the speedup's reference.
Every graph's sentence embedding of the corpus is checked against `SentenceTransformer(folder).encode()` (a peer's
per-token output pooled by the library's own modules, outside the timed call). Prints the table and the checks:
each of ours against its Optimum counterpart, ours against the fastest peer at each precision (target: at most
1.03x its time at every cell) and the fastest int8 with min cosine >= 0.99. Each says PASS or MISS, never an
assertion; a MISS whose ratios all stay within 1.03 times the A/A spread says "within this run's A/A spread (not
resolved)". Writes <run>/graphs/graphs.json; exits 0 (2: a bad argument or a missing peer, with the fix; 130:
interrupted).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from peerlib.graph_checks import Control, accuracy, control_lines, table, targets, verdicts
from peerlib.graphs import GraphRow
from peerlib.pages import add_page_argument, printed_to
from peerlib.peers import (
    PeerNotInstalledError,
    build_openvino,
    build_optimum,
    find_openvino,
    install_infinity,
    install_openvino,
    openvino_hint,
    require_positive,
)

from workbench.core.config import RunConfig
from workbench.core.errors import ConfigError, MissingArtifactError, RunInterruptedError
from workbench.core.machine import cpu_features, cpu_flags
from workbench.core.record import RunRecord
from workbench.core.results import CpuFeatures
from workbench.graphs import onnxfiles
from workbench.graphs.tables import OptimizeMetrics
from workbench.interrupt import script_exit
from workbench.models.batches import cell_feeds
from workbench.models.errors import ModelNotFoundError
from workbench.models.loading import resolve_source
from workbench.models.text import encode
from workbench.pipeline import run_pipeline
from workbench.runners.timing import median_ms, others_busy

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VENV = ROOT / ".peers" / "infinity"
DEFAULT_OPENVINO = ROOT / ".peers" / "openvino"
CELLS = ((1, 16), (1, 128), (8, 128))
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
HALF_FLAGS = ("avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")  # what OpenVINO's default precision follows
BATCH = 32
OURS = {"original": "workbench original (unfused export)", "fp32": "workbench fp32",
        "openvino": "workbench openvino (fp32 on OpenVINO, f32)",
        "openvino_bf16": "workbench openvino_bf16 (on OpenVINO, bf16)", "int8": "workbench int8",
        "int8_repaired": "workbench int8_repaired", "openvino_int8": "workbench openvino_int8 (NNCF, on OpenVINO)",
        "openvino_int8_repaired": "workbench openvino_int8_repaired (NNCF, on OpenVINO)"}
REQUIRED = ("original", "fp32", "int8")  # int8_repaired exists only where int8 failed parity
THEIRS = {"plain": ("Optimum plain export", "fp32"), "fp32": ("Optimum O2", "fp32"), "O3": ("Optimum O3", "fp32"),
          "int8": ("Optimum O2 int8, per channel", "int8"), "int8_per_tensor": ("Optimum O2 int8, per tensor", "int8")}
PAIRS = [("workbench original (unfused export)", "Optimum plain export"), ("workbench fp32", "Optimum O2"),
         ("workbench fp32", "Optimum O3"), ("workbench int8", "Optimum O2 int8, per channel"),
         ("workbench int8", "Optimum O2 int8, per tensor")]
PRECISIONS = {"f32": "fp32", "bf16": "bf16", "f16": "fp16"}  # OpenVINO's inference precision -> precision class


def main() -> int:
    """Run the comparison (exit 0); errors and signals end it as `script_exit` says, graphs.json not written."""
    def body() -> None:
        args = arguments()
        printed_to(args.page, "Graphs beside Optimum's and OpenVINO's: benchmarks/graphs.py", lambda: compare(args))

    return script_exit(body, "graphs.json not written")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model folder to run the pipeline on (default: the embedded model)")
    parser.add_argument("--run", type=Path, help="a run whose optimize and parity steps are done")
    parser.add_argument("--peer-venv", type=Path, default=DEFAULT_VENV, help="Optimum's own environment")
    parser.add_argument("--openvino-venv", type=Path, default=DEFAULT_OPENVINO, help="OpenVINO's own environment")
    parser.add_argument("--install", action="store_true", help="create --peer-venv and --openvino-venv, then exit")
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds per cell (default: 40)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="intra-op threads of every graph (default: all cores)")
    add_page_argument(parser)
    args = parser.parse_args()
    require_positive([("--rounds", args.rounds), ("--threads", args.threads)])
    return args


def model_folder(model: str) -> str:
    """--model as a local model folder: anything else is a ModelNotFoundError naming what to pass."""
    source = resolve_source(model)  # a folder without config.json is refused here, with what to pass instead
    if source.kind != "local":
        raise ModelNotFoundError(f"--model {model} is not a folder here",
                                 "pass the folder of a sentence-transformers or transformers encoder "
                                 "(save_pretrained()), e.g. one benchmarks/families.py builds; leave --model out "
                                 "for the embedded all-MiniLM-L6-v2")
    return source.location


def refuse_early(args: argparse.Namespace) -> None:
    """Every refusal that needs nothing built: a bad --run or --model, both at once, a missing peer."""
    if args.run is not None and args.model is not None:
        raise ConfigError("--model and --run both name the model",
                          "give --run alone (its model is the run's) or --model alone (a new run is made)")
    if args.run is not None and not (args.run / "run.json").is_file():
        raise MissingArtifactError(f"{args.run} is not a run folder (no run.json)",
                                   "leave out --run (export, optimize and parity run first, about 6 minutes on a "
                                   "quiet 2-core host for the embedded model), or give a run whose optimize and "
                                   "parity steps are done")
    if args.model is not None:
        model_folder(args.model)
    if (args.peer_venv / "bin" / "optimum-cli").is_file():
        find_openvino(args.openvino_venv)
        return
    try:
        find_openvino(args.openvino_venv)
    except PeerNotInstalledError:
        raise PeerNotInstalledError(f"neither Optimum ({args.peer_venv}) nor OpenVINO ({args.openvino_venv}) is "
                                    "installed", openvino_hint(args.openvino_venv, args.peer_venv)) from None
    raise PeerNotInstalledError(f"Optimum is not installed in {args.peer_venv}",
                                f"{sys.executable} {Path(__file__).resolve()} --install --peer-venv "
                                f"{args.peer_venv.resolve()} (a virtual environment of about 1.5 GB, about a minute)")


def compare(args: argparse.Namespace) -> None:
    if args.install:
        print(f"installed: {install_infinity(args.peer_venv)}")
        print(f"installed: {install_openvino(args.openvino_venv)}")
        return
    refuse_early(args)
    if args.run is None:
        model = model_folder(args.model) if args.model else RunConfig().model
        name = Path(model).name if args.model else "minilm"
        args.run = ROOT / "outputs" / f"graphs-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        try:
            run_pipeline(RunConfig(model=model, steps=["export", "optimize", "parity"],
                                   precisions=["fp32", "bf16", "int8"], optimize={"openvino": "always"}), args.run)
        except RunInterruptedError as stop:
            raise KeyboardInterrupt(f"{signal.Signals(stop.signum).name}; the graphs are not all built: finish "
                                    f"them with `workbench run --resume --output-dir {args.run} --steps "
                                    f"optimize,parity`, then time them with --run {args.run}") from None
    record = ready_run(args.run)
    features = cpu_features()
    half = [flag for flag in HALF_FLAGS if flag in cpu_flags() and flag not in features.flags]
    model_dir = resolve_source(record.config.model).location
    work = args.run / "graphs"
    tokenizer = record.tokenizer()
    texts = list(record.config.texts())
    from sentence_transformers import SentenceTransformer

    library = SentenceTransformer(model_dir, device="cpu")
    names = tuple(name for name in TOKEN_INPUTS if name in tokenizer("a"))
    rows = our_rows(record) + optimum_rows(args, model_dir, work, features)
    rows += openvino_rows(args, model_dir, work, [encode(tokenizer, [text], names, library.max_seq_length)
                                                  for text in texts])
    feeds = cell_feeds(tokenizer, names, texts, CELLS)
    batches = [encode(tokenizer, texts[start:start + BATCH], names, max_length=library.max_seq_length)
               for start in range(0, len(texts), BATCH)]
    busy = others_busy()
    before = pytorch_ms(library, feeds, args.threads, args.rounds)
    found, controls = time_in_one_process(args, model_dir, rows, feeds, batches, work / "timing")
    after = pytorch_ms(library, feeds, args.threads, args.rounds)  # a spell of load hits one phase, rarely both
    torch_ms = {cell: min(before[cell], after[cell]) for cell in feeds}
    reference = library.encode(texts, batch_size=BATCH)
    for index, row in enumerate(rows):
        if row.ms:
            row.accuracy = accuracy(found[str(index)], reference)
    spreads = {precision: control["spread"] for precision, control in controls.items()}
    lines = (absent_lines(record) + control_lines(controls) + verdicts(rows, PAIRS, OURS["int8_repaired"], spreads)
             + targets(rows, spreads))
    result = {"host": {**features.recorded(), "half_precision_flags": half, "date": time.strftime("%Y-%m-%d"),
                       "cores": os.cpu_count(), "busy_before": busy},
              "model": model_dir, "run": str(args.run), "threads": args.threads, "rounds": args.rounds,
              "pytorch_ms": torch_ms, "rows": [row.record() for row in rows], "controls": controls, "checks": lines}
    (work / "graphs.json").write_text(json.dumps(result, indent=2))
    report(result, rows, torch_ms, lines)


def ready_run(run: Path) -> RunRecord:
    """The run at `run` once its optimize and parity steps are done and its graphs are there: a run cut short
    would be timed without the graphs parity repairs, or with graphs it never checked."""
    record = RunRecord.load(run)
    unfinished = {step: record.status(step) or "not run" for step in ("optimize", "parity")
                  if record.status(step) != "ok"}
    missing = [variant for variant in REQUIRED if f"onnx.{variant}" not in record.data["artifacts"]]
    if unfinished or missing:
        said = [f"{step} {status}" for step, status in unfinished.items()] + [f"no {v} graph" for v in missing]
        raise MissingArtifactError(f"{run} is not ready to time: {', '.join(said)}",
                                   f"run `workbench run --output-dir {run} --resume --steps optimize,parity` "
                                   "(int8 among its precisions), then --run again")
    return record


def our_rows(record: RunRecord) -> list[GraphRow]:
    """The run's graphs; its OpenVINO variants compiled by OpenVINO at the inference precision their file names
    (f32, or bf16 for an int8 file's float ops where the optimize step chose it), as the workbench runs them."""
    rows = []
    for variant, label in OURS.items():
        if f"onnx.{variant}" not in record.data["artifacts"]:
            continue
        path = record.artifact(f"onnx.{variant}")
        hint = onnxfiles.openvino_precision(path) if variant.startswith("openvino") else None
        rows.append(GraphRow(label.replace(" on OpenVINO)", f" on OpenVINO, rest {hint})") if "int8" in variant and
                             hint else label, "workbench", record.variant(variant).precision, path,
                             "sentence_embedding", **({"runtime": "openvino", "hint": hint} if hint else {})))
    return rows


def absent_lines(record: RunRecord) -> list[str]:
    """Each OpenVINO variant the run did not keep, with the optimize step's reason and how to time it anyway."""
    optimize = record.results_as("optimize", OptimizeMetrics)
    if optimize is None:
        return []
    again = (f"to time it: workbench run --resume --output-dir {record.run_dir} --steps optimize,parity "
             "-p optimize.openvino=always")
    tried = {"openvino": optimize.openvino, "openvino_bf16": optimize.openvino_bf16,
             "openvino_int8": optimize.openvino_int8}
    return [f"not in this run: {OURS[name]}: {trial.reason}" + ("" if trial.reason.startswith("not tried") else
                                                                 f"; {again}")
            for name, trial in tried.items()
            if trial is not None and not trial.kept and f"onnx.{name}" not in record.data["artifacts"]]


def optimum_rows(args: argparse.Namespace, model_dir: str, work: Path, features: CpuFeatures) -> list[GraphRow]:
    preset = "avx512_vnni" if "avx512_vnni" in features.flags else "avx2"
    status = build_optimum(args.peer_venv / "bin" / "python", ROOT / "benchmarks" / "peer_optimum.py", model_dir,
                           work / "optimum", preset, list(THEIRS))
    rows = []
    for folder, (label, precision) in THEIRS.items():
        built = status[folder]
        path = Path(built.get("path", "-"))
        rows.append(GraphRow(label, "optimum", precision, path, token_output(path) if "path" in built else "-",
                             problem=built.get("problem")))
    return rows


def token_output(path: Path) -> str:
    """The per-token output of an Optimum graph: `last_hidden_state` (transformers export) or `token_embeddings`
    (a sentence-transformers export)."""
    import onnx

    names = [output.name for output in onnx.load(str(path), load_external_data=False).graph.output]
    return "last_hidden_state" if "last_hidden_state" in names else "token_embeddings"


def openvino_rows(args: argparse.Namespace, model_dir: str, work: Path,
                  calibration: list[dict[str, np.ndarray]]) -> list[GraphRow]:
    """OpenVINO's fp32 IR at f32 and at the CPU plugin's default inference precision here (one row where they are
    the same), and the NNCF int8 IR at the default; a variant it could not build is a row that says why."""
    python = find_openvino(args.openvino_venv)
    source = work / "openvino" / "calibration.npz"
    source.parent.mkdir(parents=True, exist_ok=True)
    np.savez(source, **{f"text/{i}/{name}": array for i, feed in enumerate(calibration)
                        for name, array in feed.items()})
    status = build_openvino(python, ROOT / "benchmarks" / "peer_openvino.py", model_dir, work / "openvino", source)
    default = default_precision(python)
    wanted = [("OpenVINO fp32 IR, f32", "fp32", "fp32", "f32")]
    if default != "f32":
        wanted.append((f"OpenVINO fp32 IR, default {default}", "fp32", PRECISIONS.get(default, default), None))
    wanted.append((f"OpenVINO NNCF int8 (rest {default})", "int8", "int8", None))
    rows = []
    for label, variant, precision, hint in wanted:
        built = status.get(variant, {"problem": "not built"})
        rows.append(GraphRow(label, "openvino", precision, Path(built.get("path", "-")),
                             built.get("output", "last_hidden_state"), "openvino", hint, problem=built.get("problem")))
    return rows


def default_precision(python: Path) -> str:
    """OpenVINO's CPU plugin's default inference precision on this host (f32, bf16 or f16), asked of its own
    environment."""
    asked = subprocess.run([str(python), "-c", "import openvino; print(openvino.Core().get_property('CPU', "
                            "'INFERENCE_PRECISION_HINT').get_type_name())"], capture_output=True, text=True)
    if asked.returncode != 0:
        raise PeerNotInstalledError(f"OpenVINO in {python.parents[1]} cannot answer: {asked.stderr.strip()[-300:]}",
                                    f"rebuild it: {sys.executable} {Path(__file__).resolve()} --install")
    return asked.stdout.strip()


def time_in_one_process(args: argparse.Namespace, model_dir: str, rows: list[GraphRow],
                        feeds: dict[str, dict[str, np.ndarray]], batches: list[dict[str, np.ndarray]],
                        work: Path) -> tuple[dict[str, np.ndarray], dict[str, Control]]:
    """Every row timed interleaved in one process of the OpenVINO environment (benchmarks/peer_timing.py); the rows
    take its medians, what OpenVINO computed in and any problem. Each row's sentence embeddings of the texts of
    `batches`, by row index, and each precision class's A/A control."""
    work.mkdir(parents=True, exist_ok=True)
    arrays = {f"cell/{cell}/{name}": array for cell, feed in feeds.items() for name, array in feed.items()}
    arrays.update({f"batch/{k}/{name}": array for k, feed in enumerate(batches) for name, array in feed.items()})
    np.savez(work / "feeds.npz", **arrays)
    plan = {"model": model_dir, "threads": args.threads, "rounds": args.rounds, "cells": list(feeds),
            "rows": [row.record() for row in rows]}
    (work / "plan.json").write_text(json.dumps(plan, indent=2))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # its own session: Ctrl-C reaches this process alone, which stops the child (subprocess.run kills it) and says
    # so in one line
    done = subprocess.run([str(find_openvino(args.openvino_venv)), str(ROOT / "benchmarks" / "peer_timing.py"),
                           str(work)], env=env, start_new_session=True)
    if done.returncode != 0:
        raise PeerNotInstalledError(f"the timing process in {args.openvino_venv} failed (exit {done.returncode})",
                                    f"read its output above; rebuild the environment with {sys.executable} "
                                    f"{Path(__file__).resolve()} --install")
    timed = json.loads((work / "timed.json").read_text())
    for row, data in zip(rows, timed["rows"]):
        row.ms, row.computed_in, row.problem = data["ms"], data["computed_in"], data["problem"]
    with np.load(work / "embeddings.npz") as found:
        return {key: found[key] for key in found.files}, timed["controls"]


def pytorch_ms(library: SentenceTransformer, feeds: dict[str, dict[str, np.ndarray]], threads: int,
               rounds: int) -> dict[str, float]:
    """PyTorch eager: the SentenceTransformer's forward on each cell's tokens, median ms, in a phase of its own (its
    threads do not wait beside the graphs); run before and after the graphs, the lower kept."""
    import torch

    torch.set_num_threads(threads)
    library.eval()
    found = {}
    for cell, feed in feeds.items():
        features = {name: torch.from_numpy(array) for name, array in feed.items()}

        def call(features: dict[str, torch.Tensor] = features) -> object:
            with torch.inference_mode():
                return library(dict(features))
        found[cell] = round(median_ms(call, max(10, rounds // 2), warmup=2), 4)
    return found


def report(result: dict[str, Any], rows: list[GraphRow], torch_ms: dict[str, float], lines: list[str]) -> None:
    host = result["host"]
    print(f"\n{host['date']}; {result['model']}; CPU flags: {' '.join(host['flags'] + host['half_precision_flags'])}; "
          f"int8 dot product: {host['int8_dot_product'] or 'none'}; one process, {result['threads']} threads, "
          f"{result['rounds']} interleaved rounds per cell, medians in ms (speedup over PyTorch eager)\n")
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

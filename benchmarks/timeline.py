"""Where a run's time goes, step by step, on the embedded model and on a base-size model built here.

    .venv/bin/python benchmarks/timeline.py [--models minilm,base,large] [--out DIR] [-p KEY=VALUE ...]
        [--memory-limit GIB] [--long-texts N]

Runs `workbench run` as users do (papermill, one kernel per step) on each model: the embedded all-MiniLM-L6-v2 with
the demo's steps, and a base-size sentence-transformers model built here (BERT, 12 layers, hidden 768, intermediate
3072, random weights, all-MiniLM-L6-v2's real WordPiece tokenizer, mean pooling and Normalize, max_seq_length 384)
through export, optimize, parity and triton; `large` is bge-m3's shape (XLM-R large, 568M parameters, random
weights, 8192-token contexts, CLS pooling and Normalize) through the same steps, whose deployment then answers one
request of `--long-texts` texts of 8,000 tokens on a real server (deployed allowing so many tokens in one request:
triton.max_request_tokens). `--memory-limit` runs it all inside a memory
cgroup of that size (root; the large model's target: 12). A sampler watches the run's process tree (the CLI, its
kernels, the Triton server and its stubs) every half second. Printed per model and step: wall seconds, CPU
seconds, peak memory of the tree (PSS), and what the step spent them on (from run.json: the reference, each
variant's check, the repair and its candidates, server start), then the run's wall time, with the host's CPU flags.
`-p` settings go to every run; the reference cache is a fresh folder of the run's own (`--warm-cache` keeps the
user's). Writes DIR/timeline.json; exits 0 (the targets of issues 38 and 63 are printed as PASS/MISS, never
asserted).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from peerlib.pages import add_page_argument, printed_to

from workbench.core.machine import cpu_features, cpu_model
from workbench.interrupt import script_exit
from workbench.runners.timing import others_busy

ROOT = Path(__file__).resolve().parents[1]
BASE_STEPS = "export,optimize,parity,triton"
LONG_TOKENS = 8000  # each text of --long-texts
TARGETS = {"minilm": 10 * 60, "base": 20 * 60, "large": 60 * 60}  # seconds of wall time (issues 38, 63)
BASE_RSS_MB = 4096
SAMPLE_S = 0.5
CGROUP_NAME = "workbench-timeline"


@dataclass
class Sample:
    at: float
    cpu_s: float
    rss_mb: float


@dataclass
class TreeSampler:
    """CPU seconds (the tree's processes, each counted to its last sample) and memory of a process and all its
    descendants, every SAMPLE_S, on a thread of its own. Memory is the tree's PSS (each process's pages, a page the
    processes share counted once in all: the CLI and its kernels share torch's libraries), else its RSS."""

    root: int
    samples: list[Sample] = field(default_factory=list)
    last_cpu: dict[int, float] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            try:
                parent = psutil.Process(self.root)
                tree = [parent, *parent.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            rss = 0.0
            for process in tree:
                try:
                    times = process.cpu_times()
                    self.last_cpu[process.pid] = times.user + times.system
                    rss += _memory(process) / 2**20
                except psutil.NoSuchProcess:
                    continue
            self.samples.append(Sample(time.time(), sum(self.last_cpu.values()), rss))

    def window(self, start: float, end: float) -> tuple[float, float]:
        """CPU seconds spent and peak memory (MB) between two times."""
        inside = [s for s in self.samples if start <= s.at <= end + SAMPLE_S]
        before = [s for s in self.samples if s.at < start]
        if not inside:
            return 0.0, 0.0
        return inside[-1].cpu_s - (before[-1].cpu_s if before else 0.0), max(s.rss_mb for s in inside)


def _memory(process: psutil.Process) -> int:
    try:
        return int(process.memory_full_info().pss)
    except (psutil.AccessDenied, AttributeError):
        return int(process.memory_info().rss)


def build_base(folder: Path) -> Path:
    """A base-size sentence-transformers model (random weights) with the embedded model's real tokenizer."""
    if (folder / "modules.json").is_file():
        return folder
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    from workbench.core.config import RunConfig
    from workbench.models.loading import resolve_source

    torch.manual_seed(0)
    minilm = resolve_source(RunConfig().model).location
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm)
    config = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=768, num_hidden_layers=12,
                                     num_attention_heads=12, intermediate_size=3072, max_position_embeddings=512)
    with tempfile.TemporaryDirectory() as tmp:
        transformers.BertModel(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        transformer = Transformer(tmp, max_seq_length=384)
        modules = [transformer, Pooling(transformer.get_embedding_dimension(), "mean"), Normalize()]
        SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


def build_large(folder: Path) -> Path:
    """bge-m3's shape as a sentence-transformers model: XLM-R large (24 layers, hidden 1024, 16 heads, feed-forward
    4096, 250,002 token ids, 8,194 positions: 568M parameters, 2.27 GB in fp32) with random weights, a byte-level BPE
    tokenizer trained here on the corpus (the ids it gives are all the model sees), CLS pooling and Normalize,
    max_seq_length 8192."""
    if (folder / "modules.json").is_file():
        return folder
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    from workbench.models.tiny import bytelevel_tokenizer

    torch.manual_seed(0)
    tokenizer = bytelevel_tokenizer()
    tokenizer.model_max_length = 8192
    config = transformers.XLMRobertaConfig(vocab_size=250002, hidden_size=1024, num_hidden_layers=24,
                                           num_attention_heads=16, intermediate_size=4096,
                                           max_position_embeddings=8194, type_vocab_size=1,
                                           pad_token_id=tokenizer.pad_token_id)
    with tempfile.TemporaryDirectory() as tmp:
        transformers.XLMRobertaModel(config, add_pooling_layer=False).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        transformer = Transformer(tmp, max_seq_length=8192)
        modules = [transformer, Pooling(transformer.get_embedding_dimension(), "cls"), Normalize()]
        SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


def built(builder: Callable[[Path], Path], folder: Path) -> Path:
    """`builder(folder)` in a process of its own: the benchmark's process, inside the memory limit it measures
    under, keeps none of the weights built (the large model's 2.3 GB)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(builder, folder).result()


@contextmanager
def memory_cgroup(limit_gb: float | None) -> Iterator[str]:
    """This process, and all it starts, inside a memory cgroup of its own limited to `limit_gb` (cgroup v1's memory
    controller, or v2; needs root), left and removed at the end. Yields what holds, in words."""
    if limit_gb is None:
        yield "no memory limit of the benchmark's own"
        return
    roots = [Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")]
    root = next((r for r in roots if (r / "cgroup.procs").is_file() and (
        (r / "memory.limit_in_bytes").exists() or (r / "cgroup.controllers").is_file())), None)
    if root is None:
        yield f"NOT limited to {limit_gb:g} GB: no memory cgroup here"
        return
    group = root / CGROUP_NAME
    limit_file = group / ("memory.limit_in_bytes" if root.name == "memory" else "memory.max")
    try:
        group.mkdir(exist_ok=True)
        limit_file.write_text(str(int(limit_gb * 2**30)))
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as exc:
        yield f"NOT limited to {limit_gb:g} GB: {group}: {exc.strerror} (run as root)"
        return
    try:
        yield f"inside the memory cgroup {group} (limit {limit_gb:g} GiB)"
    finally:
        (root / "cgroup.procs").write_text(str(os.getpid()))
        with suppress(OSError):  # a process it started that still lives keeps it
            group.rmdir()


def served_long_texts(run_dir: Path, count: int, tokens: int) -> dict[str, Any]:
    """The run's deployment on a real server answering one request of `count` texts of at least `tokens` tokens
    each: seconds, the server's peak memory (its tree, PSS), the answer's shape and the served token budget."""
    from workbench.core.data import load_corpus
    from workbench.core.record import RunRecord
    from workbench.models.batches import long_texts, token_lengths
    from workbench.serve import run_repository
    from workbench.serving.client import TritonClient
    from workbench.serving.plan import deployed_plan
    from workbench.serving.server import TritonServer
    from workbench.serving.tables import TritonMetrics

    record = RunRecord.load(run_dir)
    deployed = deployed_plan(record.current(TritonMetrics), record)
    if deployed is None:
        return {"error": "the run deployed nothing"}
    plan, variant = deployed
    tokenizer = record.tokenizer()
    texts = list(long_texts(tokenizer, load_corpus(), [tokens] * count))
    with (tempfile.TemporaryDirectory() as work, TritonServer(run_repository(run_dir), Path(work)) as server,
          TritonClient(server.grpc_url) as client):
        sampler = TreeSampler(server.pid or 0)
        sampler.start()
        started = time.time()
        answer = client.infer_texts(plan.name, texts)
        seconds = time.time() - started
        alone = client.infer_texts(plan.name, texts[:1])
        sampler.stop.set()
    output = plan.outputs[0].name
    return {"variant": variant, "texts": count, "tokens": [int(n) for n in token_lengths(tokenizer, texts)],
            "max_tokens": plan.max_tokens, "seconds": seconds, "output": output,
            "shape": list(answer[output].shape), "finite": bool(np.isfinite(answer[output]).all()),
            "first_alone_max_abs": float(np.abs(answer[output][0] - alone[output][0]).max()),
            "server_peak_mb": max((s.rss_mb for s in sampler.samples), default=0.0)}


def spent_on(step: str, metrics: dict[str, Any]) -> str:
    """What run.json says the step spent its time on, in a few words."""
    found = metrics.get(step) or {}
    if step == "export":
        return f"load {found.get('load_seconds', 0):.0f} s, export {found.get('export_seconds', 0):.0f} s"
    if step == "optimize":
        built = ", ".join(f"{name} {v['seconds']:.0f} s" for name, v in found.get("variants", {}).items()
                          if "seconds" in v)
        decided = found.get("precisions", {}).get("decisions", {})
        skipped = [p for p, d in decided.items() if not d.get("built")]
        return built + (f"; not built: {', '.join(skipped)}" if skipped else "")
    if step == "parity":
        parts = [f"reference {found.get('inputs', {}).get('reference_seconds', 0):.0f} s"
                 + (" (cached)" if found.get("inputs", {}).get("reference_cached") else "")]
        reference = found.get("reference") or {}
        if "seconds" in reference:
            parts.append(f"module vs library {reference['seconds']:.0f} s")
        parts += [f"{name} {v['seconds']:.0f} s" for name, v in found.get("variants", {}).items() if "seconds" in v]
        for precision, repair in found.get("repair", {}).items():
            parts.append(f"{precision} repair {repair.get('seconds', 0):.0f} s ({len(repair.get('candidates', []))} "
                         f"candidates, {len(repair.get('bases', []))} recipes; {repair.get('outcome')})")
        return ", ".join(parts)
    if step == "triton":
        served = found.get("served_parity") or {}
        return (f"{found.get('variant')} served; server ready in {found.get('ready_seconds', 0):.1f} s; served parity "
                + ", ".join(f"{p} {v.get('seconds', 0):.0f} s" for p, v in served.items()))
    if step == "generation":
        return ", ".join(f"{task} {result.get('seconds', 0):.0f} s" for task, result in found.items())
    if step == "bench":
        return (f"in-process grid {found.get('latency', {}).get('seconds', 0):.0f} s, served sweeps "
                f"{found.get('served', {}).get('seconds', 0):.0f} s")
    return ""


def run_model(name: str, model: str, steps: str | None, out: Path, overrides: list[str],
              warm_cache: bool) -> dict[str, Any]:
    run_dir = out / f"run-{name}"
    cache = [] if warm_cache else [f"-p=parity.reference_cache_dir={out / 'reference-cache'}"]
    command = [str(ROOT / ".venv" / "bin" / "workbench"), "run", "--model", model, "--output-dir", str(run_dir),
               "--overwrite", *(["--steps", steps] if steps else []), *cache, *[f"-p={o}" for o in overrides]]
    started = time.time()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sampler = TreeSampler(process.pid)
    sampler.start()
    _, stderr = process.communicate()
    sampler.stop.set()
    wall = time.time() - started
    record = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    rows = []
    for step, entry in record["steps"].items():
        if "started" not in entry or entry.get("seconds") is None:
            rows.append({"step": step, "status": entry["status"]})
            continue
        begin = datetime.fromisoformat(entry["started"]).timestamp()
        cpu_s, rss_mb = sampler.window(begin, begin + entry["seconds"])
        rows.append({"step": step, "status": entry["status"], "seconds": entry["seconds"], "cpu_seconds": cpu_s,
                     "peak_rss_mb": rss_mb, "spent_on": spent_on(step, record.get("metrics", {}))})
    return {"model": name, "wall_seconds": wall, "exit": process.returncode, "steps": rows,
            "peak_rss_mb": max((s.rss_mb for s in sampler.samples), default=0.0),
            "error": stderr.strip().splitlines()[-1] if process.returncode else None}


def measure(models: list[str], out_dir: str | None, overrides: list[str], warm_cache: bool, limit_gb: float | None,
            long_count: int) -> None:
    with tempfile.TemporaryDirectory(prefix="timeline-") as scratch, memory_cgroup(limit_gb) as limited:
        out = Path(out_dir or scratch)
        out.mkdir(parents=True, exist_ok=True)
        features, busy = cpu_features(), others_busy()
        print(f"host: {cpu_model()}, {os.cpu_count()} vCPUs, flags {' '.join(features.flags)}; int8 dot "
              f"product: {features.int8_dot_product or 'none'}; other processes busy: {busy:.1f} cores; {limited}")
        results = []
        for name in models:
            builders = {"base": build_base, "large": build_large}
            model = str(built(builders[name], out / name)) if name in builders else \
                "sentence-transformers/all-MiniLM-L6-v2"
            asks = [f"triton.max_request_tokens={LONG_TOKENS * long_count * 2}"] if name == "large" and long_count \
                else []  # the long request is past the default bound (4 model calls): this deployment allows it
            result = run_model(name, model, None if name == "minilm" else BASE_STEPS, out, overrides + asks,
                               warm_cache)
            report(result)
            if name == "large":
                result["weights_mb"] = sum(f.stat().st_size for f in (out / name).rglob("*.safetensors")) / 2**20
                if result["exit"] == 0 and long_count:
                    result["served_long"] = served_long_texts(out / f"run-{name}", long_count, LONG_TOKENS)
                    report_served(result["served_long"])
            results.append(result)
        print()
        for result in results:
            verdicts(result)
        (out / "timeline.json").write_text(json.dumps({"host": features.recorded(), "busy": busy, "memory": limited,
                                                       "results": results}, indent=1), encoding="utf-8")
        print(f"written: {out / 'timeline.json'}")


def report(result: dict[str, Any]) -> None:
    """The model's table: per step, wall and CPU seconds, peak memory and what the time went on."""
    print(f"\n{result['model']}: exit {result['exit']}, {result['wall_seconds']:.0f} s wall, peak memory (PSS) "
          f"{result['peak_rss_mb']:.0f} MB" + (f"; {result['error']}" if result["error"] else ""))
    print("| step | status | seconds | CPU seconds | peak memory MB (PSS) | spent on |")
    print("|---|---|---|---|---|---|")
    for row in result["steps"]:
        if "seconds" in row:
            print(f"| {row['step']} | {row['status']} | {row['seconds']:.0f} | {row['cpu_seconds']:.0f} | "
                  f"{row['peak_rss_mb']:.0f} | {row['spent_on']} |")
        else:
            print(f"| {row['step']} | {row['status']} | | | | |")


def report_served(served: dict[str, Any]) -> None:
    """The long-text request's line: time, shape, the first text's answer against the same text alone, memory."""
    if "error" in served:
        print(f"served check: {served['error']}")
        return
    print(f"served {served['variant']}: one request of {served['texts']} texts of {min(served['tokens'])}-"
          f"{max(served['tokens'])} tokens answered in {served['seconds']:.0f} s, {served['output']} "
          f"{served['shape']} (finite: {served['finite']}), within max_tokens {served['max_tokens']}; the first "
          f"text alone differs by max abs {served['first_alone_max_abs']:.1e}; server peak "
          f"{served['server_peak_mb']:.0f} MB", flush=True)


def verdicts(result: dict[str, Any]) -> None:
    """PASS/MISS against the model's targets (never asserted)."""
    name, target = result["model"], TARGETS[result["model"]]
    ok = result["exit"] == 0 and result["wall_seconds"] <= target
    detail = ""
    if name == "base":
        ok = ok and result["peak_rss_mb"] <= BASE_RSS_MB
        detail = f", peak memory <= {BASE_RSS_MB} MB"
    if name == "large":
        budget = 3 * result["weights_mb"] + 1536
        over = [row["step"] for row in result["steps"] if row.get("peak_rss_mb", 0) > budget]
        served = result.get("served_long", {"error": "not run"})
        ok = ok and not over and "error" not in served and served["first_alone_max_abs"] <= 1e-4
        detail = (f", each step <= 3 x the fp32 weights + 1.5 GB = {budget:.0f} MB"
                  + (f" (over: {', '.join(over)})" if over else "")
                  + ", the served long-text request answered, its first text as alone")
    print(f"{'PASS' if ok else 'MISS'}: {name} in {result['wall_seconds'] / 60:.1f} min (target {target / 60:.0f} min"
          f"{detail})")


def main() -> int:
    """Run the timeline (exit 0); errors and signals end it as `script_exit` says."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="minilm,base", help="among minilm, base and large (default: minilm,base)")
    parser.add_argument("--out", default=None, help="folder for the runs and timeline.json (default: temporary)")
    parser.add_argument("-p", dest="overrides", action="append", default=[], help="a setting for every run")
    parser.add_argument("--warm-cache", action="store_true", help="read reference outputs earlier runs kept")
    parser.add_argument("--memory-limit", type=float, default=None, metavar="GIB",
                        help="run inside a memory cgroup of this many GiB (root; e.g. 12 for the large model)")
    parser.add_argument("--long-texts", type=int, default=32, metavar="N",
                        help="texts of 8,000 tokens in the request sent to the large model's deployment (0: none)")
    add_page_argument(parser)
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in TARGETS]
    if unknown:
        parser.error(f"unknown models {unknown}: choose among {', '.join(TARGETS)}")
    def body() -> None:
        measure(models, args.out, args.overrides, args.warm_cache, args.memory_limit, args.long_texts)

    return script_exit(lambda: printed_to(args.page, "Where a run's time goes: benchmarks/timeline.py", body),
                       "timeline.json not written")


if __name__ == "__main__":
    sys.exit(main())

"""The workbench's deployment beside what its users run instead, measured side by side in one run.

    .venv/bin/python benchmarks/peers.py --install    # once: infinity-emb in its own environment (.peers/infinity)
    .venv/bin/python benchmarks/peers.py [--run outputs/<run>] [--levels 1,4,16,64] [--requests 1000] [--repeats 3]

Without --run it first runs export, optimize, parity and triton on the embedded all-MiniLM-L6-v2. Then, on this
host, with the load client on the same cores as the servers:
  - servers: the workbench's Triton serving its deployed variant and its fp32, the deployed variant through the API
    front (OpenAI's /v1/embeddings, base64, as the openai client asks), and infinity-emb (Optimum engine) serving
    Optimum's own O2 fp32 file and its int8 preset for this CPU (per channel);
  - one client code path for all of them: one-text requests over HTTP JSON at each concurrency, the levels
    interleaved across servers and repeated (the req/s range over repeats shows the noise); Triton also over gRPC,
    its best case;
  - accuracy of every server against `SentenceTransformer(folder).encode()` on the corpus (min / mean cosine, texts
    whose nearest neighbour stays encode()'s), resident memory of each server's process tree after its load;
  - in process: encode() at its best batch size (the baseline everyone knows) and the deployed variant in ONNX
    Runtime with the served threads (tokenized beforehand: the bench step's `efficiency` reference);
  - at concurrency 1, where the served request's time goes: Triton's stages and the Python model's own.
With --task rerank: a cross-encoder (without --run, the embedded model's weights under a one-label head) served by
the workbench and by infinity-emb's /rerank (Optimum's fp32 and int8 files), each request a query with --documents
documents over HTTP JSON, scores against CrossEncoder.predict() (max abs, Kendall tau, same top document); writes
<run>/peers/peers-rerank.json.
Prints the table and the checks of issue #25 (PASS/MISS, never an assertion), and writes <run>/peers/peers.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

from peerlib.pages import add_page_argument, printed_to
from peerlib.peers import (
    Embedder,
    InfinityServer,
    PeerRow,
    accuracy,
    build_optimum,
    embed_all,
    encode_rates,
    find_infinity,
    front_embedder,
    http_level,
    infinity_embedder,
    infinity_reranker,
    install_infinity,
    lead,
    require_built,
    require_positive,
    rerank_accuracy,
    rerank_all,
    table,
    triton_embedder,
    triton_reranker,
)

from workbench.core.config import RunConfig
from workbench.core.errors import ConfigError, MissingArtifactError
from workbench.core.machine import cpu_features
from workbench.core.record import RunRecord
from workbench.interrupt import script_exit
from workbench.measure.load import (
    asyncio_level,
    breakdown,
    own_breakdown,
    request_texts,
    settled_stages,
    stage_totals,
)
from workbench.measure.tables import ServedLevel
from workbench.models.loading import resolve_source
from workbench.pipeline import run_pipeline
from workbench.runners.timing import others_busy
from workbench.serving.client import AsyncTritonClient, TritonClient
from workbench.serving.front import ApiFront
from workbench.serving.repository import ServingPlan, write_repository
from workbench.serving.server import TritonServer
from workbench.serving.tables import TritonMetrics
from workbench.steps.bench import deployed_plan, in_process_rates

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VENV = ROOT / ".peers" / "infinity"
C1_TARGET, THROUGHPUT_TARGET = 1.2, 0.95  # served p50 at c=1 over in process; served throughput over in process
FRONT_P50_TARGET, FRONT_THROUGHPUT_TARGET = 1.10, 0.95  # the API front over Triton's HTTP direct: p50 at c1, req/s
FRONT_LEVELS = (16, 64)  # where the front's throughput is held to FRONT_THROUGHPUT_TARGET


def main() -> int:
    """Run the comparison (exit 0); errors and signals end it as `script_exit` says: the servers it started are
    stopped on the way out."""
    def body() -> None:
        args = arguments()
        printed_to(args.page, "The deployment beside its peers: benchmarks/peers.py", lambda: compare(args))

    return script_exit(body, "every server it started is stopped; peers.json not written")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="a run whose triton step deployed a variant")
    parser.add_argument("--peer-venv", type=Path, default=DEFAULT_VENV, help="infinity-emb's own environment")
    parser.add_argument("--install", action="store_true", help="create --peer-venv, then exit")
    parser.add_argument("--levels", default="1,4,16,64", help="concurrency levels, comma-separated")
    parser.add_argument("--requests", type=int, default=1000, help="requests per level")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every level")
    parser.add_argument("--seconds", type=float, default=60.0, help="upper bound on one level")
    parser.add_argument("--task", choices=("embed", "rerank"), default="embed", help=(
        "rerank: a cross-encoder (without --run: the embedded model's weights under a one-label head, the shape of "
        "ms-marco-MiniLM-L6-v2) beside infinity-emb's /rerank"))
    parser.add_argument("--documents", type=int, default=16, help="rerank: documents per request")
    add_page_argument(parser)
    args = parser.parse_args()
    try:
        args.levels = sorted({int(c) for c in args.levels.split(",")})
    except ValueError:
        raise ConfigError(f"--levels {args.levels!r} is not a list of whole numbers",
                          "give concurrency levels like --levels 1,4,16,64") from None
    require_positive([("--levels", min(args.levels)), ("--requests", args.requests), ("--repeats", args.repeats),
                      ("--seconds", args.seconds), ("--documents", args.documents)])
    return args


def deployed_run(args: argparse.Namespace, config: RunConfig, prefix: str) -> tuple[RunRecord, ServingPlan, str]:
    """The run of --run (without it: `config` run now through the triton step) and what its triton step deployed."""
    if args.run is None:
        args.run = ROOT / "outputs" / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
        run_pipeline(config.model_copy(update={"steps": ["export", "optimize", "parity", "triton"]}), args.run)
    record = RunRecord.load(args.run)
    deployed = deployed_plan(record.current(TritonMetrics), record)
    if deployed is None:
        raise MissingArtifactError(f"{args.run} has no current deployment (triton: "
                                   f"{record.step_entry('triton').label})",
                                   f"run `workbench run --output-dir {args.run} --resume --steps triton` first")
    return record, *deployed


def compare(args: argparse.Namespace) -> None:
    if args.install:
        print(f"installed: {install_infinity(args.peer_venv)}")
        return
    infinity = find_infinity(args.peer_venv)  # refused before anything is built or measured
    if args.task == "rerank":
        compare_rerank(args, infinity)
        return
    record, plan, variant = deployed_run(args, RunConfig(), "peers")
    levels = args.levels
    texts = list(record.config.texts())
    work = args.run / "peers"
    features = cpu_features()
    busy = others_busy()
    preset = "avx512_vnni" if "avx512_vnni" in features.flags else "avx2"
    model_dir = resolve_source(record.config.model).location
    optimum = work / "optimum"
    require_built(build_optimum(args.peer_venv / "bin" / "python", ROOT / "benchmarks" / "peer_optimum.py",
                                model_dir, optimum, preset, ["fp32", "int8"]), optimum / "build.log")
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    library = SentenceTransformer(model_dir, device="cpu")
    reference = library.encode(texts, batch_size=32)
    plans = {f"workbench Triton {variant}": (plan, variant)}
    if variant != "fp32":
        plans["workbench Triton fp32"] = (replace(plan, model_file=record.variant("fp32").path), "fp32")
    result: dict[str, Any] = {"host": {**features.recorded(), "date": time.strftime("%Y-%m-%d"), "busy_before": busy,
                                       "cores": os.cpu_count()}, "run": str(args.run),
                              "deployed": variant, "levels": levels, "requests": args.requests,
                              "repeats": args.repeats}
    with ExitStack() as stack:
        servers = started(stack, plans, work, "")
        embedders = [triton_embedder(name, precision, servers[name], served.name, "sentence_embedding")
                     for name, (served, precision) in plans.items()]
        deployed_server = servers[embedders[0].name]
        front = stack.enter_context(ApiFront(deployed_server.repository, deployed_server.grpc_url, work / "front"))
        embedders.insert(1, front_embedder(f"workbench Triton {variant}, API front", variant, front, plan.name))
        embedders += [infinity_embedder(name, precision, peer) for name, (precision, peer) in
                      started_peers(stack, infinity, optimum, preset, work, "").items()]
        rows = {e.name: PeerRow(e.name, e.precision, accuracy=accuracy(embed_all(e, texts), reference))
                for e in embedders}
        grpc_name = f"workbench Triton {variant}, gRPC"
        rows[grpc_name] = PeerRow(grpc_name, variant, accuracy=rows[embedders[0].name].accuracy)
        stages: dict[str, Any] = {}
        for repeat in range(args.repeats):
            for concurrency in levels:
                print(f"repeat {repeat + 1}/{args.repeats}, concurrency {concurrency}", flush=True)
                for embedder in embedders:
                    def load(e: Embedder = embedder, c: int = concurrency) -> ServedLevel:
                        return http_level(e, texts, c, args.requests, args.seconds)
                    deployed = embedder is embedders[0]  # where its time goes is read on the deployment only
                    level = measured_stages(deployed_server, plan, stages, f"http c{concurrency}", load) \
                        if deployed else load()
                    rows[embedder.name].levels.setdefault(concurrency, []).append(level)
                rows[grpc_name].levels.setdefault(concurrency, []).append(measured_stages(
                    deployed_server, plan, stages, f"grpc c{concurrency}",
                    lambda c=concurrency: grpc_level(deployed_server, plan, texts, c, args)))
        for embedder in embedders:
            rows[embedder.name].rss_bytes = embedder.rss()
    result["stages"] = stages
    result["rows"] = [row.record() for row in rows.values()]
    result["in_process"] = {
        "encode": encode_rates(library, texts),
        variant: in_process_rates(record.config, record, plan, variant, texts).recorded(),
    }
    work.mkdir(parents=True, exist_ok=True)
    (work / "peers.json").write_text(json.dumps(result, indent=2))
    report(result, list(rows.values()), levels, variant, plan)


def started(stack: ExitStack, plans: dict[str, tuple[ServingPlan, str]], work: Path,
            prefix: str) -> dict[str, TritonServer]:
    """A Triton server per plan (its repository under work/<prefix><precision>), stopped with `stack`."""
    return {name: stack.enter_context(TritonServer(write_repository(
        served, work / f"{prefix}{name.split()[-1]}" / "repository", overwrite=True),
        work / f"{prefix}{name.split()[-1]}" / "server")) for name, (served, _) in plans.items()}


def started_peers(stack: ExitStack, infinity: Path, optimum: Path, preset: str, work: Path,
                  prefix: str) -> dict[str, tuple[str, InfinityServer]]:
    """infinity-emb on Optimum's fp32 and int8 files (logs work/infinity-<prefix><precision>.log), stopped with
    `stack`: by name, the precision and the server."""
    peers = {}
    for precision, quantized in (("fp32", False), (f"int8 ({preset}, per channel)", True)):
        short = precision.split()[0]
        peers[f"infinity-emb {short}"] = (precision, stack.enter_context(InfinityServer(
            infinity, optimum / short, quantized, work / f"infinity-{prefix}{short}.log")))
    return peers


def stand_in_reranker(dest: Path) -> Path:
    """The embedded model's weights under a one-label head (seeded), saved by CrossEncoder: the shape of
    ms-marco-MiniLM-L6-v2 (no hub here). Its scores rank nothing real; speed and agreement with predict() hold."""
    import torch
    from sentence_transformers import CrossEncoder

    if not (dest / "config.json").is_file():
        torch.manual_seed(0)
        CrossEncoder(resolve_source(RunConfig().model).location, num_labels=1, device="cpu").save(str(dest))
    return dest


def compare_rerank(args: argparse.Namespace, infinity: Path) -> None:
    """The deployed reranker (and its fp32) beside infinity-emb's /rerank on Optimum's fp32 and int8 files: one
    HTTP JSON client, a corpus text as the query with the next --documents texts per request, levels interleaved
    and repeated; scores against CrossEncoder.predict()."""
    from sentence_transformers import CrossEncoder

    config = RunConfig() if args.run else RunConfig(task="rerank", model=str(stand_in_reranker(
        ROOT / "outputs" / f"reranker-{time.strftime('%Y%m%d-%H%M%S')}")))  # --run names its own model
    record, plan, variant = deployed_run(args, config, "peers-rerank")
    texts, work = list(record.config.texts()), args.run / "peers"
    features, busy = cpu_features(), others_busy()
    preset = "avx512_vnni" if "avx512_vnni" in features.flags else "avx2"
    model_dir = resolve_source(record.config.model).location
    optimum = work / "optimum-rerank"
    require_built(build_optimum(args.peer_venv / "bin" / "python", ROOT / "benchmarks" / "peer_optimum.py",
                                model_dir, optimum, preset, ["fp32", "int8"], task="text-classification"),
                  optimum / "build.log")
    requests = [request_texts(texts, i, args.documents) for i in range(len(texts) // (args.documents + 1))]
    library = CrossEncoder(model_dir, device="cpu")
    reference = [library.predict([(r[0], d) for d in r[1:]], batch_size=32, show_progress_bar=False)
                 for r in requests]
    plans = {f"workbench Triton {variant}": (plan, variant)}
    if variant != "fp32":
        plans["workbench Triton fp32"] = (replace(plan, model_file=record.variant("fp32").path), "fp32")
    result: dict[str, Any] = {"host": {**features.recorded(), "date": time.strftime("%Y-%m-%d"), "busy_before": busy,
                                       "cores": os.cpu_count()}, "run": str(args.run), "deployed": variant,
                              "levels": args.levels, "requests": args.requests, "repeats": args.repeats,
                              "documents": args.documents}
    with ExitStack() as stack:
        servers = started(stack, plans, work, "rerank-")
        rerankers = [triton_reranker(name, precision, servers[name], served.name)
                     for name, (served, precision) in plans.items()]
        rerankers += [infinity_reranker(name, precision, peer) for name, (precision, peer) in
                      started_peers(stack, infinity, optimum, preset, work, "rerank-").items()]
        rows = {r.name: PeerRow(r.name, r.precision, accuracy=rerank_accuracy(rerank_all(r, requests), reference))
                for r in rerankers}
        for repeat in range(args.repeats):
            for concurrency in args.levels:
                print(f"repeat {repeat + 1}/{args.repeats}, concurrency {concurrency}", flush=True)
                for reranker in rerankers:
                    rows[reranker.name].levels.setdefault(concurrency, []).append(http_level(
                        reranker, texts, concurrency, args.requests, args.seconds, args.documents))
        for reranker in rerankers:
            rows[reranker.name].rss_bytes = reranker.rss()
    result["rows"] = [row.record() for row in rows.values()]
    work.mkdir(parents=True, exist_ok=True)
    (work / "peers-rerank.json").write_text(json.dumps(result, indent=2))
    print(f"\n{result['host']['date']}; CPU flags: {' '.join(features.flags)}; {args.repeats} interleaved "
          f"repeats of {args.requests} requests per level, each a query with {args.documents} documents (pairs/s = "
          "req/s x documents); req/s (range over repeats) / p50 ms / p99 ms\n")
    if busy > (os.cpu_count() or 1) / 2:
        print(f"BUSY HOST: other processes kept {busy:.1f} cores busy when measuring began: ratios only\n")
    print(table(list(rows.values()), args.levels))
    by_name = {row.name: row for row in rows.values()}
    for ours, peer in [("workbench Triton fp32", "infinity-emb fp32")] + (
            [(f"workbench Triton {variant}", "infinity-emb int8")] if variant.startswith("int8") else []):
        ratios = lead(by_name[ours], by_name[peer], args.levels)
        print(f"{ours} over {peer}, req/s: " + ", ".join(f"c{c} {r:.2f}x" for c, r in ratios.items()))
    print(f"\nwritten: {work / 'peers-rerank.json'}")


def grpc_level(server: TritonServer, plan: ServingPlan, texts: list[str], concurrency: int,
               args: argparse.Namespace) -> ServedLevel:
    async def send(client: AsyncTritonClient, index: int) -> object:
        return await client.infer_texts(plan.name, [texts[index % len(texts)]], ["sentence_embedding"])
    return asyncio_level(server.grpc_url, "grpc", send, concurrency, args.requests, args.seconds)


def measured_stages(server: TritonServer, plan: ServingPlan, stages: dict[str, Any], label: str,
                    measure: Any) -> ServedLevel:
    """`measure()`, with where the server's time went meanwhile (Triton's stages, the Python model's own) kept
    in `stages[label]` (one entry per repeat)."""
    with TritonClient(server.grpc_url) as client:
        own_before = settled_stages(server.metrics_url, plan.name)
        before = stage_totals(client.statistics(plan.name))
        level = measure()
        after = stage_totals(client.statistics(plan.name))
        own_after = settled_stages(server.metrics_url, plan.name)
    stages.setdefault(label, []).append({"triton_ms": breakdown(before, after),
                                         "model_ms": own_breakdown(own_before, own_after),
                                         "client_p50_ms": level.p50, "client_mean_ms": level.mean})
    return level


def report(result: dict[str, Any], rows: list[PeerRow], levels: list[int], variant: str, plan: ServingPlan) -> None:
    host = result["host"]
    print(f"\n{host['date']}; CPU flags: {' '.join(host['flags'])}; int8 dot product: "
          f"{host['int8_dot_product'] or 'none'}; {result['repeats']} interleaved repeats of {result['requests']} "
          f"one-text requests per level; req/s (range over repeats) / p50 ms / p99 ms\n")
    if host["busy_before"] > (host["cores"] or 1) / 2:
        print(f"BUSY HOST: other processes kept {host['busy_before']:.1f} of {host['cores']} cores busy when measuring "
              "began: absolute times do not hold, ratios only where the other work slowed every row alike; re-run on a "
              "quiet host\n")
    print(table(rows, levels))
    encode = result["in_process"]["encode"]
    ours = result["in_process"][variant]
    best = ours["sequences_per_s"][str(ours["best_batch"])]
    print(f"\nin process: SentenceTransformer.encode() {encode['texts_per_s'][str(encode['best_batch'])]:.0f} "
          f"texts/s at batch {encode['best_batch']}, one text {encode['p50_ms']:.2f} ms; {variant} in ONNX Runtime "
          f"({plan.threads * plan.instances} threads, tokenized beforehand) {best:.0f} texts/s at batch "
          f"{ours['best_batch']}, one text "
          f"{ours['p50_ms']:.2f} ms")
    by_name = {row.name: row for row in rows}
    served = by_name[f"workbench Triton {variant}"]
    pairs = [("workbench Triton fp32", "infinity-emb fp32")]
    if variant.startswith("int8"):
        pairs.append((f"workbench Triton {variant}", "infinity-emb int8"))
    for ours_name, peer in pairs:  # equal precision
        mine = by_name[ours_name]
        ratios = lead(mine, by_name[peer], levels)
        verdict = "PASS" if all(r > 1 for r in ratios.values()) else "MISS"
        print(f"{mine.name} over {peer}, req/s: " + ", ".join(f"c{c} {r:.2f}x" for c, r in ratios.items())
              + f" (target > 1 at every level) {verdict}")
    for row in (served, by_name[f"workbench Triton {variant}, gRPC"]):
        if 1 in row.levels:
            ratio = row.median(1, "p50") / ours["p50_ms"]
            print(f"{row.name}: p50 at c1 {row.median(1, 'p50'):.2f} ms = {ratio:.2f}x in process (target <= "
                  f"{C1_TARGET}x) {'PASS' if ratio <= C1_TARGET else 'MISS'}")
        shares = {c: row.median(c, "throughput") / best for c in levels if c >= 4}
        if not shares:
            continue  # no level of 4 or more was asked for
        verdict = "PASS" if all(share >= THROUGHPUT_TARGET for share in shares.values()) else "MISS"
        print(f"{row.name}: throughput over in process " + ", ".join(f"c{c} {s:.2f}" for c, s in shares.items())
              + f" (target >= {THROUGHPUT_TARGET}) {verdict}")
    front = by_name.get(f"workbench Triton {variant}, API front")
    if front is not None:
        front_checks(front, served, levels)
    for label, runs in result["stages"].items():
        if label.endswith(" c1"):
            mean = {key: statistics.median(run["model_ms"].get(key, 0.0) for run in runs)
                    for key in runs[0]["model_ms"]}
            triton = {key: statistics.median(run["triton_ms"][key] for run in runs)
                      for key in ("queue", "compute_input", "compute_infer", "compute_output")}
            client = statistics.median(run["client_mean_ms"] for run in runs)
            print(f"where a request's time goes at c1 over {label.split()[0]} (mean ms): client {client:.2f}; Triton "
                  + ", ".join(f"{k} {v:.2f}" for k, v in triton.items()) + "; in the model "
                  + ", ".join(f"{k} {v:.2f}" for k, v in mean.items()))
    print(f"\nwritten: {result['run']}/peers/peers.json")


def front_checks(front: PeerRow, direct: PeerRow, levels: list[int]) -> None:
    """The API front against Triton's HTTP direct, measured in the same repeats: p50 at c1, req/s at c16 and c64."""
    if 1 in levels:
        ratio = front.median(1, "p50") / direct.median(1, "p50")
        print(f"{front.name} over Triton HTTP direct: p50 at c1 {ratio:.2f}x (target <= {FRONT_P50_TARGET}x) "
              f"{'PASS' if ratio <= FRONT_P50_TARGET else 'MISS'}")
    shares = {c: front.median(c, "throughput") / direct.median(c, "throughput") for c in FRONT_LEVELS if c in levels}
    if shares:
        verdict = "PASS" if all(share >= FRONT_THROUGHPUT_TARGET for share in shares.values()) else "MISS"
        print(f"{front.name} over Triton HTTP direct, req/s: " + ", ".join(f"c{c} {s:.2f}" for c, s in shares.items())
              + f" (target >= {FRONT_THROUGHPUT_TARGET}) {verdict}")


if __name__ == "__main__":
    sys.exit(main())

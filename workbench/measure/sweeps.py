"""Served benchmarks on a local Triton: concurrency sweeps with and without dynamic batching, a small search over
batching settings, and server-side vs client-side tokenization, each with Triton's own stage breakdown; and
`measure_text_loads`, chosen text loads on a server per batching setting (benchmarks/bench.py)."""
from __future__ import annotations

import itertools
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from workbench.core.errors import DependencyMissingError
from workbench.core.progress import track
from workbench.measure.load import (
    asyncio_level,
    breakdown,
    own_breakdown,
    rerank_level,
    settled_stages,
    stage_totals,
    text_level,
)
from workbench.measure.perf_analyzer import PerfAnalyzer, find_perf_analyzer
from workbench.measure.settings import BenchSettings
from workbench.measure.tables import (
    BatchingSearch,
    BatchingSweeps,
    Efficiency,
    InProcessRates,
    InstanceMemory,
    Levels,
    MeasuredPlan,
    SearchCandidate,
    ServedBenchmark,
    ServedLevel,
)
from workbench.models.text import encode
from workbench.serving.client import TritonClient
from workbench.serving.flavor import Flavor
from workbench.serving.repository import ServingPlan, write_repository
from workbench.serving.server import TritonServer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase as Tokenizer

BATCHING = (("batching_off", False), ("batching_on", True))
MIB = 2**20
WEIGHT_SUFFIXES = {".onnx", ".data", ".bin", ".xml", ".plan"}  # a model folder's graphs and their weights
T = TypeVar("T")


class ServedBench:
    """Measures one running server over `protocol` (gRPC unless told): text to the served model, or token ids
    (tokenized here) straight to the ensemble's network model."""

    def __init__(self, bench: BenchSettings, plan: ServingPlan, server: TritonServer, texts: list[str],
                 tokenizer: Tokenizer, tool: PerfAnalyzer | None, workdir: Path, protocol: str = "grpc") -> None:
        self.bench, self.plan, self.server, self.texts = bench, plan, server, texts
        self.tokenizer, self.tool, self.workdir, self.protocol = tokenizer, tool, workdir, protocol
        self.url = server.grpc_url if protocol == "grpc" else server.http_url

    def _stages(self) -> dict[str, dict[str, int]]:
        with TritonClient(self.server.grpc_url) as client:
            return {name: stage_totals(client.statistics(name)) for name in self.plan.working_models}

    def _own(self) -> dict[str, dict[str, float]]:
        """The Python models' own stage sums (the fused model times decode, tokenize, infer, respond)."""
        return {name: settled_stages(self.server.metrics_url, name) for name in self.plan.working_models}

    def _ids(self, index: int) -> dict[str, np.ndarray]:
        text = self.texts[index % len(self.texts)]
        return encode(self.tokenizer, [text], self.plan.input_names, max_length=self.plan.max_length)

    def level(self, concurrency: int, client_tokenization: bool = False) -> ServedLevel:
        """One concurrency level; perf_analyzer (text path) when available, else the asyncio generator."""
        bench = self.bench
        before, own_before = self._stages(), self._own()
        if client_tokenization:
            async def send(client: Any, index: int) -> object:
                return await client.infer(self.plan.model_name, self._ids(index))
            result = asyncio_level(self.url, self.protocol, send, concurrency, bench.requests_per_level,
                                   bench.seconds_per_level)
        else:
            result = text_level(self.tool, self.url, self.plan.name, self.texts, concurrency,
                                bench.requests_per_level, bench.seconds_per_level,
                                self.workdir / f"perf_analyzer_{self.protocol}", self.protocol)
        after, own_after = self._stages(), self._own()
        own = {name: own_breakdown(own_before[name], own_after[name]) for name in own_after if own_after[name]}
        result.server = {name: breakdown(before[name], after[name]) for name in before}
        if own:
            result.model_stages = own
        return result

    def sweep(self, levels: list[int], client_tokenization: bool = False) -> Levels:
        """`level` at each concurrency in turn, with progress: {"<concurrency>": level}."""
        sent = "token ids" if client_tokenization else "text"
        via = "perf_analyzer" if self.tool and not client_tokenization else "asyncio"
        label = (f"served {self.plan.layout}, batching {'on' if self.plan.dynamic_batching else 'off'}, "
                 f"{sent} over {self.protocol} via {via}")
        return {str(c): self.level(c, client_tokenization)
                for c in track(levels, label, "concurrency levels", note=lambda c: f"concurrency {c}")}


def _with_server(plan: ServingPlan, folder: Path, measure: Callable[[TritonServer], T]) -> T:
    """`measure` on a server of `plan`; its repository copy goes afterwards (the server log stays)."""
    repository = write_repository(plan, folder / "repository", overwrite=True)
    try:
        with TritonServer(repository, folder / "server") as server:
            return measure(server)
    finally:
        shutil.rmtree(repository, ignore_errors=True)


RERANK_DOCUMENTS = (16, 64)  # documents per query a reranker is measured at: a short and a long candidate list


def rerank_benchmark(bench: BenchSettings, plan: ServingPlan, texts: list[str], workdir: Path) -> ServedBenchmark:
    """A served reranker at each of `bench.concurrency` with RERANK_DOCUMENTS documents per request, over gRPC:
    requests/s, pairs/s and latency per level."""
    def measure(server: TritonServer) -> dict[str, Levels]:
        return {f"n{documents}": {f"c{level}": rerank_level(
            server.grpc_url, plan.name, texts, documents, level, bench.requests_per_level, bench.seconds_per_level)
            for level in bench.concurrency} for documents in RERANK_DOCUMENTS}
    return ServedBenchmark(rerank=_with_server(plan, workdir, measure), protocol="grpc", tool="asyncio")


def on_each_batching(plan: ServingPlan, workdir: Path,
                     measure: Callable[[TritonServer, ServingPlan, str], T]) -> dict[str, T]:
    """`measure(server, plan, label)` on a server of `plan` with dynamic batching off, then on one with it on:
    {"batching_off": ..., "batching_on": ...}. Each server's repository and log lie under `workdir/<label>/`."""
    results = {}
    for label, batching in BATCHING:
        measured = replace(plan, dynamic_batching=batching)
        results[label] = _with_server(measured, workdir / label,
                                      lambda server, p=measured, name=label: measure(server, p, name))
    return results


def load_tool(bench: BenchSettings) -> PerfAnalyzer | None:
    """perf_analyzer when installed and `bench.load_tool` allows it; None means the asyncio generator."""
    tool = find_perf_analyzer() if bench.load_tool != "asyncio" else None
    if bench.load_tool == "perf_analyzer" and tool is None:
        raise DependencyMissingError("perf_analyzer is not installed", "run `workbench install-perf-analyzer`")
    return tool


@dataclass(frozen=True)
class TextLoad:
    """A level of one-text requests to the ensemble: `requests` texts taken in turn from `texts`, `concurrency` in
    flight; measured on the servers whose dynamic batching setting is in `batching` (off, on)."""

    label: str
    texts: list[str]
    concurrency: int
    requests: int
    batching: tuple[bool, ...] = (False, True)


def measure_text_loads(plan: ServingPlan, loads: Sequence[TextLoad], workdir: Path, tool: PerfAnalyzer | None,
                       seconds: float) -> dict[str, Levels]:
    """Each load, in order, on a server of `plan` with dynamic batching off, then on one with it on (perf_analyzer
    when `tool` is given and finds a stable window, else the asyncio generator; each level bounded by `seconds`):
    {"batching_off": {label: level}, "batching_on": {label: level}}."""
    def measure(server: TritonServer, measured: ServingPlan, label: str) -> Levels:
        chosen = [load for load in loads if measured.dynamic_batching in load.batching]
        return {load.label: text_level(tool, server.grpc_url, measured.name, load.texts, load.concurrency,
                                       load.requests, seconds, workdir / label / "perf_analyzer" / load.label)
                for load in track(chosen, f"text loads, {label}", "loads", note=lambda load: load.label)}
    return on_each_batching(plan, workdir, measure)


def serving_efficiency(served: ServedBenchmark, in_process: InProcessRates) -> Efficiency:
    """Served against in process on the same texts: throughput at the top concurrency over the in-process
    throughput at its best batch size (batching off and on), and p50 at concurrency 1 over the in-process p50 at
    batch size 1."""
    top = max(served.levels)
    once = served.batching_on.text.get("1") if served.batching_on else None
    return Efficiency(concurrency=top, in_process=in_process,
                      throughput_ratio={label: sweeps.text[str(top)].throughput / in_process.best
                                        for label, sweeps in served.sweeps().items()},
                      p50_ratio_c1=once.p50 / in_process.p50_ms if once and in_process.p50_ms else None)


def pick(candidates: list[SearchCandidate], p99_limit_ms: float) -> SearchCandidate | None:
    """The highest throughput whose p99 stays under the limit (model_analyzer's objective)."""
    within = [c for c in candidates if c.p99 <= p99_limit_ms]
    return max(within, key=lambda c: c.throughput) if within else None


def instance_memory(server: TritonServer) -> list[InstanceMemory]:
    """Each Python-backend instance's PSS beside its model's weights on disk (the graphs and their data under the
    model's folder in the repository)."""
    weights = {}
    for folder in server.repository.iterdir():
        if folder.is_dir():
            weights[folder.name] = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()
                                       and f.suffix in WEIGHT_SUFFIXES)
    return [InstanceMemory(instance=name, pss_mib=round(pss / MIB, 1), weights_mib=round(weights.get(
        name.rsplit("_", 2)[0], 0) / MIB, 1)) for name, pss in sorted(server.instance_memory().items())]


def run_served_benchmark(bench: BenchSettings, plan: ServingPlan, texts: list[str], tokenizer: Tokenizer,
                         workdir: Path) -> ServedBenchmark:
    """Everything under metrics.bench.served: sweeps, the layouts compared (python-ort), the batching search, and
    where tokenization runs (measured on the ensemble layout, whose network model takes token ids)."""
    tool = load_tool(bench)
    levels = sorted(set(bench.concurrency))
    memory: list[InstanceMemory] = []

    def sweep(server: TritonServer, measured_plan: ServingPlan, label: str) -> BatchingSweeps:
        runner = ServedBench(bench, measured_plan, server, texts, tokenizer, tool, workdir / label)
        out = BatchingSweeps(text=runner.sweep(levels))
        if label == "batching_on" and measured_plan.layout == plan.layout:
            memory.extend(instance_memory(server))
        if label == "batching_on" and measured_plan.layout == "ensemble":  # like with like: both via asyncio
            generator = ServedBench(bench, measured_plan, server, texts, tokenizer, None, workdir / label)
            out.client_tokenization = generator.sweep(levels, client_tokenization=True)
            out.text_asyncio = generator.sweep(levels)
        if label == "batching_on" and measured_plan.layout == plan.layout:  # the deployment over HTTP too
            http = ServedBench(bench, measured_plan, server, texts, tokenizer, tool, workdir / label, "http")
            out.text_http = http.sweep(sorted({levels[0], levels[-1]}))
        return out

    sweeps = on_each_batching(plan, workdir, sweep)
    result = ServedBenchmark(
        tool="perf_analyzer" if tool else "asyncio", protocol="grpc", levels=levels,
        variant_plan=MeasuredPlan(flavor=plan.flavor.value, layout=plan.layout, max_batch_size=plan.max_batch_size,
                                  instances=plan.instances, threads=plan.threads, why=plan.instances_reason),
        batching_off=sweeps["batching_off"], batching_on=sweeps["batching_on"], memory=memory)
    if plan.flavor is Flavor.PYTHON_ORT and result.batching_on:  # the other layout, batching on, same load
        other = replace(plan, dynamic_batching=True, layout="ensemble" if plan.layout == "fused" else "fused")
        measured = _with_server(other, workdir / f"layout_{other.layout}",
                                lambda server: sweep(server, other, "batching_on"))
        result.layouts = {plan.layout: result.batching_on.text, other.layout: measured.text}
        if measured.client_tokenization:  # the other layout is the ensemble: tokenization is compared on it
            result.batching_on.client_tokenization = measured.client_tokenization
            result.batching_on.text_asyncio = measured.text_asyncio
    result.search = batching_search(bench, plan, texts, tokenizer, tool, workdir, max(levels))
    return result


def batching_search(bench: BenchSettings, plan: ServingPlan, texts: list[str], tokenizer: Tokenizer,
                    tool: PerfAnalyzer | None, workdir: Path, top: int) -> BatchingSearch:
    """Each queue delay x instance count of `bench` at concurrency `top`, the same cores in all; the one kept is
    `pick`'s."""
    candidates = []
    settings = list(itertools.product(bench.search_queue_delays_us, bench.search_instances))
    for delay, instances in track(settings, f"batching search at concurrency {top}", "settings",
                                  note=lambda setting: f"queue delay {setting[0]} us, instances {setting[1]}"):
        candidate = replace(plan, dynamic_batching=True, max_queue_delay_us=delay, instances=instances,
                            threads=max(1, plan.threads * plan.instances // instances))  # the same cores in all
        label = f"search_d{delay}_i{instances}"
        measured = _with_server(candidate, workdir / label, lambda server, p=candidate, name=label:
                                ServedBench(bench, p, server, texts, tokenizer, tool, workdir / name).level(top))
        candidates.append(SearchCandidate.model_validate(
            {"max_queue_delay_us": delay, "instances": instances,
             "preferred_batch_sizes": plan.preferred_batch_sizes, **measured.recorded()}))
    return BatchingSearch(concurrency=top, p99_limit_ms=bench.p99_limit_ms, candidates=candidates,
                          chosen=pick(candidates, bench.p99_limit_ms))

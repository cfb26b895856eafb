"""The deployment beside what its users run instead, measured by one client in one run: infinity-emb (an embedding
server, in a virtual environment of its own), SentenceTransformer.encode() in process, and the workbench's Triton.
Every server is loaded through one HTTP JSON path (`http_level`, the asyncio closed loop of measure/load), judged
against encode() on the same texts, and weighed by the resident memory of its process tree (benchmarks/peers.py)."""
from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import numpy as np

from workbench.core.errors import ConfigError, DependencyMissingError, WorkbenchError
from workbench.measure.load import closed_loop_level, request_texts
from workbench.measure.tables import ServedLevel
from workbench.models.pins import pin
from workbench.precision.compare import cosine
from workbench.precision.ranking import ranking_agreement
from workbench.precision.retrieval import retrieval_agreement
from workbench.serving.errors import ServerStartError
from workbench.serving.front import ApiFront
from workbench.serving.server import HOST, TritonServer, free_port, tree_rss

# infinity-emb pinned, and first the torch it runs on, pinned as ours is: a plain `torch` (or a range) pulls a CUDA
# build of several GB here.
INFINITY_PIN = "infinity-emb[server,optimum]==0.0.78"
INSTALL_HINT = ".venv/bin/python benchmarks/peers.py --install  (a virtual environment of about 1.5 GB, about a minute)"
# OpenVINO as sentence-transformers users get it; its [onnx] and [openvino] extras conflict, so it has an environment
# of its own (.peers/openvino), which also runs benchmarks/graphs.py's timing process.
OPENVINO_PIN = "sentence-transformers[openvino]==6.2.0"


def openvino_hint(venv: Path, peer: Path | None = None) -> str:
    """How to make the OpenVINO environment `venv` (the same command makes Optimum's, at `peer`)."""
    both = f" --peer-venv {peer}" if peer else ""
    return (f".venv/bin/python benchmarks/graphs.py --install --openvino-venv {venv}{both} (it makes OpenVINO's "
            "environment there and Optimum's at --peer-venv: about 6 GB and 1.5 GB, several minutes); or point "
            "--openvino-venv and --peer-venv at environments that already have them")


class PeerBuildError(WorkbenchError):
    """A peer's tool refused to build a graph the comparison needs."""


class PeerNotInstalledError(DependencyMissingError):
    """A peer server to compare with is not installed where the benchmark looks for it."""

    def headline(self) -> str:
        return self.problem  # `workbench doctor` knows nothing of peers: no pointer to it


def require_positive(values: Sequence[tuple[str, float]]) -> None:
    """A peer benchmark's numeric arguments, (flag, value): a value of 0 or less is a ConfigError naming its flag."""
    for name, value in values:
        if value <= 0:
            raise ConfigError(f"{name} must be positive, got {value}", f"give {name} a value above 0")


def build_optimum(python: Path, script: Path, model_dir: str, work: Path, preset: str, variants: Sequence[str],
                  task: str = "feature-extraction") -> dict[str, dict[str, str]]:
    """Optimum's `variants` of the model in `model_dir` exported for `task` (optimum-cli's name), one folder each
    under `work`, built by `script` run with the peer environment's `python`: per variant its file ({"path": ...})
    or why Optimum could not build it ({"problem": ...}). Built once, kept for later runs; an interrupted build
    leaves no folder to be taken as complete; a script that cannot run at all is a PeerNotInstalledError."""
    status = work / "status.json"
    if status.is_file():
        known = json.loads(status.read_text())
        if all(name in known and ("problem" in known[name] or Path(known[name]["path"]).is_file())
               for name in variants):
            return {name: known[name] for name in variants}
    code = _build("Optimum's graphs", [str(python), str(script), "--task", task, model_dir, str(work), preset,
                                       *variants], work)
    if code != 0 or not status.is_file():
        _remove_folders(work)
        raise PeerNotInstalledError(f"Optimum's build script failed (exit {code})",
                                    f"read {work / 'build.log'}; a broken peer environment is rebuilt by "
                                    f"{INSTALL_HINT}")
    return json.loads(status.read_text())


def require_built(status: dict[str, dict[str, str]], log: Path) -> None:
    """For a comparison that needs every peer variant: a PeerBuildError naming those that were not built."""
    problems = {name: built["problem"] for name, built in status.items() if "problem" in built}
    if problems:
        raise PeerBuildError(f"Optimum could not build {', '.join(f'{n} ({p})' for n, p in problems.items())}",
                             f"read {log}; this comparison needs every one of {', '.join(status)}")


def build_openvino(python: Path, script: Path, model_dir: str, work: Path, calibration: Path) -> dict[str, Any]:
    """OpenVINO's IRs of the model in `model_dir` under `work`, built by `script` run with the OpenVINO
    environment's `python`: per variant (fp32, int8) its IR and output, or the problem that stopped it (a family its
    exporter refuses is a row that says why). Kept for later runs; a script that cannot run at all is a
    PeerNotInstalledError."""
    status = work / "status.json"
    code = _build("OpenVINO's IRs", [str(python), str(script), model_dir, str(work), str(calibration)], work)
    if code != 0 or not status.is_file():
        raise PeerNotInstalledError(f"OpenVINO's build script failed (exit {code})",
                                    f"read {work / 'build.log'}; a broken OpenVINO environment is rebuilt by "
                                    f"{openvino_hint(python.parent.parent)}")
    return json.loads(status.read_text())


def _build(what: str, argv: list[str], work: Path) -> int:
    """Run a peer's build script (in a process group of its own: an interrupt stops its children too), its output
    in work/build.log; its exit code."""
    work.mkdir(parents=True, exist_ok=True)
    log = work / "build.log"
    print(f"building {what} (log: {log})", flush=True)
    with open(log, "ab") as out:
        builder = subprocess.Popen(argv, stdout=out, stderr=out, start_new_session=True)
        try:
            return builder.wait()
        except KeyboardInterrupt:
            os.killpg(builder.pid, signal.SIGKILL)
            builder.wait()
            _remove_folders(work)
            raise


def _remove_folders(work: Path) -> None:
    for folder in work.iterdir():
        if folder.is_dir():
            shutil.rmtree(folder)


def find_openvino(venv: Path) -> Path:
    """The Python of the OpenVINO environment `venv`, or a PeerNotInstalledError saying how to get it."""
    python = venv / "bin" / "python"
    if not (python.is_file() and list((venv / "lib").glob("python*/site-packages/openvino"))):
        raise PeerNotInstalledError(f"OpenVINO is not installed in {venv}", openvino_hint(venv))
    return python


def install_openvino(venv: Path) -> Path:
    """Create the OpenVINO environment `venv`: sentence-transformers with its OpenVINO extra (OpenVINO,
    optimum-intel, NNCF, and the torch and torchvision they resolve to, PyPI's CUDA builds: the workbench's CPU
    torch beside the torchvision optimum-intel asks for breaks transformers' imports) and, for the one timing
    process that runs every graph, the workbench's own onnxruntime with what `peerlib.graphs` imports."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    subprocess.run([*pip, "install", "--quiet", "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "install", "--quiet", OPENVINO_PIN, pin("onnxruntime"), pin("onnx"), pin("pydantic"),
                    pin("pyyaml")], check=True)
    subprocess.run([*pip, "check"], check=True)  # no conflict between the two stacks
    return find_openvino(venv)


def find_infinity(venv: Path) -> Path:
    """The infinity_emb command of the peer environment `venv` (as an absolute path: the peers run in their own
    folders), or a PeerNotInstalledError saying how to get it."""
    command = venv.resolve() / "bin" / "infinity_emb"
    if not command.is_file():
        raise PeerNotInstalledError(f"infinity-emb is not installed in {venv}", INSTALL_HINT)
    return command


def install_infinity(venv: Path) -> Path:
    """Create the peer environment `venv`: the CPU torch first (else pip picks a CUDA one), then infinity-emb with
    its Optimum engine (which brings optimum-onnx, used to build the peer's ONNX files)."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, pin("torch")], check=True)
    subprocess.run([*pip, INFINITY_PIN], check=True)
    return find_infinity(venv)


class InfinityServer:
    """`infinity_emb v2` serving the ONNX file in `folder` on 127.0.0.1, stopped by PID (its process group)."""

    def __init__(self, command: Path, folder: Path, quantized: bool, log: Path) -> None:
        self.command, self.folder, self.quantized, self.log = command, folder, quantized, log
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, timeout: float = 180.0) -> InfinityServer:
        # `--model-id .` from inside the folder: an absolute path fails with optimum 2.x ("Could not find any ONNX
        # files with target file name /abs/.../model.onnx"). `--pooling-method mean` because its `auto` picks CLS
        # pooling for all-MiniLM-L6-v2 (mean cosine 0.47 against encode()). On a CPU it prefers a file whose name
        # says "quantized": the fp32 folder holds none, and --onnx-do-not-prefer-quantized says so too.
        argv = [str(self.command), "v2", "--model-id", ".", "--engine", "optimum", "--device", "cpu",
                "--host", HOST, "--port", str(self.port), "--pooling-method", "mean"]
        if not self.quantized:
            argv.append("--onnx-do-not-prefer-quantized")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0"}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(argv, cwd=self.folder, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        try:
            self._wait_ready(self.process, timeout)
        except BaseException:  # an interrupt while it starts too: never leave it running
            self.stop()
            raise
        return self

    def _wait_ready(self, process: subprocess.Popen[bytes], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise ServerStartError(f"infinity_emb exited with code {process.returncode} while starting",
                                       f"read {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        raise ServerStartError(f"infinity_emb did not answer /health within {timeout:.0f} s", f"read {self.log}")

    def rss_bytes(self) -> int:
        return tree_rss(self.process.pid) if self.process else 0

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def __enter__(self) -> InfinityServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class Embedder:
    """One server as an HTTP JSON client sees it: where to POST texts (a reranker's: its query, then the
    documents), the body, how to read the vectors (a reranker's: the documents' scores, in their order) back."""

    name: str
    precision: str
    url: str
    body: Callable[[list[str]], dict[str, Any]]
    vectors: Callable[[dict[str, Any]], np.ndarray]
    rss: Callable[[], int]


def triton_embedder(name: str, precision: str, server: TritonServer, model: str, output: str) -> Embedder:
    """Triton's KServe v2 JSON: texts as a BYTES tensor [n, 1], one output asked for, answered as JSON numbers."""
    def body(texts: list[str]) -> dict[str, Any]:
        return {"inputs": [{"name": "TEXT", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}],
                "outputs": [{"name": output}]}

    def vectors(answer: dict[str, Any]) -> np.ndarray:
        out = next(o for o in answer["outputs"] if o["name"] == output)
        return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])
    return Embedder(name, precision, f"http://{server.http_url}/v2/models/{model}/infer", body, vectors,
                    server.rss_bytes)


def front_embedder(name: str, precision: str, front: ApiFront, model: str) -> Embedder:
    """The deployment through the API front: OpenAI's /v1/embeddings, base64 vectors as the openai client asks."""
    def vectors(answer: dict[str, Any]) -> np.ndarray:
        return np.stack([np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in answer["data"]])

    def rss() -> int:
        return tree_rss(front.process.pid) if front.process else 0
    return Embedder(name, precision, f"{front.url}/v1/embeddings",
                    lambda texts: {"model": model, "input": texts, "encoding_format": "base64"}, vectors, rss)


def infinity_embedder(name: str, precision: str, server: InfinityServer) -> Embedder:
    """infinity's OpenAI-style /embeddings."""
    def vectors(answer: dict[str, Any]) -> np.ndarray:
        return np.asarray([item["embedding"] for item in answer["data"]], dtype=np.float32)
    return Embedder(name, precision, f"{server.url}/embeddings", lambda texts: {"model": ".", "input": texts},
                    vectors, server.rss_bytes)


def triton_reranker(name: str, precision: str, server: TritonServer, model: str) -> Embedder:
    """The served reranker over Triton's KServe v2 JSON: the query and its documents as BYTES tensors, the scores
    asked for."""
    def body(texts: list[str]) -> dict[str, Any]:
        return {"inputs": [{"name": "QUERY", "shape": [1], "datatype": "BYTES", "data": texts[:1]},
                           {"name": "DOCUMENTS", "shape": [len(texts) - 1], "datatype": "BYTES", "data": texts[1:]}],
                "outputs": [{"name": "scores"}]}

    def scores(answer: dict[str, Any]) -> np.ndarray:
        return np.asarray(next(o for o in answer["outputs"] if o["name"] == "scores")["data"], dtype=np.float32)
    return Embedder(name, precision, f"http://{server.http_url}/v2/models/{model}/infer", body, scores,
                    server.rss_bytes)


def infinity_reranker(name: str, precision: str, server: InfinityServer) -> Embedder:
    """infinity's Cohere-style /rerank (sigmoid scores, as CrossEncoder.predict() gives one-label models), put back
    in the documents' order."""
    def scores(answer: dict[str, Any]) -> np.ndarray:
        found = np.zeros(len(answer["results"]), dtype=np.float32)
        for result in answer["results"]:
            found[result["index"]] = result["relevance_score"]
        return found
    return Embedder(name, precision, f"{server.url}/rerank", lambda texts: {
        "model": ".", "query": texts[0], "documents": texts[1:], "return_documents": False}, scores, server.rss_bytes)


def http_level(embedder: Embedder, texts: Sequence[str], concurrency: int, requests: int,
               seconds: float, documents: int = 0) -> ServedLevel:
    """One closed-loop level over HTTP JSON (each answer read and parsed, as a client would) of one-text requests,
    or of a query with `documents` documents each."""
    async def send(session: aiohttp.ClientSession, index: int) -> object:
        async with session.post(embedder.url, json=embedder.body(request_texts(texts, index, documents))) as response:
            response.raise_for_status()
            return await response.json()
    return closed_loop_level(aiohttp.ClientSession, send, concurrency, requests, seconds, embedder.url)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def embed_all(embedder: Embedder, texts: Sequence[str], batch: int = 16) -> np.ndarray:
    """Every text's vector from the server, `batch` texts a request."""
    return np.concatenate([embedder.vectors(_post(embedder.url, embedder.body(list(texts[start:start + batch]))))
                           for start in range(0, len(texts), batch)])


def rerank_all(embedder: Embedder, queries: Sequence[list[str]]) -> list[np.ndarray]:
    """Each request's (a query and its documents) scores from the server."""
    return [embedder.vectors(_post(embedder.url, embedder.body(texts))) for texts in queries]


def rerank_accuracy(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> dict[str, float]:
    """Against CrossEncoder.predict(): the largest score difference, and per query the documents' order (the same
    top document; Kendall tau, mean)."""
    ids, start = [], 0
    for scores in want:
        ids.append(list(range(start, start + len(scores))))
        start += len(scores)
    flat_got, flat_want = np.concatenate(got), np.concatenate(want)
    ranking = ranking_agreement(dict(enumerate(flat_got.tolist())), dict(enumerate(flat_want.tolist())), ids) or {}
    return {"max_abs": float(np.abs(flat_got - flat_want).max()), "kendall_tau": ranking.get("kendall_tau", 1.0),
            "same_top": round(ranking.get("agreement_at_1", 1.0) * len(want)), "texts": len(want)}


def accuracy(got: np.ndarray, want: np.ndarray) -> dict[str, float]:
    """Against encode(): cosine per text (min, mean), and how many texts keep encode()'s nearest neighbour."""
    cosines = cosine(got.astype(np.float64), want.astype(np.float64))
    agreement = retrieval_agreement(got, want)
    same = round(agreement["agreement_at_1"] * len(want)) if agreement else len(want)
    return {"min_cosine": float(cosines.min()), "mean_cosine": float(cosines.mean()), "same_neighbour": same,
            "texts": len(want)}


class Encoder(Protocol):
    def encode(self, sentences: list[str], batch_size: int) -> np.ndarray: ...


def encode_rates(model: Encoder, texts: Sequence[str], sizes: Sequence[int] = (1, 8, 32, 64),
                 passes: int = 2) -> dict[str, Any]:
    """`SentenceTransformer.encode()` in process, the baseline everyone knows: texts/s over all `texts` per batch
    size (the best of `passes`), the best size, and the median one-text call in ms."""
    rates: dict[str, float] = {}
    calls: list[float] = []
    model.encode(list(texts[:8]), batch_size=8)  # warm-up
    for size in sizes:
        best = float("inf")
        for _ in range(passes):
            start = time.perf_counter()
            if size == 1:
                for text in texts:
                    begin = time.perf_counter()
                    model.encode([text], batch_size=1)
                    calls.append(time.perf_counter() - begin)
            else:
                model.encode(list(texts), batch_size=size)
            best = min(best, time.perf_counter() - start)
        rates[str(size)] = len(texts) / best
    top = max(rates, key=lambda size: rates[size])
    return {"texts_per_s": rates, "best_batch": int(top), "p50_ms": float(np.median(calls)) * 1e3}


@dataclass
class PeerRow:
    """One server's measurements: levels per concurrency (one per interleaved repeat), accuracy, memory."""

    name: str
    precision: str
    levels: dict[int, list[ServedLevel]] = field(default_factory=dict)
    accuracy: dict[str, float] = field(default_factory=dict)
    rss_bytes: int = 0

    def median(self, concurrency: int, what: str) -> float:
        return statistics.median(getattr(level, what) for level in self.levels[concurrency])

    def spread(self, concurrency: int, what: str) -> tuple[float, float]:
        values = [getattr(level, what) for level in self.levels[concurrency]]
        return min(values), max(values)

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "precision": self.precision, "accuracy": self.accuracy,
                "rss_bytes": self.rss_bytes,
                "levels": {str(c): [level.recorded() for level in runs] for c, runs in self.levels.items()}}


def cell(row: PeerRow, concurrency: int) -> str:
    """'req/s / p50 ms / p99 ms' (medians over repeats), with the req/s range over repeats when there are several."""
    if concurrency not in row.levels:
        return "-"
    rate = f"{row.median(concurrency, 'throughput'):.0f}"
    if len(row.levels[concurrency]) > 1:
        low, high = row.spread(concurrency, "throughput")
        rate += f" ({low:.0f}-{high:.0f})"
    return f"{rate} / {row.median(concurrency, 'p50'):.1f} / {row.median(concurrency, 'p99'):.0f}"


def _quality(acc: dict[str, float]) -> tuple[str, str]:
    """The accuracy columns of a row: an embedder's against encode(), a reranker's against predict()."""
    if not acc:
        return "-", "-"
    if "kendall_tau" in acc:
        return f"{acc['max_abs']:.2e} / {acc['kendall_tau']:.4f}", f"{acc['same_top']} of {acc['texts']}"
    return f"{acc['min_cosine']:.4f} / {acc['mean_cosine']:.4f}", f"{acc['same_neighbour']} of {acc['texts']}"


def table(rows: Sequence[PeerRow], levels: Sequence[int]) -> str:
    """The side-by-side table, markdown: req/s (range over repeats) / p50 ms / p99 ms per concurrency, accuracy
    against the library (embedders: cosine and nearest neighbour; rerankers: max abs, Kendall tau and top
    document), resident memory of the server's process tree."""
    reranks = any("kendall_tau" in row.accuracy for row in rows)
    quality_head = ["max abs / Kendall tau", "same top document"] if reranks else ["min / mean cosine",
                                                                                    "same neighbour"]
    head = ["server", "precision", *(f"c={c}" for c in levels), *quality_head, "RSS MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        quality, same = _quality(row.accuracy)
        rss = f"{row.rss_bytes / 2**20:.0f}" if row.rss_bytes else "-"
        lines.append("| " + " | ".join([row.name, row.precision, *(cell(row, c) for c in levels), quality, same,
                                        rss]) + " |")
    return "\n".join(lines)


def lead(ours: PeerRow, theirs: PeerRow, levels: Sequence[int]) -> dict[int, float]:
    """Our median throughput over theirs per concurrency (both measured in the same repeats)."""
    return {c: ours.median(c, "throughput") / theirs.median(c, "throughput") for c in levels
            if c in ours.levels and c in theirs.levels}

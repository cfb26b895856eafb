"""The workbench's ONNX graphs beside Optimum's and OpenVINO's of the same model, in one process: one set of
real-text cells, interleaved rounds, every ONNX graph in the same ONNX Runtime with the same session settings and
every OpenVINO IR compiled for the same number of threads. PyTorch eager (what users run today) is timed in phases of
its own as the speedup's reference. benchmarks/graphs.py runs it, the timing part in the OpenVINO environment's
Python (benchmarks/peer_timing.py); the checks and the table are in `graph_checks`."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from workbench.core.errors import WorkbenchError
from workbench.runners.onnxruntime import SessionSettings, session
from workbench.runners.timing import cell_medians_ms

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

CPU = ["CPUExecutionProvider"]
Runtime = Literal["onnxruntime", "openvino"]
Feed = dict[str, np.ndarray]
SENTENCE = "sentence_embedding"  # a workbench graph's pooled output; a peer's graph answers per-token states


@dataclass
class GraphRow:
    """One graph: who built it (`family`: workbench, optimum or openvino), its precision class, its file, the
    runtime that runs it and the output its users read. `hint`: the inference precision OpenVINO is asked for (None:
    its default on the host); `computed_in`: what it computed in, once opened. `problem`: why the graph could not be
    built or run (its cells stay empty)."""

    name: str
    family: str
    precision: str
    path: Path
    output: str
    runtime: Runtime = "onnxruntime"
    hint: str | None = None
    computed_in: str | None = None
    problem: str | None = None
    ms: dict[str, float] = field(default_factory=dict)  # cell -> median ms
    accuracy: dict[str, float] = field(default_factory=dict)

    def record(self) -> dict[str, object]:
        return {"name": self.name, "family": self.family, "precision": self.precision, "path": str(self.path),
                "output": self.output, "runtime": self.runtime, "hint": self.hint, "computed_in": self.computed_in,
                "problem": self.problem,
                "ms": self.ms, "accuracy": self.accuracy}

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> GraphRow:
        return cls(**{**data, "path": Path(data["path"])})


@dataclass(frozen=True)
class OpenedGraph:
    """A graph ready to call: the inputs it takes, and a call on a feed holding exactly those that returns its
    output; `inference_precision` says what the runtime computes in (ONNX Runtime: the file's own types)."""

    inputs: tuple[str, ...]
    run: Callable[[Feed], np.ndarray]
    inference_precision: str = "as stored"  # OpenVINO: its element type name (f32, bf16, f16)


def open_onnx(row: GraphRow, threads: int) -> OpenedGraph:
    """A CPU session with the workbench's settings (threads that sleep when idle, every graph optimization; a
    workbench file's own disabled optimizers)."""
    opened = session(row.path, CPU, settings=SessionSettings(threads))
    return OpenedGraph(tuple(i.name for i in opened.get_inputs()), lambda feed: opened.run([row.output], feed)[0])


def open_openvino(row: GraphRow, threads: int) -> OpenedGraph:
    """The IR compiled for OpenVINO's CPU plugin with `threads` inference threads and one stream (latency), at
    `row.hint` or the plugin's default inference precision on this host; the workbench's own graph as it is served
    (`runners.openvino.compile_graph`: its settings, the file's inference precision); one infer request, reused."""
    import openvino

    from workbench.runners.openvino import compile_graph

    if row.family == "workbench":
        compiled = compile_graph(row.path, threads)
    else:
        config = {"NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads,
                  **({"INFERENCE_PRECISION_HINT": row.hint} if row.hint else {})}
        compiled = openvino.Core().compile_model(str(row.path), "CPU", config)
    request = compiled.create_infer_request()
    port = next(p for p in compiled.outputs if row.output in p.get_names())
    return OpenedGraph(tuple(p.get_any_name() for p in compiled.inputs), lambda feed: request.infer(feed)[port],
                       compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name())


def open_graphs(rows: Sequence[GraphRow], threads: int) -> dict[str, OpenedGraph]:
    """Every row without a problem opened; one that its runtime refuses gets the refusal as its problem."""
    openers = {"onnxruntime": open_onnx, "openvino": open_openvino}
    opened = {}
    for row in rows:
        if row.problem is None:
            try:
                opened[row.name] = openers[row.runtime](row, threads)
            except (WorkbenchError, RuntimeError) as exc:  # ONNX Runtime's and OpenVINO's refusals: the row says why
                row.problem = f"{row.runtime} could not load it: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    return opened


def own_inputs(graph: OpenedGraph, feed: Feed) -> Feed:
    return {name: feed[name] for name in graph.inputs}


def time_graphs(rows: Sequence[GraphRow], opened: dict[str, OpenedGraph], feeds: dict[str, Feed], rounds: int,
                block: int = 3) -> dict[str, dict[str, float]]:
    """Median ms of one call of each opened graph per cell into `row.ms`: all interleaved, rotating, per cell. The
    medians by opened name (an A/A control's second copy included)."""
    def calls(cell: str) -> dict[str, Callable[[], object]]:
        return {name: (lambda g=graph, f=own_inputs(graph, feeds[cell]): g.run(f)) for name, graph in opened.items()}
    medians = cell_medians_ms(calls, list(feeds), rounds, warmup=2, block=block)
    for row in rows:
        if row.name in medians:
            row.ms = medians[row.name]
    return medians


def again(name: str) -> str:
    """The name of a graph's second copy, opened as an A/A control."""
    return f"{name} (opened again)"


def open_control(rows: Sequence[GraphRow], opened: dict[str, OpenedGraph], threads: int) -> str | None:
    """A second copy of one opened graph (an OpenVINO one where the class has any: their pairs differ the most),
    added to `opened` under `again(name)`: the same file timed twice, whose ratio is this run's noise. The graph's
    name, or None where nothing is open or the copy does not open."""
    ready = [row for row in rows if row.name in opened]
    if not ready:
        return None
    row = next((row for row in ready if row.runtime == "openvino"), ready[0])
    copy = replace(row, name=again(row.name), problem=None)
    opened.update(open_graphs([copy], threads))
    return row.name if copy.name in opened else None


def control_spread(medians: dict[str, dict[str, float]], name: str) -> dict[str, float]:
    """Per cell, the slower over the faster median of a graph and its second copy (1.0: no noise)."""
    first, second = medians[name], medians[again(name)]
    return {cell: round(max(first[cell], second[cell]) / min(first[cell], second[cell]), 4) for cell in first}


def outputs(graph: OpenedGraph, batches: Sequence[Feed]) -> list[np.ndarray]:
    """The graph's output for each batch (float32)."""
    return [np.asarray(graph.run(own_inputs(graph, batch)), dtype=np.float32) for batch in batches]


def library_pooled(library: SentenceTransformer, hidden: np.ndarray, feed: Feed) -> np.ndarray:
    """A per-token output made a sentence embedding as sentence-transformers makes it: the library's own modules
    after its transformer (pooling, dense layers, normalization), as its ONNX and OpenVINO backends do."""
    import torch

    features: dict[str, torch.Tensor] = {name: torch.from_numpy(array) for name, array in feed.items()}
    features["token_embeddings"] = torch.from_numpy(hidden)
    with torch.inference_mode():
        for module in list(library)[1:]:
            features = module(features)
    return features[SENTENCE].numpy()


def embeddings(row: GraphRow, found: Sequence[np.ndarray], batches: Sequence[Feed],
               library: SentenceTransformer) -> np.ndarray:
    """Every text's sentence embedding from `row`'s outputs on `batches` (a per-token output pooled by the
    library's modules, outside any timed call)."""
    if row.output == SENTENCE:
        return np.concatenate(found)
    return np.concatenate([library_pooled(library, hidden, batch) for hidden, batch in zip(found, batches)])

"""The results contract: each step's metrics (run.json `metrics.<step>`) as a pydantic model, and the migration of
records an older workbench wrote. The fields other modules read are typed; what else a step records (tables of
measurements, diagnostics) is kept as recorded. A step writes its section as it goes and the record validates the
whole section through the step's model when the step finishes (`StepSpec.metrics`)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from workbench.core.flavor import Flavor

SCHEMA_VERSION = 2
Json = dict[str, Any]  # a nested table as recorded (measurement cells, per-text diagnostics)


class Metrics(BaseModel):
    """A step's metrics; fields not declared are kept as recorded."""

    model_config = ConfigDict(extra="allow")

    def recorded(self) -> Json:
        """The metrics as run.json holds them (no defaults filled in; non-finite errors stay non-finite)."""
        return self.model_dump(exclude_unset=True)


class OutputResult(Metrics):
    """One output's parity: its verdict and headline errors (the full statistics are kept as recorded)."""

    passed: bool
    max_abs: float | None = None
    min_cosine: float | None = None
    agreement: float | None = None
    failures: list[str] = Field(default_factory=list)
    tolerance: dict[str, float | int] = Field(default_factory=dict)
    retrieval: dict[str, float | int] | None = None  # neighbour agreement over the corpus (embedding outputs)
    ranking: dict[str, float | int] | None = None  # each query's document order (a reranker's scores)


class Verdict(Metrics):
    """A variant's or engine's parity against the reference: pass/fail, how far past the gate, per output."""

    passed: bool
    violation: float = 0.0
    failures: list[str] = Field(default_factory=list)
    precision: str | None = None
    outputs: dict[str, OutputResult] = Field(default_factory=dict)

    @property
    def retrieval(self) -> dict[str, float | int] | None:
        """The neighbour agreement of its embedding output, if one recorded it."""
        return next((o.retrieval for o in self.outputs.values() if o.retrieval), None)


class RepairCandidate(Metrics):
    """A candidate (or recipe) of a repair: the nodes it keeps in fp32 and its verdict on the checked batches."""

    blocked: list[str] = Field(default_factory=list)
    passed: bool
    violation: float = 0.0
    latency_ms: float | None = None
    min_cosine: float | None = None
    max_abs: float | None = None


class RepairOutcome(Metrics):
    """A precision repair: what it found (`chosen`), from what (`before`, `base`) and every candidate tried."""

    precision: str
    outcome: str
    units: int
    budget_s: float | None = None  # the repair's seconds (older records: not bounded)
    seconds: float | None = None  # what the whole repair took
    stopped: str | None = None  # the bound that ended the search early (its best passed, or nothing was written)
    chosen: RepairCandidate | None = None
    before: RepairCandidate | None = None
    base: str | None = None
    candidates: list[Json] = Field(default_factory=list)
    bases: list[Json] = Field(default_factory=list)
    recipes: list[Json] = Field(default_factory=list)
    node_error: Json = Field(default_factory=dict)
    race: Json | None = None  # a repaired OpenVINO int8 timed against the variant served after it (older: none)


class GraphIO(Metrics):
    """The exported graph's inputs and outputs with their axes (names for dynamic ones, sizes for fixed ones)."""

    inputs: dict[str, list[str | int]]
    outputs: dict[str, list[str | int]]


class ExportMetrics(Metrics):
    architecture: str
    optimizer_model_type: str | None = None
    num_heads: int
    num_layers: int
    hidden_size: int
    intermediate_size: int
    max_sequence: int
    max_sequence_source: str | None = None  # where the model's limit comes from (older records: not recorded)
    sequence: Json | None = None  # the run's tokens per text, resolved (min, opt, max) with their `sources`
    nodes: int | None = None
    io: GraphIO
    sentence_pipeline: Json | None = None
    parameters: int | None = None
    opset: int | None = None


class PrecisionDecision(Metrics):
    """Whether the optimize step built a reduced precision, why, and whether it pays against fp32 (measured here,
    else assumed from the target's instructions; None: neither); the serving order follows it."""

    built: bool = False
    reason: str = ""
    pays: bool | None = None
    speedups: dict[str, float] = Field(default_factory=dict)  # goal cell -> fp32 ms / variant ms


class PrecisionChoice(Metrics):
    """The run's precision setting, its deployment target, and the decision per reduced precision."""

    setting: list[str] | str | None = None
    target: Json | None = None
    decisions: dict[str, PrecisionDecision] = Field(default_factory=dict)


class OptimizeMetrics(Metrics):
    variants: dict[str, Json] = Field(default_factory=dict)
    precisions: PrecisionChoice | None = None  # (older runs: none)
    openvino: Json | None = None  # the OpenVINO variant: tried or why not, its check and timing, kept (older: none)
    openvino_bf16: Json | None = None  # the exported graph run by OpenVINO in bf16: tried or why not, kept
    openvino_int8: Json | None = None  # NNCF's int8 run by OpenVINO: tried or why not, its timing, kept (older: none)

    def decision(self, precision: str) -> PrecisionDecision | None:
        """The decision on `precision` (None: the run recorded none)."""
        return self.precisions.decisions.get(precision) if self.precisions else None


class ParityMetrics(Metrics):
    reference: Json | None = None
    inputs: Json | None = None
    variants: dict[str, Verdict] = Field(default_factory=dict)
    repair: dict[str, RepairOutcome] = Field(default_factory=dict)


class TritonMetrics(Metrics):
    """What the triton step deployed and how it checked it (`plan`: the serving plan, `ServingPlan.record()`)."""

    name: str | None = None
    flavor: Flavor | None = None
    layout: str = "ensemble"
    variant: str | None = None
    verified: bool = False
    plan: Json | None = None
    served_parity: dict[str, Verdict] | None = None  # None: not checked (the step stopped before serving)
    prompt_parity: dict[str, Verdict] = Field(default_factory=dict)
    served_library: str | None = None
    served_reference: str | None = None
    verification: Json | None = None  # how it was verified: by what, the variants passed over and why
    cut: Json | None = None  # texts past the deployment's token limit, checked against the library's own cut
    replaced: str | None = None  # the run whose deployment of the same name this one replaced


class TensorrtMetrics(Metrics):
    """The shape profiles designed from the corpus (the triton step serves them), and each engine's check against
    PyTorch (on a GPU)."""

    profiles: list[Json] = Field(default_factory=list)
    parity: dict[str, Verdict] = Field(default_factory=dict)


class CellTiming(Metrics):
    """One row of the latency grid at one cell: percentiles and mean (ms), throughput, the speedup over its device's
    PyTorch row (`baseline`; None where it has none), GFLOP/s and their share of the matmul peak."""

    p50: float
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    mean: float | None = None
    rounds: int | None = None
    sequences_per_s: float | None = None
    tokens_per_s: float | None = None
    baseline: str | None = None
    speedup: float | None = None
    gflops: float | None = None
    peak_share: float | None = None


class GridRunner(Metrics):
    """What a row of the grid ran (`Runner.describe`): its label, device, precision, providers, I/O; whether it is a
    PyTorch reference, the variant it times, its peak device memory (CUDA) and, for a row only the bench checks
    (torch.compile, PyTorch fp16), its parity verdict."""

    label: str
    device: str = "cpu"
    precision: str = "fp32"
    providers: list[str] = Field(default_factory=list)
    io: str = "host"
    reference: bool = False
    variant: str | None = None
    peak_memory_mb: float | None = None
    parity: Verdict | None = None


class BestRow(Metrics):
    variant: str
    speedup: float


class LatencyGrid(Metrics):
    """The in-process grid (`measure.latency.measure_grid`): per cell (`Cell.key`) and row its timing, the rows,
    which passed parity, the session settings chosen, matmul peaks per precision, signs of disturbance."""

    threads: int | None = None
    device: str = "cpu"
    cells: dict[str, dict[str, CellTiming]] = Field(default_factory=dict)
    flops: dict[str, float] = Field(default_factory=dict)
    passed: dict[str, bool] = Field(default_factory=dict)
    runners: dict[str, GridRunner] = Field(default_factory=dict)
    sessions: dict[str, Json] = Field(default_factory=dict)
    cuda_graph: dict[str, dict[str, str]] = Field(default_factory=dict)
    disturbed: list[str] = Field(default_factory=list)
    best: dict[str, BestRow] = Field(default_factory=dict)
    peaks: dict[str, float] = Field(default_factory=dict)
    seconds: float | None = None

    def rows(self) -> list[str]:
        """Every row timed in some cell, in the order first timed (CUDA-graph rows exist per cell)."""
        return list(dict.fromkeys(name for cell in self.cells.values() for name in cell))

    def label(self, name: str) -> str:
        """A row as a table names it: "PyTorch eager fp32 · cuda · on device" (its name in older runs)."""
        runner = self.runners.get(name)
        return runner.label if runner else name


class BenchMetrics(Metrics):
    host: Json | None = None
    latency: LatencyGrid | None = None
    served: Json | None = None

    def disturbed(self) -> list[str]:
        """Signs that other work on the host disturbed the in-process grid (none: it looked quiet)."""
        return list(self.latency.disturbed) if self.latency else []


def migrate(data: Json) -> Json:
    """A run record as this schema has it, from any earlier one (in place; returns it). Version 1 (before typed
    results): the bench grid's fp32 peak was `peak_gflops` beside (or, before per-precision peaks, without)
    `peaks`; it is `peaks.fp32` now."""
    if data.get("schema", 1) < 2:
        latency = data.get("metrics", {}).get("bench", {}).get("latency")
        if isinstance(latency, dict) and "peak_gflops" in latency:
            latency.setdefault("peaks", {"fp32": latency["peak_gflops"]})
            del latency["peak_gflops"]
        data["schema"] = 2
    return data

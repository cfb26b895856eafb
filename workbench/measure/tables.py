"""What the bench step measured (run.json `metrics.bench`): the in-process latency grid (per cell and row its timing)
and the served benchmark (levels of load per batching setting, the batching search, efficiency against in process),
with the host's load when measuring began."""
from __future__ import annotations

from pydantic import Field

from workbench.core.metrics import Json, Metrics
from workbench.core.results import Verdict


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


class SessionTuning(Metrics):
    """One variant's session settings as `measure.sessions.tune` chose them: the device, the settings chosen
    (`SessionSettings.record()`) and why, the head-to-head medians at the smallest and largest cell, every
    candidate's screening median; on the CPU the spinning gain (measured, never applied), on CUDA what I/O binding
    gains over numpy in and out."""

    device: str = "cpu"
    chosen: Json = Field(default_factory=dict)
    reason: str = ""
    head_to_head: list[Json] = Field(default_factory=list)
    screen: list[Json] = Field(default_factory=list)
    spinning_gain: float | None = None
    io_binding_gain: float | None = None


class LatencyGrid(Metrics):
    """The in-process grid (`measure.latency.measure_grid`): per cell (`Cell.key`) and row its timing, the rows,
    which passed parity, the session settings chosen, matmul peaks per precision, signs of disturbance."""

    threads: int | None = None
    device: str = "cpu"
    cells: dict[str, dict[str, CellTiming]] = Field(default_factory=dict)
    flops: dict[str, float] = Field(default_factory=dict)
    passed: dict[str, bool] = Field(default_factory=dict)
    runners: dict[str, GridRunner] = Field(default_factory=dict)
    sessions: dict[str, SessionTuning] = Field(default_factory=dict)
    cuda_graph: dict[str, dict[str, str]] = Field(default_factory=dict)
    others_busy: float | None = None  # cores other work kept busy while the grid ran (older runs: not measured)
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


class ServedLevel(Metrics):
    """One level of load: requests answered and failed, client-side throughput (requests/s) and latency (ms);
    Triton's mean ms per request per stage and the Python models' own stages, per model; a reranker's pairs/s."""

    concurrency: int
    requests: int
    errors: int = 0
    seconds: float
    throughput: float
    p50: float
    p90: float
    p95: float
    p99: float
    mean: float
    server: dict[str, dict[str, float]] = Field(default_factory=dict)
    model_stages: dict[str, dict[str, float]] = Field(default_factory=dict)
    tool: str | None = None  # the generator that measured it, where not the sweep's own (no stable window)
    note: str | None = None
    documents: int | None = None
    pairs_per_s: float | None = None


Levels = dict[str, ServedLevel]  # concurrency (as text) -> level


class BatchingSweeps(Metrics):
    """The sweeps on one batching setting: text over gRPC, the deployment over HTTP, and where tokenization runs
    (token ids from the client against text, both through the asyncio generator)."""

    text: Levels = Field(default_factory=dict)
    text_http: Levels = Field(default_factory=dict)
    text_asyncio: Levels = Field(default_factory=dict)
    client_tokenization: Levels = Field(default_factory=dict)


class SearchCandidate(ServedLevel):
    """A batching setting tried by the search, measured at the search's concurrency."""

    max_queue_delay_us: int
    instances: int
    preferred_batch_sizes: list[int] = Field(default_factory=list)


class BatchingSearch(Metrics):
    """The settings tried at one concurrency and the one with the highest throughput whose p99 stays under the
    limit (None: none did)."""

    concurrency: int
    p99_limit_ms: float
    candidates: list[SearchCandidate] = Field(default_factory=list)
    chosen: SearchCandidate | None = None


class InProcessRates(Metrics):
    """The served variant in process on the served texts: sequences/s per batch size (as text), the best size, and
    the median call at batch size 1 (ms)."""

    sequences_per_s: dict[str, float]
    best_batch: int
    p50_ms: float | None = None

    @property
    def best(self) -> float:
        return self.sequences_per_s[str(self.best_batch)]


class Efficiency(Metrics):
    """Served over in process on the same texts: throughput at the top concurrency per batching setting, and p50 at
    concurrency 1 (None: not measured there)."""

    concurrency: int
    in_process: InProcessRates
    throughput_ratio: dict[str, float]
    p50_ratio_c1: float | None = None


class MeasuredPlan(Metrics):
    """The deployment the sweeps measured."""

    flavor: str | None = None
    layout: str = "ensemble"
    max_batch_size: int | None = None
    instances: int | None = None
    threads: int | None = None
    why: str | None = None


class InstanceMemory(Metrics):
    """What one served model instance holds after the load: its proportional set size (its own memory and its share
    of what it maps with the other instances) beside its model's weights on disk."""

    instance: str
    pss_mib: float
    weights_mib: float


class ServedBenchmark(Metrics):
    """Everything under metrics.bench.served, or why it was not measured (`skipped`)."""

    skipped: str | None = None
    tool: str | None = None
    protocol: str = "http"  # records from before the sweeps ran over gRPC measured over HTTP
    levels: list[int] = Field(default_factory=list)
    variant_plan: MeasuredPlan = Field(default_factory=MeasuredPlan)
    batching_off: BatchingSweeps | None = None
    batching_on: BatchingSweeps | None = None
    layouts: dict[str, Levels] = Field(default_factory=dict)
    search: BatchingSearch | None = None
    efficiency: Efficiency | None = None
    rerank: dict[str, Levels] | None = None  # a reranker: documents per request ("n16") -> "c<concurrency>" -> level
    memory: list[InstanceMemory] = Field(default_factory=list)  # the deployment's instances, after its load
    variant: str | None = None
    verified: bool | None = None
    seconds: float | None = None

    def sweeps(self) -> dict[str, BatchingSweeps]:
        """The sweeps per batching setting measured ("batching_off", "batching_on")."""
        found = {"batching_off": self.batching_off, "batching_on": self.batching_on}
        return {label: sweeps for label, sweeps in found.items() if sweeps is not None}

    def best_level(self, p99_limit_ms: float) -> tuple[int, ServedLevel] | None:
        """The deployed configuration's level (batching on, text in) with the highest throughput whose p99 stays
        under the limit and that answered every request."""
        levels = self.batching_on.text if self.batching_on else {}
        within = [(int(c), level) for c, level in levels.items() if level.p99 <= p99_limit_ms and not level.errors]
        return max(within, key=lambda item: item[1].throughput, default=None)


class HostLoad(Metrics):
    """The host when the bench began: its cores and the other work keeping them busy (cores' worth; older runs
    recorded the load average, which counts the run's own earlier steps)."""

    cpu_count: int | None = None
    busy_before: float | None = None
    load_before: float | None = None


class BenchMetrics(Metrics):
    host: HostLoad | None = None
    latency: LatencyGrid | None = None
    served: ServedBenchmark | None = None

    def disturbed(self) -> list[str]:
        """Signs that other work on the host disturbed the in-process grid (none: it looked quiet)."""
        return list(self.latency.disturbed) if self.latency else []

"""The contracts in run.json that every room reads: the host and the parity verdict; and the migration of records an
older workbench wrote. A step's tables live in the room that produces them (`graphs.tables`: export's, optimize's
and tensorrt's; `precision.tables`: parity's; `serving.tables`: triton's; `measure.tables`: bench's; a step's own
module: the rest). Every key a step records is declared (diagnostics too, as untyped `Json` where they are nested
tables); the record validates a step's section through its model (`StepSpec.metrics`)."""
from __future__ import annotations

from pydantic import Field

from workbench.core.config import SequenceSetting
from workbench.core.metrics import Json, Metrics, declared_only

SCHEMA_VERSION = 4


class CpuFeatures(Metrics):
    """The speed-relevant flags of a CPU and its best int8 dot-product instructions (`machine.cpu_features`)."""

    flags: list[str] = Field(default_factory=list)
    int8_dot_product: str | None = None


class OrtEnvironment(Metrics):
    """ONNX Runtime on the host: its providers, and those the run's sessions used."""

    available_providers: list[str] = Field(default_factory=list)
    providers_used: list[str] = Field(default_factory=list)


class NodeInfo(Metrics):
    """The cluster node a sweep cell measured on (`workbench sweep --ray`): Ray's node id, its address, the host
    kind it advertised, and whether that kind was told (`workbench node start --kind`) rather than read from its
    flags."""

    id: str
    address: str
    kind: str
    told: bool = False


class HostEnvironment(Metrics):
    """The machine a run ran on (`machine.collect_environment`); runs recorded before the CPU features were have
    none."""

    python: str = ""
    platform: str = ""
    cpu: str = ""
    cpu_count: int | None = None
    cpu_features: CpuFeatures | None = None
    gpu: str | None = None
    packages: dict[str, str] = Field(default_factory=dict)
    onnxruntime: OrtEnvironment | None = None  # None: not installed
    node: NodeInfo | None = None  # the cluster node, for a sweep cell run on one

    @property
    def int8_dot_product(self) -> str | None:
        return self.cpu_features.int8_dot_product if self.cpu_features else None


class WorstValue(Metrics):
    """The value an output got most wrong: its batch, row, text, position in the output, both values, the error."""

    batch: str | None = None
    row: int | None = None
    text_id: int | None = None
    position: list[int] = Field(default_factory=list)
    got: float | None = None
    want: float | None = None
    abs_error: float = 0.0


class OutputResult(Metrics):
    """One output's parity: its verdict, errors, cosine or label agreement, and neighbour or document order."""

    passed: bool = False
    kind: str | None = None  # the output's kind (embedding, hidden, logits, scores, ...)
    max_abs: float | None = None
    mean_abs: float | None = None
    max_rel: float | None = None
    quantiles: dict[str, float] = Field(default_factory=dict)  # absolute error at each quantile ("p50", ...)
    non_finite: int = 0
    compared_values: int | None = None
    worst: WorstValue = Field(default_factory=WorstValue)
    tolerance: dict[str, float | int] = Field(default_factory=dict)
    loss: float | None = None  # what the repair minimises: 1 - mean cosine, else the mean absolute error
    min_cosine: float | None = None
    mean_cosine: float | None = None
    agreement: float | None = None
    max_prob_shift: float | None = None
    retrieval: dict[str, float | int] | None = None  # neighbour agreement over the corpus (embedding outputs)
    ranking: dict[str, float | int] | None = None  # each query's document order (a reranker's scores)
    sparse: dict[str, float | int] | None = None  # active terms and dot products (a sparse embedding)
    failures: list[str] = Field(default_factory=list)
    violation: float = 0.0  # how far past its gate (0 where it passes)
    gated: bool = True  # whether it decides the variant's verdict: the deployment serves it

    @property
    def order(self) -> dict[str, float | int]:
        """The neighbour, document-order or term metrics: retrieval for embeddings, ranking for rerankers, sparse for
        sparse embeddings."""
        return self.retrieval or self.ranking or self.sparse or {}


class WorstText(Metrics):
    """A text a variant got most wrong: its corpus id, the text (shortened), the per-text metric and its value."""

    text_id: int
    text: str
    metric: str
    error: float
    max_abs: float | None = None
    min_cosine: float | None = None


class Verdict(Metrics):
    """A variant's or engine's parity against the reference: pass/fail and how far past the gate on the outputs that
    gate (those served), per output; `ungated`: what the other outputs missed, measured and shown only."""

    passed: bool
    violation: float = 0.0
    failures: list[str] = Field(default_factory=list)
    ungated: list[str] = Field(default_factory=list)
    precision: str | None = None
    seconds: float | None = None  # the check's time (on the lab)
    outputs: dict[str, OutputResult] = Field(default_factory=dict)
    worst_texts: list[WorstText] = Field(default_factory=list)
    providers: list[str] = Field(default_factory=list)  # what ran the variant (ONNX Runtime's providers, ...)

    @property
    def primary(self) -> str:
        """The output users read: the embedding, else the first."""
        return next((n for n, o in self.outputs.items() if o.kind == "embedding"), next(iter(self.outputs), ""))

    @property
    def gated_on(self) -> list[str]:
        """The outputs that decided the verdict."""
        return [name for name, output in self.outputs.items() if output.gated]

    @property
    def retrieval(self) -> dict[str, float | int] | None:
        """The neighbour agreement of its embedding output, if one recorded it."""
        return next((o.retrieval for o in self.outputs.values() if o.retrieval), None)


def migrate(data: Json, models: dict[str, type[Metrics]]) -> Json:
    """A run record as this schema has it, from any earlier one (in place; returns it); `models`: each step's
    metrics model. Version 1 (before typed results): the bench grid's fp32 peak was `peak_gflops` beside (or, before
    per-precision peaks, without) `peaks`; it is `peaks.fp32` now. Version 2: an export without its resolved
    `sequence` gets the one its configuration resolves to (later steps read it, not the setting). Version 3: the
    models kept keys they did not declare; those are dropped (`declared_only`), since the models refuse them now."""
    if data.get("schema", 1) < 2:
        latency = data.get("metrics", {}).get("bench", {}).get("latency")
        if isinstance(latency, dict) and "peak_gflops" in latency:
            latency.setdefault("peaks", {"fp32": latency["peak_gflops"]})
            del latency["peak_gflops"]
        data["schema"] = 2
    if data["schema"] < 3:
        export = data.get("metrics", {}).get("export")
        if isinstance(export, dict) and "max_sequence" in export and not export.get("sequence"):
            setting = SequenceSetting.model_validate(data.get("config", {}).get("sequence") or {})
            export["sequence"] = setting.resolve(export["max_sequence"]).model_dump()
        data["schema"] = 3
    if data["schema"] < 4:
        metrics = data.get("metrics", {})
        for step, table in metrics.items():
            if step in models:
                metrics[step] = declared_only(models[step], table)
        if isinstance(data.get("environment"), dict):
            data["environment"] = declared_only(HostEnvironment, data["environment"])
        data["schema"] = 4
    return data

"""The contracts in run.json that several rooms read: the host, the shared verdict types, what export resolved and
what triton deployed; and the migration of records an older workbench wrote. A step's other tables live in the room
that produces them (`graphs.tables`: optimize's and tensorrt's; `precision.tables`: parity's; `measure.tables`:
bench's; a step's own module: the rest). Every key a step records is declared (diagnostics too, as untyped `Json`
where they are nested tables); the record validates a step's section through its model (`StepSpec.metrics`)."""
from __future__ import annotations

from pydantic import Field

from workbench.core.config import BatchRange, SequenceSetting, ShapeRange, activation_bytes_per_token
from workbench.core.flavor import Flavor
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


class GraphIO(Metrics):
    """The exported graph's inputs and outputs with their axes (names for dynamic ones, sizes for fixed ones)."""

    inputs: dict[str, list[str | int]]
    outputs: dict[str, list[str | int]]


class PipelineSummary(Metrics):
    """The sentence-transformers pipeline the exported graph runs, as run.json records it
    (`models.sentence.SentencePipeline.describe`)."""

    declared: bool = True  # from modules.json (False: what SentenceTransformer builds for a plain encoder)
    source: str = ""
    steps: list[str] = Field(default_factory=list)
    pooling: str | None = None
    declared_pooling: str | None = None
    normalize: bool | None = None
    dense_layers: int = 0
    max_seq_length: int | None = None
    prompts: dict[str, str] = Field(default_factory=dict)
    include_prompt: bool = True
    do_lower_case: bool = False
    default_prompt_name: str | None = None
    similarity: str = "cosine"
    truncate_dim: int | None = None  # the embedding's first values the graph returns (encode(truncate_dim=...))
    max_active_dims: int | None = None  # a sparse encoder's heaviest terms kept (encode(max_active_dims=...))
    override: str | None = None  # the pooling_override, said in words


class ResolvedSequence(Metrics):
    """The run's tokens per text as the export step resolved them once (`SequenceSetting.resolve`): later steps read
    this, never the setting again; where each value comes from."""

    min: int
    opt: int
    max: int
    sources: dict[str, str] = Field(default_factory=dict)

    def shape(self) -> ShapeRange:
        return ShapeRange(min=self.min, opt=self.opt, max=self.max)


class ModelOrigin(Metrics):
    """Where the exported model came from (`models.loading.ModelSource`)."""

    kind: str
    location: str


class ExportMetrics(Metrics):
    source: ModelOrigin | None = None
    task: str | None = None  # the task the graph was exported for (older records: not recorded)
    task_reason: str | None = None  # why: the task setting, or what `task: auto` read in the model's files
    architecture: str
    optimizer_model_type: str | None = None
    num_heads: int
    num_layers: int
    hidden_size: int
    intermediate_size: int
    max_positions: int | None = None
    max_sequence: int
    max_sequence_source: str | None = None  # where the model's limit comes from (older records: not recorded)
    sequence: ResolvedSequence | None = None  # None: a record made by a test without the export step
    nodes: int | None = None
    io: GraphIO
    sentence_pipeline: PipelineSummary | None = None
    parameters: int | None = None
    opset: int | None = None
    exporter: str | None = None
    load_seconds: float | None = None
    export_seconds: float | None = None

    @property
    def sequence_range(self) -> ShapeRange:
        """The run's resolved tokens per text (where none was recorded, the model's whole range, as auto gives)."""
        return self.sequence.shape() if self.sequence else SequenceSetting().resolve(self.max_sequence)

    def token_budget(self, batch: BatchRange, sequence_max: int) -> tuple[int, str]:
        """The padded tokens one of the run's batches may hold, and why (`BatchRange.token_budget` with this
        model's shape at `sequence_max`)."""
        from workbench.core.memory import activation_room

        per_token = activation_bytes_per_token(self.num_heads, self.hidden_size, self.intermediate_size, sequence_max)
        return batch.token_budget(per_token, sequence_max,
                                  activation_room(4 * self.parameters) if self.parameters else None)


class Verification(Metrics):
    """How the served variant was chosen: by which step's parity check (None: nobody, allow_unverified), in what
    order, the candidates the triton step checked itself, and those passed over with their failures."""

    variant: str
    by: str | None = None
    order: str = ""
    checked_here: dict[str, Verdict] = Field(default_factory=dict)
    passed_over: dict[str, list[str]] = Field(default_factory=dict)


class ServedCut(Metrics):
    """The deployment's token limit against the library's: texts within and past it, whether the texts past it were
    gated (both cut at the same length), and their comparison per protocol."""

    deployment: int
    library: int
    texts_within: int | None = None
    texts_beyond: int = 0
    gated: bool = False
    beyond: dict[str, Verdict] = Field(default_factory=dict)


class TritonMetrics(Metrics):
    """What the triton step deployed and how it checked it (`plan`: the serving plan, `ServingPlan.record()`)."""

    name: str | None = None
    flavor: Flavor | None = None
    layout: str = "ensemble"
    variant: str | None = None
    precision: str | None = None
    candidates: list[str] = Field(default_factory=list)  # the variants it could serve, best first (older: none)
    models: list[str] = Field(default_factory=list)
    max_batch_size: int | None = None
    pad_to: list[int] = Field(default_factory=list)
    repository: str | None = None  # where it is published (model_repository/<name>)
    published: bool = False
    verified: bool = False
    plan: Json | None = None
    server: str | None = None  # the tritonserver that served the check
    ready_seconds: float | None = None
    stop_seconds: float | None = None
    served_parity: dict[str, Verdict] | None = None  # None: not checked (the step stopped before serving)
    prompt_parity: dict[str, Verdict] = Field(default_factory=dict)
    served_passed: dict[str, bool] = Field(default_factory=dict)  # each check served: protocol, long texts, prompts
    served_library: str | None = None
    served_reference: str | None = None
    head: str | None = None  # a classifier's served head: the activation its score applies (softmax, sigmoid, none)
    verification: Verification | None = None
    cut: ServedCut | None = None  # texts past the deployment's token limit, checked against the library's own cut
    replaced: str | None = None  # the run whose deployment of the same name this one replaced
    burst: BatchingBurst | None = None  # the dynamic batcher watched (older runs, and rerankers: none)


class BatchingBurst(Metrics):
    """A burst of concurrent one-text requests and the batch sizes each model executed for it (size -> count)."""

    requests: int
    batch_sizes: dict[str, dict[int, int]]


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

"""The results contract: each step's metrics (run.json `metrics.<step>`) as a pydantic model (the bench step's
tables in `core.measured`), and the migration of records an older workbench wrote. Every key a step records is
declared (diagnostics too, as untyped `Json` where they are nested tables). A step writes its section as it goes and
the record validates the whole section through the step's model when the step finishes (`StepSpec.metrics`)."""
from __future__ import annotations

from typing import Literal

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
    failures: list[str] = Field(default_factory=list)
    violation: float = 0.0  # how far past its gate (0 where it passes)
    gated: bool = True  # whether it decides the variant's verdict: the deployment serves it

    @property
    def order(self) -> dict[str, float | int]:
        """The neighbour or document-order metrics: retrieval for embeddings, ranking for rerankers."""
        return self.retrieval or self.ranking or {}


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


class RepairCandidate(Metrics):
    """A candidate (or recipe) of a repair: the nodes it keeps in fp32, its verdict on the checked batches and the
    primary output's headline numbers (a reranker's ranking numbers are kept as recorded)."""

    blocked: list[str] = Field(default_factory=list)
    passed: bool
    violation: float = 0.0
    failures: list[str] = Field(default_factory=list)
    latency_ms: float | None = None
    build_seconds: float | None = None
    fp32_cost: float | None = None  # weight elements per token it keeps in fp32 (search candidates)
    round: int | None = None  # the search round that built it
    min_cosine: float | None = None
    max_abs: float | None = None
    agreement: float | None = None
    loss: float | None = None
    retrieval: dict[str, float | int] | None = None


class RecipeResult(RepairCandidate):
    """A quantization recipe the repair measured: whole-graph (a base; `chosen`: the one the search started from)
    or block-wise on top of the search's result, and the batches it was checked on."""

    recipe: str
    checked_on: str = ""
    chosen: bool | None = None
    per_channel: bool | None = None
    smoothing_alpha: float | None = None
    per_token: bool | None = None


class NodeError(Metrics):
    """qdq_loss_debug's quantization noise per MatMul (SQNR in dB) and its rank agreement with the measured
    sensitivity (None: not computed)."""

    tool: str | None = None
    per_node: dict[str, dict[str, float | None]] = Field(default_factory=dict)
    spearman_vs_sensitivity: float | None = None


class RepairOutcome(Metrics):
    """A precision repair: what it found (`chosen`), from what (`before`, `base`) and every candidate tried."""

    precision: str
    outcome: str
    units: int
    ordering: str = ""  # how the candidate units were ordered (sensitivity, ...)
    ranked_by: str = ""  # what ranks candidates that all fail
    checked_batches: int | None = None
    closest: RepairCandidate | None = None  # where nothing was written: the candidate that came closest
    budget_s: float | None = None  # the repair's seconds (older records: not bounded)
    budget_source: str | None = None  # where budget_s comes from (the setting, or auto from the variant's lab check)
    seconds: float | None = None  # what the whole repair took
    stopped: str | None = None  # the bound that ended the search early (its best passed, or nothing was written)
    chosen: RepairCandidate | None = None
    before: RepairCandidate | None = None
    base: str | None = None
    candidates: list[RepairCandidate] = Field(default_factory=list)
    bases: list[RecipeResult] = Field(default_factory=list)
    recipes: list[RecipeResult] = Field(default_factory=list)
    sensitivity: dict[str, float] = Field(default_factory=dict)  # per unit: loss removed when it alone stays fp32
    probes: int = 0  # builds that measured sensitivity on the hard texts' batches (not in `candidates`)
    latency_feed: list[int] | None = None  # the batch x sequence the latencies were measured at
    node_error: NodeError = Field(default_factory=NodeError)
    race: Trial | None = None  # a repaired int8 timed against the variant served after it (none: not timed)


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


Timings = dict[str, dict[str, float]]  # graph -> cell name -> median ms


class Trial(Metrics):
    """A challenger graph tried against a default one (`measure.forms.trial`, `race`): its largest difference from
    the default's outputs on the same real text (None: not compared), whether that is within the fp32 gate, the
    timing of both, whether it was kept and why; for an OpenVINO graph, the device that ran it and what it raced."""

    kept: bool = False
    reason: str = ""
    max_abs: float | None = None
    matches: bool | None = None
    ms: Timings = Field(default_factory=dict)
    engine: str | None = None
    against: str | None = None


class Borrowed(Trial):
    """Borrowed fusion rules tried on a family without its own: what fused, how attention fused (or why not), and
    the trial of the fused graph against the basic one."""

    rules: str
    fused: dict[str, int] = Field(default_factory=dict)
    attention: str = ""


class FormChoice(Metrics):
    """The layer-norm form of the fused fp32 graph chosen by measurement, why, and the timing of each form."""

    chosen: str
    reason: str
    ms: Timings = Field(default_factory=dict)


class InferencePrecision(Metrics):
    """The precision OpenVINO computes an int8 file's float ops in, why, and the race that decided it."""

    chosen: str
    reason: str
    ms: Timings = Field(default_factory=dict)


class OpenvinoInt8(Trial):
    """NNCF's int8 run by OpenVINO: the quantizer, its calibration texts and seconds, the precision of its float
    ops, and the race against the fastest graph kept."""

    quantizer: str | None = None
    calibration_texts: int | None = None
    seconds: float | None = None
    inference_precision: InferencePrecision | None = None  # older records: none (f32)


class Unavailable(Metrics):
    """The transformer fusions a family without ONNX Runtime fusion rules does not get, and why."""

    fusions: list[str] = Field(default_factory=list)
    reason: str = ""


class SmokeTest(Metrics):
    """A built graph loaded in ONNX Runtime with two real texts run through it: the providers, each output's shape."""

    providers: list[str] = Field(default_factory=list)
    outputs: dict[str, list[int]] = Field(default_factory=dict)


class GraphStats(Metrics):
    """A built graph (run.json `metrics.optimize.variants.<variant>`): nodes, fused-operator counts, whether every
    layer's attention fused and why not; its build seconds, size, layer-norm form, borrowed rules, smoke test."""

    nodes: int
    fused: dict[str, int] = Field(default_factory=dict)
    attention_fused: bool | None = None
    unavailable: Unavailable | None = None
    warning: str | None = None
    seconds: float | None = None
    megabytes: float | None = None
    form: FormChoice | None = None
    borrowed: Borrowed | None = None
    shapes: str | None = None  # the symbolic-shape graph: how its shapes were inferred
    smoke_test: SmokeTest | None = None


class PrecisionDecision(Metrics):
    """Whether the optimize step built a reduced precision, why, and whether it pays against fp32 (measured here,
    else assumed from the target's instructions; None: neither); the serving order follows it."""

    built: bool = False
    reason: str = ""
    pays: bool | None = None
    speedups: dict[str, float] = Field(default_factory=dict)  # goal cell -> fp32 ms / variant ms
    ms: Timings = Field(default_factory=dict)  # each file's own median per cell
    speedups_are: str | None = None  # how the speedups were measured (paired rounds)


class PrecisionChoice(Metrics):
    """The run's precision setting, its deployment target, and the decision per reduced precision."""

    setting: list[str] | str | None = None
    target: Json | None = None
    decisions: dict[str, PrecisionDecision] = Field(default_factory=dict)


class OptimizeMetrics(Metrics):
    variants: dict[str, GraphStats] = Field(default_factory=dict)
    precisions: PrecisionChoice | None = None  # (older runs: none)
    openvino: Trial | None = None  # the OpenVINO variant: tried or why not, its check and timing, kept (older: none)
    openvino_bf16: Trial | None = None  # the exported graph run by OpenVINO in bf16: tried or why not, kept
    openvino_int8: OpenvinoInt8 | None = None  # NNCF's int8 run by OpenVINO: tried or why not, kept (older: none)

    def decision(self, precision: str) -> PrecisionDecision | None:
        """The decision on `precision` (None: the run recorded none)."""
        return self.precisions.decisions.get(precision) if self.precisions else None


class ReferenceCut(Metrics):
    """The run's token limit against the model's own on the lab's texts: both lengths, how many texts are longer
    than the run's, and the module on those texts cut at the run's length against the reference cut at the model's
    (never gated; None where the run cuts where the model does)."""

    deployment: int
    library: int
    texts_beyond: int = 0
    beyond: Verdict | None = None


class LibraryCheck(Metrics):
    """The PyTorch module against the model's own library as it ships (with its verdict's fields), or why no
    library call was checked (`reason`)."""

    checked: bool
    library: str
    reference: str  # the library call, as code
    reason: str | None = None
    texts: int | None = None
    passed: bool | None = None
    failures: list[str] = Field(default_factory=list)
    ungated: list[str] = Field(default_factory=list)
    violation: float = 0.0
    precision: str | None = None
    providers: list[str] = Field(default_factory=list)
    seconds: float | None = None
    worst_texts: list[WorstText] = Field(default_factory=list)
    outputs: dict[str, OutputResult] = Field(default_factory=dict)
    cut: ReferenceCut | None = None
    norms: list[float] | None = None  # the library's sentence embedding norms, min and max
    reference_cached: bool | None = None


class CheckScope(Metrics):
    """The variants the parity lab checked (`parity.variants`: all, or served: in serving order until one passed),
    why, and each built variant it left unchecked with the reason."""

    variants: Literal["all", "served"]
    reason: str
    unchecked: dict[str, str] = Field(default_factory=dict)


class ParityMetrics(Metrics):
    reference: LibraryCheck | None = None
    scope: CheckScope | None = None
    inputs: Json | None = None
    variants: dict[str, Verdict] = Field(default_factory=dict)
    repair: dict[str, RepairOutcome] = Field(default_factory=dict)


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
    verification: Verification | None = None
    cut: ServedCut | None = None  # texts past the deployment's token limit, checked against the library's own cut
    replaced: str | None = None  # the run whose deployment of the same name this one replaced
    burst: BatchingBurst | None = None  # the dynamic batcher watched (older runs, and rerankers: none)


class Histogram(Metrics):
    counts: list[int]
    edges: list[float]


class LengthStats(Metrics):
    """The corpus's token lengths (special tokens included): count, range, percentiles and a histogram."""

    count: int
    min: int
    max: int
    percentiles: dict[str, float] = Field(default_factory=dict)
    histogram: Histogram


class PaddingWaste(Metrics):
    """The share of padded token slots: each batch padded to its longest text, and padded to its profile's max."""

    dynamic: float
    to_profile_max: float


class ShapeProfile(Metrics):
    """One TensorRT optimization profile: (min, opt, max) of the batch and of the sequence; every graph input gets
    the same (batch, sequence) shapes."""

    batch: list[int]
    sequence: list[int]

    def fits(self, rows: int, length: int) -> bool:
        return self.batch[0] <= rows <= self.batch[2] and self.sequence[0] <= length <= self.sequence[2]

    def shapes(self) -> list[tuple[int, int]]:
        """(batch, sequence) at min, opt and max."""
        return list(zip(self.batch, self.sequence))


class EngineBuild(Metrics):
    """How an engine came to be: its cache key and file, whether the cache held it, and (built here) the seconds,
    the layers pinned to fp32 and the TensorRT version."""

    key: str
    cache_hit: bool
    cache: str
    pinned_layers: int | None = None
    seconds: float | None = None
    tensorrt: str | None = None


class EngineRecord(Metrics):
    """One engine: its spec, the trtexec line that builds it, ONNX Runtime's TensorRT provider options for the same
    engine, and its build (none where no GPU was found)."""

    spec: Json
    trtexec: str
    ort_provider_options: dict[str, str | int | bool] = Field(default_factory=dict)
    build: EngineBuild | None = None


class TensorrtMetrics(Metrics):
    """The shape profiles designed from the corpus (the triton step serves them), and each engine's check against
    PyTorch (on a GPU)."""

    lengths: LengthStats | None = None
    padding_waste: dict[str, PaddingWaste] = Field(default_factory=dict)  # profiles (as text) -> waste
    profiles: list[ShapeProfile] = Field(default_factory=list)
    max_tokens: int | None = None  # the padded tokens a profile's batch may hold (batch.max_tokens), and why
    max_tokens_source: str | None = None
    fp16_pins: dict[str, list[str]] = Field(default_factory=dict)  # fused-graph node -> exported nodes kept fp32
    engines: dict[str, EngineRecord] = Field(default_factory=dict)
    parity: dict[str, Verdict] = Field(default_factory=dict)


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

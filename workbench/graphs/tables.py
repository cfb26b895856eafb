"""What the optimize and tensorrt steps built, as run.json records it (`metrics.optimize`, `metrics.tensorrt`): each
graph variant with its fusions, trials and precision decisions; the shape profiles designed from the corpus and the
engines; and what the export step resolved about the model and its graph (`metrics.export`: `ExportMetrics`,
read as `record.needed(ExportMetrics)`). Later steps and the serving plan read these tables."""
from __future__ import annotations

from pydantic import Field

from workbench.core.config import BatchRange, SequenceSetting, ShapeRange
from workbench.core.metrics import Json, Metrics
from workbench.core.results import Verdict
from workbench.models.footprint import model_token_budget
from workbench.models.tables import ModelOrigin, PipelineSummary

Timings = dict[str, dict[str, float]]  # graph -> cell name -> median ms


class GraphIO(Metrics):
    """The exported graph's inputs and outputs with their axes (names for dynamic ones, sizes for fixed ones)."""

    inputs: dict[str, list[str | int]]
    outputs: dict[str, list[str | int]]


class ResolvedSequence(Metrics):
    """The run's tokens per text as the export step resolved them once (`SequenceSetting.resolve`): later steps read
    this, never the setting again; where each value comes from."""

    min: int
    opt: int
    max: int
    sources: dict[str, str] = Field(default_factory=dict)

    def shape(self) -> ShapeRange:
        return ShapeRange(min=self.min, opt=self.opt, max=self.max)


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
        """The padded tokens one of the run's batches may hold, and why (`footprint.model_token_budget` with this
        model's shape at `sequence_max`)."""
        return model_token_budget(batch, self.num_heads, self.hidden_size, self.intermediate_size, sequence_max,
                                  4 * self.parameters if self.parameters else None)


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

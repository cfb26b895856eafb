"""What the parity lab found, as run.json records it (`metrics.parity`): the check against the model's own library,
which variants were checked, and each precision repair with its candidates and recipes."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from workbench.core.metrics import Json, Metrics
from workbench.core.results import OutputResult, Verdict, WorstText
from workbench.graphs.tables import Trial


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

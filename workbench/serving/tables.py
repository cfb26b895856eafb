"""What the triton step deployed and how it checked it, as run.json records it (`metrics.triton`): the deploy and
bench steps, the report and compare read it (`record.current(TritonMetrics)`)."""
from __future__ import annotations

from pydantic import Field

from workbench.core.metrics import Json, Metrics
from workbench.core.results import Verdict
from workbench.serving.flavor import Flavor


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

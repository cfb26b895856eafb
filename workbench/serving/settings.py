"""The serving steps' settings: the triton step's (`-p triton.<setting>`: how the deployment is generated and served)
and the deploy step's (`-p deploy.<setting>`: the image and the autoscaler it writes for that deployment)."""
from __future__ import annotations

import difflib
import re
from typing import Literal

from pydantic import Field, field_validator

from workbench.core.config import Count, Port, RunConfig, StepSettings, at_least_one, from_here
from workbench.precision.settings import LabSettings, ParitySettings
from workbench.serving.flavor import Flavor
from workbench.tasks.registry import OutputSpec, served_outputs

# Tasks one Python model serves, and what it takes and answers.
ONE_PYTHON_MODEL = {"rerank": "a query and its documents in, scores out",
                    "sparse-embedding": "texts in, each one's active vocabulary terms and weights out"}
REPOSITORY_VARIABLE = "WORKBENCH_REPOSITORY"  # where repositories publish when triton.repository_dir is unset


# Docker's image reference grammar (distribution/reference), lowercase throughout: a registry host[:port] and
# repository path, then, for a full image, a :tag and/or an @digest.
_DOMAIN = r"[a-z0-9](?:[a-z0-9-]*[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)*(?::[0-9]+)?"
_PATH = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
REGISTRY = re.compile(rf"{_DOMAIN}(?:/{_PATH})*")
IMAGE = re.compile(rf"{REGISTRY.pattern}(?::[\w][\w.-]{{0,127}})?(?:@sha256:[0-9a-f]{{64}})?")


def _image_reference(value: str, pattern: re.Pattern[str], example: str) -> str:
    """`value` if Docker takes it as written; else why not, with the fix."""
    if pattern.fullmatch(value):
        return value
    problem = ("holds whitespace" if re.search(r"\s", value) else
               "has uppercase letters (Docker refuses them in a repository path, and DNS ignores case in a host)"
               if value != value.lower() else "is not a Docker image reference")
    fixed = re.sub(r"\s+", "", value).lower()
    hint = f" (did you mean {fixed!r}?)" if pattern.fullmatch(fixed) else ""
    raise ValueError(f"{value!r} {problem}: Docker takes lowercase letters, digits, '.', '-', '_' and '/' "
                     f"(a :port after the host), like {example!r}{hint}")


# triton.max_request_tokens auto: the model calls (batch.max_tokens each) one request may need. One call of a base
# model (0.25 GiB of activations: 5 x 384 tokens of BERT-base's shape) took 2.2 s in ONNX Runtime fp32, unfused, on 2
# Zen 4 cores: 4 calls bound what one request holds an instance for to about 9 s there (8 let it hold 17 s) and still
# take a reranker's 32 documents of 200 tokens in one request; one call would refuse a 10-document rerank.
REQUEST_CALLS = 4


class TritonSettings(StepSettings):
    """How the deployment is generated and served."""

    name: str | None = Field(default=None, description="repository/ensemble name; default from the model")
    flavor: Flavor | Literal["auto"] = Field(default="auto", description=(
        "onnxruntime, tensorrt_plan or python-ort; auto: onnxruntime where ONNX Runtime runs on CUDA, else python-ort"))
    layout: Literal["auto", "ensemble", "fused"] = Field(default="auto", description=(
        "ensemble: tokenizer -> model models behind an ensemble (any flavor); fused: one Python model tokenizes and "
        "runs ONNX Runtime in one hop (python-ort); auto: fused for python-ort, else ensemble"))
    variant: str | None = Field(default=None, description="ONNX variant or engine to serve; default: best passing")
    outputs: list[str] | None = Field(default=None, description="outputs to serve; default: the sentence embedding "
                                                                "alone when there is one, else every task output")
    instances: int | Literal["auto"] = Field(default="auto", description=(
        "model instances; auto: two sharing the cores for python-ort on a CPU with two or more (one tokenizes and "
        "answers while the other infers), else one"))
    dynamic_batching: bool = True
    max_documents: int = Field(default=256, ge=1, description=(
        "rerankers: documents one request may score against its query; more are refused with a 400 naming this"))
    max_texts: int = Field(default=256, ge=1, description=(
        "texts (or reranker queries) one request may send; more are refused with a 400 naming this (a batched "
        "model also takes at most batch.max: Triton's own check)"))
    max_text_chars: int = Field(default=100_000, ge=1, description=(
        "characters one text (query, document) may have; a longer one is refused with a 400 naming this, before "
        "it holds a model instance"))
    max_request_tokens: int | Literal["auto"] = Field(default="auto", description=(
        "tokens one request may hold, each text counted as the model runs it (cut at sequence.max: a longer text "
        "costs no more than its kept part); more are refused with a 400 naming this. auto: 4 model calls (4 x "
        "batch.max_tokens), at least one text at sequence.max, so one request holds an instance for at most 4 "
        "calls. Python models (fused layout, rerankers)"))
    preferred_batch_sizes: list[Count] = Field(default_factory=list, description="default: [batch.opt, batch.max]")
    max_queue_delay_us: int = Field(default=0, ge=0, description="0: batch what queued while busy, wait for nothing")
    gpu_accelerator: Literal["none", "tensorrt"] = "none"
    http_port: Port | None = None
    grpc_port: Port | None = None
    metrics_port: Port | None = None
    overwrite: bool = False
    allow_unverified: bool = Field(default=False, description="publish a variant that did not pass parity (in "
                                                                "process and served); the record says verified: false")
    repository_dir: str | None = Field(default=None, description="where model_repository/<name> goes; default: "
                                                                 "$WORKBENCH_REPOSITORY, else the project's "
                                                                 "model_repository/")
    _repository_here = field_validator("repository_dir")(staticmethod(from_here))

    _positive = field_validator("max_request_tokens", "instances")(staticmethod(at_least_one))

    def request_tokens(self, max_tokens: int, sequence_max: int) -> int:
        """The tokens one request may hold (0: no bound, for a model without a bound on one call's tokens)."""
        if self.max_request_tokens != "auto":
            return self.max_request_tokens
        return max(REQUEST_CALLS * max_tokens, sequence_max) if max_tokens else 0
    def check(self, config: RunConfig) -> None:
        """The outputs it serves are the model's; a reranker and a sparse encoder are served by one Python model
        (serving/backend/rerank_model.py, fused_model.py with sparse_terms.py): another layout or flavor is refused
        before the run, not after its parity."""
        outputs = [o.name for o in config.output_specs]
        unserved = [name for name in self.outputs or () if name not in outputs]
        if unserved:
            raise ValueError(f"triton.outputs names {unserved}, which {config.task_choice.name} with pooling "
                             f"{config.pooling} does not produce; choose among: {', '.join(outputs)}")
        other = self.layout == "ensemble" or self.flavor not in ("auto", Flavor.PYTHON_ORT)
        task = config.task_choice.name if other else config.task
        if other and task in ONE_PYTHON_MODEL:
            asked = f"triton.layout={self.layout}" if self.layout == "ensemble" else \
                f"triton.flavor={Flavor(self.flavor).value}"
            raise ValueError(f"task {task} is served by one Python model ({ONE_PYTHON_MODEL[task]}); {asked} cannot "
                             "serve it: use triton.layout fused (or auto) and triton.flavor python-ort (or auto)")

    @field_validator("flavor", mode="before")
    @classmethod
    def _known_flavor(cls, value: object) -> object:
        names = ["auto", *(f.value for f in Flavor)]
        if value not in names:
            close = difflib.get_close_matches(str(value), names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"flavor must be one of {', '.join(names)}{hint}")
        return value


class DeploySettings(StepSettings):
    """The deploy step's settings: the image it builds on and where it is pushed, the load the autoscaler sizes
    for (with what the bench measured), where KServe finds the repository. Apart from the triton step's, so a change
    here leaves the verified deployment as it is."""

    container_image: str = Field(default="nvcr.io/nvidia/tritonserver:24.10-py3", description=(
        "the Triton container the deployment image starts FROM"))
    image_registry: str = Field(default="localhost:5000", description=(
        "where the deployment image is pushed: its tag is <registry>/<name>:<content hash>"))
    target_rps: float = Field(default=100.0, gt=0, description=(
        "requests per second the deployment must sustain: sets the autoscaler's minimum replicas"))
    burst_factor: float = Field(default=2.0, ge=1, description="the autoscaler's maximum over its minimum replicas")
    queue_target_ms: float | None = Field(default=None, gt=0, description=(
        "average queue time per request the autoscaler keeps; default: what the bench measured at the best "
        "throughput within bench.p99_limit_ms"))
    storage_uri: str | None = Field(default=None, description=(
        "KServe storageUri of the repository; default: pvc://<name>-models/ (copy the repository there)"))

    @field_validator("image_registry")
    @classmethod
    def _registry(cls, value: str) -> str:
        return _image_reference(value.rstrip("/"), REGISTRY, "registry.example.com:5000/ml")

    @field_validator("container_image")
    @classmethod
    def _container_image(cls, value: str) -> str:
        return _image_reference(value, IMAGE, "nvcr.io/nvidia/tritonserver:24.10-py3")


def served_specs(config: RunConfig) -> tuple[OutputSpec, ...]:
    """The outputs the deployment returns (`triton.outputs`, else the sentence embedding alone where there is one):
    the ones a variant's parity verdict is decided on."""
    return served_outputs(config.output_specs, TritonSettings.of(config).outputs)


def lab_settings(config: RunConfig) -> LabSettings:
    """What the parity lab reads from `config`, the outputs the deployment serves gating its verdicts."""
    return LabSettings(config.output_specs, tuple(o.name for o in served_specs(config)), config.tolerances,
                       config.batch, config.seed, config.device, ParitySettings.of(config).reference_cache_dir,
                       config.trust_remote_code, config.corpus, config.corpus_max_texts)

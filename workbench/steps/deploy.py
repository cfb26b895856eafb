"""The deploy step: the files that run the verified repository beyond this machine (an image recipe, Kubernetes with
autoscaling on Triton's queue time, KServe), sized from what the served bench measured."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import plotly.graph_objects as go

from workbench.core.advice import run_again
from workbench.core.config import RunConfig
from workbench.core.errors import StepSkipped
from workbench.core.metrics import Metrics
from workbench.core.record import RunRecord, StepEntry, StepStatus
from workbench.measure.capacity import Capacity, plan_capacity
from workbench.measure.settings import BenchSettings
from workbench.measure.tables import BenchMetrics
from workbench.report import figures
from workbench.report.compare import host_of
from workbench.report.page import Parts, Section
from workbench.serving.deploy import Scaling, deployment_files, image_tag, network_model
from workbench.serving.errors import RepositoryError
from workbench.serving.hostkinds import host_kind
from workbench.serving.plan import deployed_plan
from workbench.serving.settings import DeploySettings
from workbench.serving.tables import TritonMetrics
from workbench.steps import StepSpec

if TYPE_CHECKING:
    from workbench.serving.backend.api_schema import FrontSpec

STEP = "deploy"


class DeployMetrics(Metrics):
    """What the deploy step wrote: the image tag, the capacity on paper and the autoscalers' settings."""

    image: str | None = None
    capacity: Capacity | None = None
    scaling: Scaling | None = None
    verified: bool = False


def capacity_lines(capacity: Capacity) -> list[str]:
    return [f"Replicas: {capacity.replicas_reason}; at most {capacity.max_replicas} (deploy.burst_factor).",
            f"Autoscaler target: {capacity.queue_target_ms:g} ms queue time per request ({capacity.queue_reason}).",
            f"Target load: {capacity.target_rps:g} req/s (deploy.target_rps)."]


def api_front(repository: Path) -> FrontSpec | None:
    """The API front's models in `repository` (None: none it answers for)."""
    from workbench.serving.front import front_spec

    try:
        return front_spec(repository)
    except RepositoryError:
        return None


def run(config: RunConfig, record: RunRecord) -> StepEntry:
    """Write deploy/ from the plan the triton step deployed and the bench's served sweep (when it measured one)."""
    with record.step(STEP):
        deployed = deployed_plan(record.current(TritonMetrics), record)
        if deployed is None:
            raise StepSkipped(f"nothing deployed in this run (triton: {record.step_entry('triton').label})",
                              run_again(["triton", "deploy"], record.run_dir))
        plan, _ = deployed
        bench = record.results_as("bench", BenchMetrics) if record.status("bench") == StepStatus.OK else None
        served = bench.served if bench else None
        unmeasured = (f"no served bench: bench step {record.step_entry('bench').label}" if not served
                      else f"the served bench was skipped: {served.skipped}" if served.skipped else "")
        settings = DeploySettings.of(config)
        capacity = plan_capacity(settings, BenchSettings.of(config), None if unmeasured else served,
                                 network_model(plan), plan.max_queue_delay_us,
                                 f"{host_of(record)}, {plan.flavor.value} flavor", unmeasured)
        if capacity.per_replica_rps is None:
            size_it = run_again(["triton", "bench", "deploy"], record.run_dir)
            capacity = capacity.model_copy(update={"replicas_reason": f"{capacity.replicas_reason}; to size it: "
                                                                      f"{size_it}"})
        scaling = Scaling(min_replicas=capacity.min_replicas, max_replicas=capacity.max_replicas,
                          queue_target_us=round(capacity.queue_target_ms * 1000), concurrency=capacity.concurrency or 1)
        repository = record.artifact("triton.repository")
        digest = record.artifact_sha256("triton.repository")
        front = api_front(repository)
        node = record.environment.node
        files = deployment_files(settings, plan, repository.relative_to(record.run_dir), digest, scaling,
                                 capacity_lines(capacity), record.run_dir / STEP, front,
                                 host_kind(node.kind) if node else None)
        for key, path in files.items():
            record.add_artifact(f"{STEP}.{key}", path, kind="deployment")
        deployment = record.current(TritonMetrics)
        verified = bool(deployment and deployment.verified)
        if not verified:
            record.unverified("the repository these files serve was published unverified (triton.allow_unverified)")
        record.set_metric(STEP, DeployMetrics(image=image_tag(settings, plan, digest, front), capacity=capacity,
                                              scaling=scaling, verified=verified).recorded())
    return record.step_entry(STEP)


def lines(record: RunRecord) -> list[str]:
    """The verdict line: the image, the replicas for the target load, where the files are."""
    deploy = record.results_as(STEP, DeployMetrics)
    if deploy is None or deploy.capacity is None or deploy.scaling is None:
        return ["nothing written"]
    capacity, scaling = deploy.capacity, deploy.scaling
    per = capacity.per_replica_rps
    sized = "one replica (not measured)" if per is None else \
        f"{scaling.min_replicas} replica(s) of {per:.1f} req/s for {capacity.target_rps:g} req/s"
    return [f"image {deploy.image}: {sized}, autoscaled to {scaling.max_replicas} on queue time "
            f"{scaling.queue_target_us} us per request (HPA) or {scaling.concurrency} in flight (KServe)",
            f"files: {record.run_dir / STEP} (README.md: build, push, apply, watch it scale)"]


def section(deploy: DeployMetrics) -> Parts:
    """The report's capacity and autoscaling table."""
    if deploy.capacity is None or deploy.scaling is None:
        return []
    return [("Triton at scale: capacity and autoscaling",
             f"The image {deploy.image} (deploy/Dockerfile), Kubernetes with a HorizontalPodAutoscaler on Triton's "
             "queue time per request and a KServe InferenceService (deploy/README.md). Replicas for the target load "
             f"from what one replica sustained in the served bench, measured on {deploy.capacity.measured_on}.",
             [capacity_table(deploy.capacity, deploy.scaling)])]


def capacity_table(capacity: Capacity, scaling: Scaling) -> go.Figure:
    """The capacity on paper and what each autoscaler keeps, with the reasons."""
    per = capacity.per_replica_rps
    rows = [["target load", f"{capacity.target_rps:g} req/s", "deploy.target_rps"],
            ["one replica sustains", "not measured" if per is None else f"{per:.1f} req/s",
             capacity.replicas_reason],
            ["replicas (HPA / KServe)", f"{scaling.min_replicas} to {scaling.max_replicas}",
             "minimum for the target load; maximum = minimum x deploy.burst_factor"],
            ["HPA: queue time per request", f"{scaling.queue_target_us} us", capacity.queue_reason],
            ["KServe: requests in flight per replica", str(scaling.concurrency),
             "the load level that throughput was measured at"]]
    return figures.table("Capacity on paper (one GPU per pod)", ["", "value", "why"], rows)


SPEC = StepSpec(
    STEP, 8, "an image recipe, Kubernetes and KServe files sized from the served bench", run, lines,
    sections=(Section("Triton at scale", section, served=True),),
    reads=("triton",), owns=(STEP,), metrics=DeployMetrics, after="bench", settings=DeploySettings)

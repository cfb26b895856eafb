"""The deploy step: the files that run the verified repository beyond this machine (an image recipe, Kubernetes with
autoscaling on Triton's queue time, KServe), sized from what the served bench measured."""
from __future__ import annotations

from dataclasses import asdict

from workbench.core.catalog import Section, StepSpec
from workbench.core.config import RunConfig
from workbench.core.errors import StepSkipped
from workbench.core.record import RunRecord, StepEntry, StepStatus
from workbench.core.results import DeployMetrics
from workbench.measure.capacity import Capacity, plan_capacity
from workbench.report.compare import host_of
from workbench.report.page import deploy_section
from workbench.report.takeaways import deploy_lines
from workbench.serving.deploy import Scaling, deployment_files, image_tag, network_model
from workbench.serving.plan import deployed_plan

STEP = "deploy"


def capacity_lines(capacity: Capacity) -> list[str]:
    return [f"Replicas: {capacity.replicas_reason}; at most {capacity.max_replicas} (triton.burst_factor).",
            f"Autoscaler target: {capacity.queue_target_ms:g} ms queue time per request ({capacity.queue_reason}).",
            f"Target load: {capacity.target_rps:g} req/s (triton.target_rps)."]


def run(config: RunConfig, record: RunRecord) -> StepEntry:
    """Write deploy/ from the plan the triton step deployed and the bench's served sweep (when it measured one)."""
    with record.step(STEP):
        deployed = deployed_plan(record)
        if deployed is None:
            raise StepSkipped(f"nothing deployed in this run (triton: {record.step_entry('triton').label}); run "
                              "--steps triton,deploy")
        plan, _ = deployed
        served = record.metric("bench.served") if record.status("bench") == StepStatus.OK else None
        unmeasured = (f"no served bench: bench step {record.step_entry('bench').label}" if not served
                      else f"the served bench was skipped: {served['skipped']}" if "skipped" in served else "")
        capacity = plan_capacity(config.triton, config.bench, None if unmeasured else served, network_model(plan),
                                 plan.max_queue_delay_us, f"{host_of(record)}, {plan.flavor.value} flavor", unmeasured)
        scaling = Scaling(capacity.min_replicas, capacity.max_replicas, round(capacity.queue_target_ms * 1000),
                          capacity.concurrency or 1)
        repository = record.artifact("triton.repository")
        digest = record.artifact_sha256("triton.repository")
        files = deployment_files(config, plan, repository.relative_to(record.run_dir), digest, scaling,
                                 capacity_lines(capacity), record.run_dir / STEP)
        for key, path in files.items():
            record.add_artifact(f"{STEP}.{key}", path, kind="deployment")
        deployment = record.deployment()
        verified = bool(deployment and deployment.verified)
        if not verified:
            record.unverified("the repository these files serve was published unverified (triton.allow_unverified)")
        record.set_metric(STEP, DeployMetrics(image=image_tag(config, plan, digest), capacity=capacity.record(),
                                              scaling=asdict(scaling), verified=verified).recorded())
    return record.step_entry(STEP)


SPEC = StepSpec(
    STEP, 8, "an image recipe, Kubernetes and KServe files sized from the served bench", run, deploy_lines,
    sections=(Section("Triton at scale", deploy_section, served=True),),
    reads=("triton",), owns=(STEP,), metrics=DeployMetrics)

"""The triton step: generate the model repository, serve it from a real Triton server, prove the served answers."""
from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

import plotly.graph_objects as go

from workbench.core.advice import run_again, set_settings
from workbench.core.config import RunConfig
from workbench.core.errors import DependencyMissingError, StepSkipped
from workbench.core.progress import track
from workbench.core.record import RunRecord, StepEntry
from workbench.core.results import Verdict
from workbench.graphs import onnxfiles
from workbench.graphs.tables import ExportMetrics, OptimizeMetrics, ShapeProfile, TensorrtMetrics
from workbench.models.loading import LoadedModel, load_model
from workbench.precision.errors import UnverifiedError
from workbench.precision.lab import ParityLab, lab_texts, library_reference
from workbench.precision.settings import LabSettings
from workbench.precision.tables import ParityMetrics
from workbench.report import figures
from workbench.report.page import Parts, Section, again_both_ways
from workbench.report.takeaways import cut_line
from workbench.runners.registry import open_variant
from workbench.serving.batching import observe_batching
from workbench.serving.client import TritonClient
from workbench.serving.endpoints import SAMPLE_TEXT, request_lines
from workbench.serving.flavor import Flavor
from workbench.serving.plan import (
    ServingRequest,
    build_plan,
    candidates,
    choose_flavor,
    int8_decision,
    lost_races,
    recorded_preference,
    repository_root,
    served_groups,
)
from workbench.serving.repository import (
    ServingPlan,
    check_replaceable,
    published_by,
    read_repository,
    write_repository,
)
from workbench.serving.runner import ServedRunner
from workbench.serving.server import API_PORT, HOST, Ports, TritonServer, find_tritonserver
from workbench.serving.settings import TritonSettings, lab_settings, served_specs
from workbench.serving.tables import BatchingBurst, ServedCut, TritonMetrics, Verification
from workbench.steps import StepSpec
from workbench.tasks.registry import SENTENCE_EMBEDDING, head_activation, score_output

STEP = "triton"
PROMPT_TEXTS = 32  # corpus texts per named prompt in the served prompt check
HEADS = {"softmax": "softmax: the best label and its probability",
         "sigmoid": "sigmoid: every label's score, and the labels above 0.5",
         "none": "none: every label's raw score"}  # a classifier's served head (serving/backend/labels.py)


def serve_and_check(config: RunConfig, record: RunRecord, plan: ServingPlan, metrics: TritonMetrics,
                    repository: Path, loaded: LoadedModel) -> None:
    """Serve `repository` from a real Triton server and record in `metrics` what it answered: parity over HTTP and
    gRPC against the model's library, the texts past the deployment's token limit, each named prompt, and the
    batch sizes a burst of requests ran at."""
    binary = find_tritonserver()
    if plan.flavor is not Flavor.PYTHON_ORT and binary.origin == "nvidia-pytriton":
        raise DependencyMissingError(f"the {plan.flavor.value} flavor needs Triton's {plan.flavor.value} backend; the "
                                     "tritonserver bundled in nvidia-pytriton has only the Python backend",
                                     "serve it from NVIDIA's container (deploy/docker_run.sh), or use "
                                     "-p triton.flavor=python-ort")
    precision = metrics.precision or "fp32"
    settings = served_settings(lab_settings(config), plan)
    texts = lab_texts(settings, loaded)
    record.phase("loading the model's own library for the reference answers")
    reference = library_reference(settings, loaded, texts)
    metrics.served_reference = reference.call if reference else "the workbench's PyTorch module"
    metrics.served_library = reference.library if reference else "PyTorch"
    lab = ParityLab.corpus_only(settings, loaded, texts, reference)  # the served answers against what users run today
    prompts = prompt_labs(config, loaded, plan, texts[:PROMPT_TEXTS])
    outputs = list(settings.gated)  # the served outputs, a sequence classifier's score among them
    triton = TritonSettings.of(config)
    ports = Ports.pick(triton.http_port, triton.grpc_port, triton.metrics_port)
    metrics.server = str(binary.executable)
    loaded.drop_weights()  # the references are the library's (or computed): the server gets the memory
    record.phase(f"starting tritonserver on {repository.name} (its models load before it answers)")
    with TritonServer(repository, record.run_dir / "triton" / "server", ports, binary=binary) as server:
        record.found(f"tritonserver ready in {server.timings['ready_seconds']:.0f} s")
        metrics.ready_seconds = server.timings["ready_seconds"]
        parity, beyond = {}, {}
        endpoints = (("http", server.http_url), ("grpc", server.grpc_url))
        for protocol, url in endpoints:
            with (TritonClient(url, protocol) as client,
                  ServedRunner(client, plan.name, texts, loaded.input_names, outputs,
                               vocabulary=sparse_vocabulary(plan)) as runner):
                parity[protocol] = lab.within().compare(runner, precision, progress=f"served parity {protocol}")
                if lab.beyond:
                    beyond[protocol] = lab.subset(list(lab.beyond)).compare(
                        runner, precision, progress=f"served parity {protocol}, texts past the cut")
        metrics.served_parity = parity
        metrics.cut = ServedCut(deployment=loaded.sequence.max, library=loaded.max_sequence,
                                texts_within=len(texts) - len(lab.beyond), texts_beyond=len(lab.beyond),
                                gated=loaded.sequence.max == loaded.max_sequence, beyond=beyond)
        if prompts:
            metrics.prompt_parity = prompt_parity(prompts, loaded, plan, server.http_url, texts[:PROMPT_TEXTS],
                                                  precision)
        if not plan.reranks:  # a reranker's requests are not batched together: its documents are the batch
            metrics.burst = observe_batching(server, plan, list(texts), 4 * plan.max_batch_size)
    metrics.stop_seconds = server.timings["stop_seconds"]
    metrics.served_passed = {protocol: verdict.passed for protocol, verdict in served_checks(metrics).items()}


def sparse_vocabulary(plan: ServingPlan) -> int:
    """A sparse encoder's vocabulary, whose served active terms make its sentence embedding; 0 for other models."""
    return plan.output_dims[SENTENCE_EMBEDDING][0] if plan.sparse else 0


def served_settings(settings: LabSettings, plan: ServingPlan) -> LabSettings:
    """The lab settings the served answers are checked on: a sequence classifier's served `score` is compared and
    gated too, against its text-classification pipeline's scores (the head as the library applies it)."""
    if not plan.classifies or any(o.per_token for o in plan.outputs):
        return settings
    score = score_output(plan.activation)
    return replace(settings, specs=(*settings.specs, score), gated=(*settings.gated, score.name))


def served_checks(metrics: TritonMetrics) -> dict[str, Verdict]:
    """Every served check by name: each protocol, each protocol on the texts past the token limit where the
    deployment cuts where the library does (gated), each named prompt over HTTP."""
    cut = metrics.cut
    past = {f"{protocol}, texts past {cut.deployment} tokens": verdict for protocol, verdict in cut.beyond.items()} \
        if cut and cut.gated else {}
    return {**(metrics.served_parity or {}), **past,
            **{f"http, prompt_name={name!r}": verdict for name, verdict in metrics.prompt_parity.items()}}


def prompt_labs(config: RunConfig, loaded: LoadedModel, plan: ServingPlan, texts: tuple[str, ...]
                ) -> dict[str, ParityLab]:
    """Per named prompt of the model, `texts` and `encode(texts, prompt_name=...)`'s answers, computed before the
    server starts (the library's copy of the model is gone by then)."""
    settings = lab_settings(config)
    return {name: ParityLab.corpus_only(settings, loaded, texts, library_reference(settings, loaded, texts, name), name)
            for name in plan.prompts}


def prompt_parity(labs: dict[str, ParityLab], loaded: LoadedModel, plan: ServingPlan, url: str,
                  texts: tuple[str, ...], precision: str) -> dict[str, Verdict]:
    """Per named prompt (`prompt_labs`, on `texts`), the served answers to requests naming it (`prompt_name`) over
    HTTP."""
    outputs = [o.name for o in plan.outputs]
    results = {}
    for name in track(list(labs), "served prompts", "prompts", note=lambda prompt: prompt):
        with (TritonClient(url, "http") as client,
              ServedRunner(client, plan.name, texts, loaded.input_names, outputs, {"prompt_name": name},
                           sparse_vocabulary(plan)) as runner):
            results[name] = labs[name].within().compare(runner, precision)
    return results


def shape_profiles(record: RunRecord) -> list[ShapeProfile]:
    """The shape profiles the tensorrt step designed (none when it did not run)."""
    found = record.results_as("tensorrt", TensorrtMetrics)
    return list(found.profiles) if found else []


def recorded_verdict(config: RunConfig, record: RunRecord, variant: str) -> Verdict | None:
    """`variant`'s current parity verdict, where it holds for what this deployment serves: a pass gated on fewer
    outputs than are served (triton.outputs changed since the parity step) is no verdict, and is checked again."""
    found = record.verdict(variant)
    served = {o.name for o in served_specs(config)}
    return None if found is not None and found.passed and not served <= set(found.gated_on) else found


def candidate_variants(config: RunConfig, record: RunRecord, flavor: Flavor) -> list[str]:
    """The run's variants `flavor` could serve, best first (`serving.plan.candidates`)."""
    int8, lost = int8_decision(record.results_of(OptimizeMetrics)), lost_races(record.results_of(ParityMetrics))
    return candidates(set(record.variant_names(flavor.artifact_kind)), partial(recorded_verdict, config, record),
                      flavor, TritonSettings.of(config).variant, int8, lost)


def serving_plan(config: RunConfig, record: RunRecord, variant: str | None = None,
                 flavor: Flavor | None = None) -> tuple[ServingPlan, str]:
    """How to serve `variant` of this run (default: the first candidate) as `flavor` (default: the configured one)
    with the configured Triton settings."""
    from transformers import AutoConfig

    flavor = flavor or choose_flavor(TritonSettings.of(config).flavor, config.device, config.task_choice.name)
    variant = variant or candidate_variants(config, record, flavor)[0]
    outputs = served_specs(config)
    folder = record.artifact("tokenizer")  # tokenizer and model config, saved by the export step
    classifies = any(o.kind in ("logits", "token_logits") for o in outputs)
    hf_config = AutoConfig.from_pretrained(folder) if classifies else None
    id2label = {str(k): v for k, v in hf_config.id2label.items()} if hf_config else {}
    activation = head_activation(hf_config.problem_type, hf_config.num_labels) \
        if hf_config and config.task_choice.name == "sequence-classification" else "softmax"
    export = record.needed(ExportMetrics)
    request = ServingRequest(
        name=TritonSettings.of(config).name or config.model_slug, flavor=flavor,
        variant=record.variant(variant, flavor.artifact_kind), export=export, tokenizer_dir=folder,
        pad_token_id=record.tokenizer().pad_token_id or 0, id2label=id2label, activation=activation,
        outputs=outputs,
        profiles=shape_profiles(record), triton=TritonSettings.of(config), batch=config.batch,
        sequence_max=export.sequence_range.max, threads=config.threads)
    return build_plan(request), variant


def verified_variant(config: RunConfig, record: RunRecord, flavor: Flavor, ordered: list[str], loaded: LoadedModel,
                     served_failures: dict[str, list[str]] | None = None) -> Verification:
    """The first of the candidates (`ordered`, best first) that passed parity in this run and did not fail it served
    (`served_failures`); a candidate no step has checked is checked here, on the parity step's lab and tolerances.
    Without one, UnverifiedError (unless triton.allow_unverified)."""
    served_failures = served_failures or {}
    candidates = [c for c in ordered if c not in served_failures]
    if not candidates:
        raise UnverifiedError(f"every variant that passed parity in process fails it served: {served_failures}",
                              "read metrics.triton.served_parity in run.json; serve another variant "
                              "(-p triton.variant=...) or publish it anyway with -p triton.allow_unverified=true")
    order = "configured: triton.variant" if TritonSettings.of(config).variant else \
        recorded_preference(flavor, record.results_of(OptimizeMetrics), record.results_of(ParityMetrics))[1]
    checks: dict[str, Verdict] = {}
    seen: dict[str, Verdict | None] = {}  # the candidates ahead, by their verdict
    lab: ParityLab | None = None
    for variant in candidates:
        verdict = recorded_verdict(config, record, variant)
        if verdict is None and flavor is not Flavor.TENSORRT_PLAN:
            built = record.variant(variant)
            reference = loaded if loaded.has_weights else load_model(config)  # dropped while a server ran
            settings = lab_settings(config)
            lab = lab or ParityLab.build(settings, reference, lab_texts(settings, loaded), regroup=partial(
                served_groups, max_tokens=loaded.token_budget(config.batch)[0]))
            with open_variant(built, config.device, config.threads) as runner:
                verdict = checks[variant] = lab.for_variant(onnxfiles.batch_dependent(built.path)).compare(
                    runner, built.precision)
        if verdict is not None and verdict.passed:
            return Verification(variant=variant, by="triton step" if variant in checks else "parity step",
                                order=order, checked_here=checks, passed_over={**served_failures, **failures_of(seen)})
        seen[variant] = verdict
    failures = {**served_failures, **failures_of(seen)}
    if not TritonSettings.of(config).allow_unverified:
        raise UnverifiedError(f"no variant to serve passed parity in this run: {failures}",
                              f"{run_again(['parity', 'triton'], record.run_dir)} (its repair may fix the "
                              "variant), serve another (setting triton.variant), or publish it anyway (setting "
                              "triton.allow_unverified=true)")
    record.unverified(f"{candidates[0]} did not pass parity: {failures[candidates[0]]}")
    return Verification(variant=candidates[0], by=None, order=order, checked_here=checks, passed_over=failures)


def failures_of(verdicts: dict[str, Verdict | None]) -> dict[str, list[str]]:
    """Each variant's parity failures ("not checked" without a verdict: a TensorRT plan on a host without a GPU)."""
    return {v: verdict.failures if verdict else ["not checked (needs a GPU)"] for v, verdict in verdicts.items()}


def passed_over(verification: Verification) -> str:
    """The variants ahead of the served one in the serving order, and why each was passed over ("" if none)."""
    skipped = [f"{variant} ({'; '.join(failures)})" for variant, failures in verification.passed_over.items()]
    return f"; passed over: {', '.join(skipped)}" if skipped else ""


def run(config: RunConfig, record: RunRecord) -> StepEntry:
    """Serve only what passed parity in this run: write the repository into the run folder, serve it locally and
    check what it answers; only then publish it to model_repository/<name>/. A repository whose served check failed
    or did not finish is never published, and an earlier published one stays as it was."""
    with record.step(STEP):
        record.phase(f"loading {config.model_slug} with transformers, for the served answers' reference")
        loaded = load_model(config)
        flavor = choose_flavor(TritonSettings.of(config).flavor, config.device, config.task_choice.name)  # recorded
        candidates = candidate_variants(config, record, flavor)  # ordered once, recorded
        served_failures: dict[str, list[str]] = {}
        while not deploy_first_passing(config, record, flavor, candidates, loaded, served_failures):
            pass  # a variant that passed in process but failed served is passed over for the next
    return record.step_entry(STEP)


def deploy_first_passing(config: RunConfig, record: RunRecord, flavor: Flavor, candidates: list[str],
                         loaded: LoadedModel, served_failures: dict[str, list[str]]) -> bool:
    """Write, serve and check the first candidate not in `served_failures`; publish it when its served answers
    pass. False (and its failure added to `served_failures`) when they fail and another candidate may be tried;
    UnverifiedError when none is left (a variant the user chose is not replaced)."""
    verification = verified_variant(config, record, flavor, candidates, loaded, served_failures)
    plan, variant = serving_plan(config, record, verification.variant, flavor)
    triton = TritonSettings.of(config)
    destination = repository_root(triton.repository_dir) / plan.name
    check_replaceable(destination, triton.overwrite)
    run_copy = write_repository(plan, record.run_dir / "model_repository" / plan.name, overwrite=True)
    record.add_artifact("triton.repository", run_copy, kind="triton-repository", flavor=plan.flavor.value,
                        variant=variant)
    metrics = TritonMetrics(name=plan.name, flavor=plan.flavor, layout=plan.layout, variant=variant,
                            precision=record.variant(variant, plan.flavor.artifact_kind).precision,
                            models=sorted(read_repository(run_copy)), max_batch_size=plan.max_batch_size,
                            pad_to=plan.pad_to, repository=str(destination), published=False, plan=plan.record(),
                            verification=verification, verified=verification.by is not None,
                            candidates=candidates, head=plan.activation if plan.classifies else None)
    record.set_metric(STEP, metrics.recorded())

    def publish() -> None:
        earlier = published_by(destination)
        if earlier is not None and Path(earlier) != record.run_dir.resolve():
            metrics.replaced = earlier  # another run's deployment of the same name
        write_repository(plan, destination, overwrite=triton.overwrite, run=record.run_dir.resolve())
        metrics.published = True
        record.set_metric(STEP, metrics.recorded())

    try:
        serve_and_check(config, record, plan, metrics, run_copy, loaded)
    except StepSkipped:
        publish()  # verified in process; this host cannot run the flavor's backend, the host it is for can
        raise
    except BaseException:
        record.remove_artifact("triton.repository")  # its check did not finish: nothing is left to serve
        raise
    failed = [check for check, ok in metrics.served_passed.items() if not ok]
    metrics.verified = metrics.verified and not failed
    record.set_metric(STEP, metrics.recorded())
    if failed and not triton.allow_unverified:
        record.remove_artifact("triton.repository")
        failures = served_checks(metrics)[failed[0]].failures
        served_failures[variant] = [f"served over {', '.join(failed)}: {failures[0]}"]
        if triton.variant is None and len(candidates) > len(served_failures):
            return False
        raise UnverifiedError(
            f"{variant} served by Triton fails parity over {', '.join(failed)}: {'; '.join(failures)}; nothing was "
            f"published to {destination}", "read metrics.triton.served_parity in run.json; serve another variant "
            "(-p triton.variant=...) or publish it anyway with -p triton.allow_unverified=true")
    if failed:
        record.unverified(f"served parity failed over {', '.join(failed)}")
    publish()
    return True


PROTOCOLS = {"http": "HTTP", "grpc": "gRPC"}


def lines(record: RunRecord) -> list[str]:
    deployment = record.results_as(STEP, TritonMetrics) or TritonMetrics()
    parity = " and ".join(f"{PROTOCOLS.get(protocol, protocol)} {'pass' if r.passed else 'FAIL'}"
                          for protocol, r in (deployment.served_parity or {}).items())
    verified = "verified" if deployment.verified else "NOT verified (allow_unverified)"
    against = f" against {deployment.served_library}" if deployment.served_library else ""
    prompts = ", ".join(f"{name or '(empty)'} {'pass' if r.passed else 'FAIL'}"
                        for name, r in deployment.prompt_parity.items())
    flavor = deployment.flavor.value if deployment.flavor else "?"
    cut = deployment.cut
    within = f" on texts up to {cut.deployment} tokens" if cut and not cut.gated else ""
    replaced = deployment.replaced
    runtime = ", run by OpenVINO" if (deployment.variant or "").startswith("openvino") else ""
    published = f", published to {deployment.repository}" if deployment.published and deployment.repository else ""
    return [f"served {deployment.variant} ({verified}) as {deployment.name!r} via the {deployment.layout} "
            f"layout ({flavor}{runtime}){published}",
            *([f"serving order: {deployment.verification.order}{passed_over(deployment.verification)}"]
              if deployment.verification and deployment.verification.order else []),
            f"served parity{against}{within}: {parity or 'not checked'}",
            *([f"served head, as the library's pipeline applies it: {HEADS[deployment.head]}"]
              if deployment.head else []),
            *([cut_line(cut.deployment, cut.library, cut.texts_beyond, deployment.served_library or "the library",
                        next(iter(cut.beyond.values()), None))] if cut else []),
            *([f"replaced the deployment {deployment.name!r} that run {replaced} had published (to keep both, name "
               f"this one apart: {set_settings({'triton.name': deployment.name + '_2'})})"] if replaced else []),
            *([f"prompts (request parameter prompt_name) against encode(prompt_name=...): {prompts}"]
              if prompts else [])]


def section(triton: TritonMetrics) -> Parts:
    if triton.served_parity is None:
        return []
    against = triton.served_library or "PyTorch"
    served = {f"served {p}": r for p, r in triton.served_parity.items()}
    served.update({f"served, prompt {name!r}": r for name, r in triton.prompt_parity.items()})
    return [("Served parity", f"The deployment against {against} over HTTP and gRPC, on the same texts; each named "
             "prompt over HTTP against the library given the same prompt.", [figures.parity_table(served, against)])]


def calling(triton: TritonMetrics) -> Parts:
    """How to call the deployment: `workbench serve` on its repository, then the API front's requests (none for a
    model the front does not answer for)."""
    kinds = {output.get("kind") for output in (triton.plan or {}).get("outputs", [])}
    names = {output.get("name") for output in (triton.plan or {}).get("outputs", [])}
    kind = "rerank" if "scores" in kinds else "embeddings" if "sentence_embedding" in names else None
    if not (triton.repository and triton.name and kind):
        return []
    lines = [f"workbench serve --repository {triton.repository}",
             *request_lines(f"http://{HOST}:{API_PORT}", [(triton.name, kind)], SAMPLE_TEXT, keyed=False)]
    return [("Calling the deployment", "`workbench serve` starts it with the API front: OpenAI's embeddings API "
             "and a Cohere-style rerank on port 8080 beside Triton's own protocol (docs/api.md).",
             [figures.Snippet(tuple(lines))])]


def readable_deployment(record: RunRecord) -> TritonMetrics | str | None:
    """The deployment when this step is ok now, or why its record cannot be read (damaged, or written by a
    workbench this one cannot read)."""
    try:
        return record.current(TritonMetrics)
    except ValueError as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"


def served_note(record: RunRecord) -> str:
    """What Triton serves from this run, for the report's served sections."""
    deployment = readable_deployment(record)
    if isinstance(deployment, str):
        return f"Served: unknown, the triton step's record is unreadable ({deployment}); " \
               f"{again_both_ways(record, STEP)} to deploy again."
    if deployment is None:
        return (f"Served: nothing current (triton: {record.step_entry(STEP).label}); "
                f"{again_both_ways(record, STEP)} to deploy.")
    unverified = "" if deployment.verified else " (unverified)"
    return f"Served: {deployment.variant} via the {deployment.layout} layout{unverified}."


def served_differs(record: RunRecord, variant: str) -> str:
    """A note when Triton serves another variant than the recommended `variant` (this step chose before bench)."""
    deployment = readable_deployment(record)
    if not isinstance(deployment, TritonMetrics) or deployment.variant == variant:
        return ""
    return (f". Triton serves {deployment.variant} (the triton step's order, chosen before bench measured); to "
            f"serve {variant}: {again_both_ways(record, 'triton,bench,report', {'triton.variant': variant})}")


def batch_size_figure(burst: BatchingBurst) -> go.Figure:
    """How many executions each model ran at each batch size for a burst of one-text requests."""
    figure = go.Figure()
    for model, sizes in burst.batch_sizes.items():
        ordered = sorted(sizes.items())
        figure.add_bar(name=model, x=[str(k) for k, _ in ordered], y=[v for _, v in ordered])
    figure.update_layout(title=f"Dynamic batching: {burst.requests} concurrent one-text requests",
                         xaxis_title="batch size executed (texts)", yaxis_title="executions (count)",
                         barmode="group")
    return figure


SPEC = StepSpec(
    STEP, 5, "Triton model repository; a real server; served parity and batching", run, lines,
    sections=(Section("Served parity", section, served=True), Section("Calling the deployment", calling)),
    needs=("model", "ports", "repository"), reads=("optimize",), machine=("onnxruntime", "tritonserver"),
    lighter="one model instance (-p triton.instances=1), a lower batch.max_tokens",
    owns=("triton", "model_repository"), writes=0.8, metrics=TritonMetrics, after="tensorrt",
    settings=TritonSettings, served=served_note, served_differs=served_differs)

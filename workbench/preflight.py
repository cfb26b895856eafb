"""Checks that take seconds, run before the first kernel starts: a bad setting fails the run at once, not after
minutes of export and optimization."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from workbench.core.config import RunConfig
from workbench.core.data import load_corpus
from workbench.core.disk import require_free
from workbench.core.errors import ConfigError, MissingArtifactError, OutOfMemoryError, WorkbenchError
from workbench.core.record import RunRecord, StepStatus, ensure_writable
from workbench.models.errors import UnsupportedModelError
from workbench.models.footprint import MemoryEstimate
from workbench.serving.settings import TritonSettings
from workbench.steps import NEEDS, StepSpec, specs

T = TypeVar("T")


class ProblemsError(ConfigError):
    """Several problems found by one check (preflight lists them all at once), each with its own fix."""

    def __init__(self, problems: list[WorkbenchError]) -> None:
        self.problems = problems
        super().__init__(
            f"{len(problems)} problems: " + " ".join(f"({i}) {type(p).__name__}: {p.problem}"
                                                     for i, p in enumerate(problems, start=1)),
            " ".join(f"({i}) {p.fix}" for i, p in enumerate(problems, start=1)))


class Problems:
    """Collects the typed errors of independent checks, so one refusal lists them all (`raise_all`)."""

    def __init__(self) -> None:
        self.found: list[WorkbenchError] = []

    def check(self, function: Callable[..., T], *args: object) -> T | None:
        """`function(*args)`, or None when it raised a WorkbenchError: kept, not raised."""
        try:
            return function(*args)
        except ProblemsError as several:
            self.found.extend(several.problems)
        except WorkbenchError as problem:
            self.found.append(problem)
        return None

    def raise_all(self) -> None:
        """The one problem found as itself, several as a ProblemsError; nothing when none was found."""
        if len(self.found) == 1:
            raise self.found[0]
        if self.found:
            raise ProblemsError(self.found)


def preflight(config: RunConfig, resumed: RunRecord | None = None) -> MemoryEstimate | None:
    """What the selected steps declare they need, checked before anything runs, every problem listed in one refusal:
    device cuda, the corpus, each step's own check (e.g. the export opset), the model (its task, pipeline, pooling
    and limits), free ports, a writable repository folder, and the earlier steps whose outputs each reads (in this
    run, or ok in the `resumed` record); then, when nothing else is wrong, room on the disk and in memory (its
    estimate returned, to be recorded)."""
    selected = [step for step in specs() if step.name in config.steps]
    problems = Problems()
    if config.device == "cuda":  # asked for, not available: refused now, not found out mid-run
        from workbench.runners.onnxruntime import providers_for

        problems.check(providers_for, "cuda")
    problems.check(load_corpus, config.corpus, config.corpus_max_texts)
    for step in selected:
        if step.check is not None:
            problems.check(step.check, config)
    needs = {need for step in selected for need in step.needs}
    for need in NEEDS:  # in this order: the model first, it is what most runs get wrong
        if need in needs:
            problems.check(CHECKS[need], config)
    problems.check(check_reads, selected, config, resumed)
    estimate = None
    if not problems.found:
        problems.check(check_disk, config, selected)
        estimate = problems.check(check_memory, config, selected)
    problems.raise_all()
    return estimate


def preflight_apart(config: RunConfig, resumed: RunRecord | None = None) -> MemoryEstimate | None:
    """`preflight` in a child process: what it loads to read the model (transformers, and torch with it: 0.4 GB)
    goes with the child instead of staying in the process that waits on the steps' kernels for the whole run."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
        return child.submit(preflight, config, resumed).result()


def check_disk(config: RunConfig, selected: list[StepSpec]) -> None:
    """The run's folder has room for what the selected steps leave (their declared multiples of the model's weight
    bytes) and, while a step writes graphs, one candidate graph more; unknown for a hub id, so not checked."""
    from workbench.models.loading import resolve_source, weight_bytes

    weights = weight_bytes(resolve_source(config.model))
    writes = [step.writes for step in selected]
    if weights and config.output_dir and any(writes):
        needed = int(weights * (sum(writes) + (1.0 if max(writes) >= 1.0 else 0.0)))
        require_free(Path(config.output_dir), needed, f"this run ({', '.join(s.name for s in selected)})")


def check_memory(config: RunConfig, selected: list[StepSpec]) -> MemoryEstimate | None:
    """The memory this process tree may hold (its cgroup's limit, else the machine's) covers what each selected step
    peaks at: a step holding the model `footprint.step_need` of its weights, another what it declares (`memory`);
    refused where one does not fit, unless `preflight.memory` is warn; a hub id's weights are unknown, not checked."""
    from workbench.core.memory import memory_limit
    from workbench.models.footprint import model_step
    from workbench.models.loading import resolve_source, weight_bytes

    weights = weight_bytes(resolve_source(config.model))
    needs = [step.memory(config) if step.memory is not None else model_step(step.name, weights)
             for step in selected if step.memory is not None or ("model" in step.needs and weights)]
    if not needs:
        return None
    limit, source = memory_limit()
    estimate = MemoryEstimate.of(needs, limit, source, warn=config.preflight.memory == "warn")
    if estimate.verdict == "refused":
        over = {need.step for need in needs if need.need > limit}
        fitting: list[str] = []  # the steps that fit and whose inputs come from steps that fit too
        for step in selected:
            if step.name not in over and all(earlier in fitting for earlier in step.reads):
                fitting.append(step.name)
        others = f", or run the others alone (--steps {','.join(fitting)})" if fitting else ""
        raise OutOfMemoryError(
            f"this run's {estimate.describe()}",
            f"run it where it has more memory (another host, or a higher cgroup limit){others}; or, if you know it "
            "fits, go on anyway with -p preflight.memory=warn (a step that runs out still stops with this error's "
            "kind)")
    return estimate


def check_reads(selected: list[StepSpec], config: RunConfig, resumed: RunRecord | None) -> None:
    """Each selected step's `reads`: in this run, or ok (or stale) in the resumed record."""
    for step in selected:
        for earlier in step.reads:
            if earlier in config.steps or (resumed and resumed.status(earlier) in (StepStatus.OK, StepStatus.STALE)):
                continue
            raise MissingArtifactError(
                f"the {step.name} step reads what the {earlier} step writes, and {earlier} is neither in --steps "
                f"nor done in {'the run being resumed' if resumed else 'this new run'}",
                f"add {earlier} to --steps, or --resume a run folder where {earlier} is ok")


def check_ports(config: RunConfig) -> None:
    from workbench.serving.server import Ports

    triton = TritonSettings.of(config)
    Ports.pick(triton.http_port, triton.grpc_port, triton.metrics_port)


def check_repository(config: RunConfig) -> None:
    from workbench.serving.plan import repository_root

    ensure_writable(repository_root(TritonSettings.of(config).repository_dir), "triton.repository_dir")


def check_model_limits(config: RunConfig) -> None:
    """The model resolves, its architecture suits the task (and its weights hold the task's head), its
    sentence-transformers pipeline (feature extraction) can be exported and agrees with `pooling`, and `sequence`
    fits its limits: every problem found, in one refusal."""
    from workbench.models.loading import (
        check_decoder_padding,
        check_pooling_task,
        check_supported,
        check_task_head,
        load_config,
        load_tokenizer,
        resolve_source,
        sequence_limit,
    )
    from workbench.models.sentence import check_head, graph_pooling, read_pipeline, with_truncation
    from workbench.tasks.registry import PIPELINE_TASKS, TASKS

    source = resolve_source(config.model)
    hf_config = load_config(source, config.trust_remote_code)
    task, problems = TASKS[config.task_choice.name], Problems()
    problems.check(check_pooling_task, config)
    pipeline = problems.check(read_pipeline, source.location, config.trust_remote_code, task.name) \
        if task.name in PIPELINE_TASKS else None
    pipeline = with_truncation(pipeline, config.truncate_dim) if pipeline is not None else None
    problems.check(check_supported, hf_config, task, pipeline is not None and pipeline.declared)
    if not any(isinstance(p, UnsupportedModelError) for p in problems.found):  # an architecture that has the task
        problems.check(check_task_head, source, hf_config, task)
    if pipeline is not None:
        mode = problems.check(graph_pooling, pipeline, config.pooling, config.pooling_override,
                              int(hf_config.hidden_size))
        if mode is not None:  # the modules after the transformer run and trace (the model's own code included)
            problems.check(check_head, pipeline, mode, int(hf_config.hidden_size), config.trust_remote_code)
    tokenizer = problems.check(load_tokenizer, source, config.trust_remote_code)
    if tokenizer is not None and pipeline is not None and pipeline.declared:  # a decoder embedder's padding
        problems.check(check_decoder_padding, hf_config, tokenizer)
    if tokenizer is not None:
        limit = sequence_limit(hf_config, tokenizer, pipeline)
        problems.check(config.sequence.resolve, limit.tokens, limit.source)
    problems.raise_all()


CHECKS: dict[str, Callable[[RunConfig], None]] = {
    "model": check_model_limits, "ports": check_ports, "repository": check_repository}

"""Checks that take seconds, run before the first kernel starts: a bad setting fails the run at once, not after
minutes of export and optimization."""
from __future__ import annotations

from workbench.core.batches import check_sequence_limit
from workbench.core.config import RunConfig
from workbench.core.data import load_corpus
from workbench.core.record import ensure_writable

MODEL_STEPS = ("export", "optimize", "parity", "tensorrt", "triton", "bench")
SERVING_STEPS = ("triton", "generation", "bench")


def preflight(config: RunConfig) -> None:
    """device: cuda, opset, corpus, the model's sequence limit, ports and the repository folder, for the steps that
    use them."""
    from workbench.serving.plan import repository_root
    from workbench.serving.server import Ports
    from workbench.steps.export import check_opset

    steps = set(config.steps)
    if config.device == "cuda":  # asked for, not available: refused now, not found out mid-run
        from workbench.runners.onnxruntime import providers_for

        providers_for("cuda")
    if "export" in steps:
        check_opset(config.exporter, config.opset)
    load_corpus(config.corpus)
    if steps & set(MODEL_STEPS):
        check_model_limits(config)
    if steps & set(SERVING_STEPS):
        Ports.pick(config.triton.http_port, config.triton.grpc_port, config.triton.metrics_port)
    if steps & {"triton", "generation"}:
        ensure_writable(repository_root(config), "triton.repository_dir")


def check_model_limits(config: RunConfig) -> None:
    """The model resolves, its architecture suits the task, its sentence-transformers pipeline (feature extraction)
    can be exported and agrees with `pooling`, and sequence.max fits its limits."""
    from workbench.core.tasks import TASKS
    from workbench.models.loading import check_supported, load_config, load_tokenizer, resolve_source, sequence_limit
    from workbench.models.sentence import graph_pooling, read_pipeline

    source = resolve_source(config.model)
    hf_config = load_config(source, config.trust_remote_code)
    check_supported(hf_config, TASKS[config.task])
    pipeline = read_pipeline(source.location) if config.task == "feature-extraction" else None
    if pipeline is not None:
        graph_pooling(pipeline, config.pooling, config.pooling_override)
    tokenizer = load_tokenizer(source, config.trust_remote_code)
    check_sequence_limit(config.sequence, sequence_limit(hf_config, tokenizer, pipeline))

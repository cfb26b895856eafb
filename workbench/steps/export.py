"""The export step: PyTorch -> ONNX with dynamic batch and sequence axes, checked by onnx.checker."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import plotly.graph_objects as go

from workbench.core.atomic import atomic_dir
from workbench.core.config import RunConfig
from workbench.core.data import load_corpus
from workbench.core.record import RunRecord, StepEntry
from workbench.graphs import onnxfiles
from workbench.graphs.errors import ExportError, OpsetError
from workbench.graphs.tables import ExportMetrics
from workbench.models.loading import LoadedModel, load_model, traceable_masks
from workbench.models.quiet import quiet_tracer
from workbench.models.tables import PipelineSummary
from workbench.models.text import encode
from workbench.report import figures
from workbench.report.page import Parts, Section
from workbench.steps import StepSpec
from workbench.tasks.registry import BATCH, SEQUENCE, OutputSpec

if TYPE_CHECKING:
    import torch

    from workbench.runners.torch import GraphModule

STEP = "export"
# Opsets each exporter writes natively (torch.onnx limits; dynamo starts at 18).
OPSET_RANGES = {"legacy": (7, 20), "dynamo": (18, 23)}


def check_opset(exporter: str, opset: int) -> None:
    low, high = OPSET_RANGES[exporter]
    if not low <= opset <= high:
        raise OpsetError(
            f"opset {opset} is outside the {exporter} exporter's range {low}-{high}",
            f"set opset between {low} and {high} (17 is a good default for legacy, 18 for dynamo)",
        )


def sample_inputs(loaded: LoadedModel) -> dict[str, torch.Tensor]:
    """Two real texts of different lengths, so no axis is traced as a constant 1."""
    import torch

    corpus = load_corpus()
    texts = [corpus[0], max(corpus[:50], key=len)]
    arrays = encode(loaded.tokenizer, texts, loaded.input_names, max_length=64)
    return {name: torch.from_numpy(array) for name, array in arrays.items()}


def export_onnx(loaded: LoadedModel, config: RunConfig, dest: Path) -> Any:
    """Write `dest` with torch.onnx.export and return the loaded ModelProto (without weights)."""
    import torch

    from workbench.runners.torch import GraphModule

    outputs = config.output_specs
    module = GraphModule(loaded, outputs).eval()
    inputs = sample_inputs(loaded)
    args = tuple(inputs[name] for name in loaded.input_names)
    output_names = [o.name for o in outputs]
    large = sum(p.numel() * p.element_size() for p in loaded.model.parameters()) > onnxfiles.EXTERNAL_DATA_THRESHOLD
    with onnxfiles.onnx_destination(dest) as tmp, torch.no_grad(), _export_errors(loaded, config), \
            traceable_masks():
        if config.exporter == "dynamo":
            from torch.export import Dim

            batch, sequence = Dim(BATCH), Dim(SEQUENCE, max=loaded.max_positions or 4096)
            torch.onnx.export(module, args, str(tmp), dynamo=True, opset_version=config.opset,
                              input_names=list(loaded.input_names), output_names=output_names,
                              dynamic_shapes={"inputs": tuple({0: batch, 1: sequence} for _ in loaded.input_names)},
                              external_data=large, optimize=True)
        else:
            axes = {n: {0: BATCH, 1: SEQUENCE} for n in loaded.input_names}
            axes.update({o.name: o.dynamic_axes for o in outputs})
            with quiet_tracer():
                torch.onnx.export(module, args, str(tmp), dynamo=False, opset_version=config.opset,
                                  input_names=list(loaded.input_names), output_names=output_names,
                                  dynamic_axes=axes, do_constant_folding=True)
        onnxfiles.one_data_file(tmp)  # over 2 GB the exporter writes a file per tensor
        onnxfiles.fix_output_dims(tmp, fixed_sizes(module, args, outputs))
        onnxfiles.check(tmp)
    return onnxfiles.skeleton(dest)


def fixed_sizes(module: GraphModule, args: tuple[torch.Tensor, ...], outputs: tuple[OutputSpec, ...]
                ) -> dict[str, dict[int, int]]:
    """Per output, the size of every axis that is not dynamic, from one run of the module on the sample."""
    results = module(*args)
    return {spec.name: {axis: int(result.shape[axis]) for axis in range(result.dim())
                        if axis not in spec.dynamic_axes} for spec, result in zip(outputs, results)}


@contextmanager
def _export_errors(loaded: LoadedModel, config: RunConfig) -> Iterator[None]:
    """torch.onnx's refusal to export this family with these settings, as a typed error naming the reason."""
    import torch

    try:
        yield
    except torch.onnx.OnnxExporterError as exc:
        reason = str(exc).strip().splitlines()[0]
        raise ExportError(
            f"torch.onnx ({config.exporter} exporter, opset {config.opset}) cannot export {loaded.architecture!r}: "
            f"{reason}",
            "raise the opset (-p opset=17), or try -p exporter=dynamo -p opset=18, or -p attn_implementation=eager",
        ) from None


def run(config: RunConfig, record: RunRecord) -> StepEntry:
    """Export the configured model for its task (said first: which and why); record the graph, the tokenizer folder
    and export metrics."""
    with record.step(STEP):
        task = config.task_choice
        record.found(task_line(task.name, task.reason))
        check_opset(config.exporter, config.opset)
        start = time.perf_counter()
        record.phase(f"loading {config.model} with transformers")
        loaded = load_model(config)
        load_seconds = time.perf_counter() - start
        with atomic_dir(record.run_dir / "model") as tmp:
            loaded.tokenizer.save_pretrained(tmp)
            loaded.hf_config.save_pretrained(tmp)
        record.add_artifact("tokenizer", record.run_dir / "model", kind="tokenizer", source=loaded.source.kind)
        start = time.perf_counter()
        dest = record.run_dir / "onnx" / "original.onnx"
        record.phase(f"exporting with torch.onnx ({config.exporter} exporter, opset {config.opset}), then onnx.checker")
        graph = export_onnx(loaded, config, dest)
        metrics = {
            "source": {"kind": loaded.source.kind, "location": loaded.source.location},
            "task": task.name,
            "task_reason": task.reason,
            "architecture": loaded.architecture,
            "optimizer_model_type": loaded.optimizer_model_type,
            "num_heads": loaded.num_heads,
            "hidden_size": loaded.hidden_size,
            "num_layers": int(loaded.hf_config.num_hidden_layers),
            "intermediate_size": loaded.intermediate_size,
            "max_positions": loaded.max_positions,
            "max_sequence": loaded.max_sequence,
            "max_sequence_source": loaded.limit.source,
            "sequence": {**loaded.sequence.model_dump(), "sources": config.sequence.sources(loaded.limit.source)},
            **({"sentence_pipeline": loaded.pipeline.describe(loaded.pooling, loaded.pooling_overridden).recorded()}
               if loaded.pipeline else {}),
            "parameters": sum(p.numel() for p in loaded.model.parameters()),
            "exporter": config.exporter,
            "opset": config.opset,
            "nodes": len(graph.graph.node),
            "io": onnxfiles.io_shapes(graph),
            "load_seconds": round(load_seconds, 3),
            "export_seconds": round(time.perf_counter() - start, 3),
        }
        record.add_artifact("onnx.original", dest, kind="onnx", variant="original", precision="fp32")
        record.set_metric(STEP, metrics)
    return record.step_entry(STEP)


def lines(record: RunRecord) -> list[str]:
    info = record.needed(ExportMetrics)
    dynamic = [name for name, axes in info.io.inputs.items() if axes[:2] == ["batch", "sequence"]]
    size = f"{info.parameters:,} parameters" if info.parameters is not None else "the model"
    lines = [task_line(info.task, info.task_reason)] if info.task and info.task_reason else []
    lines += [f"{info.architecture}: {size} exported to ONNX opset {info.opset} "
              f"({info.nodes} nodes, onnx.checker passed); batch and sequence axes dynamic on "
              f"{len(dynamic)} of {len(info.io.inputs)} inputs"]
    sequence = info.sequence
    if sequence:
        lines.append(f"tokens per text: {sequence.min}-{sequence.max} (opt {sequence.opt}); max "
                     f"{sequence.sources.get('max', '')}; the model takes {info.max_sequence}")
    pipeline = info.sentence_pipeline
    if pipeline:
        override = f"; {pipeline.override}" if pipeline.override else ""
        options = ["lowercased first (do_lower_case)"] if pipeline.do_lower_case else []
        if not pipeline.include_prompt:
            options.append("pooled without the prompt's tokens (include_prompt: false)")
        lines.append(f"in the graph: {' -> '.join(pipeline.steps)} "
                     f"({'from modules.json' if pipeline.declared else 'no sentence-transformers files'}), "
                     f"similarity {pipeline.similarity}{override}"
                     + "".join(f"; {option}" for option in options))
    return lines


def task_line(task: str, reason: str) -> str:
    """The task the graph is exported for and why, in words."""
    return f"task {task}: {reason}"


def pipeline_text(pipeline: PipelineSummary, run_max: int | None = None) -> str:
    """The sentence-transformers pipeline the graph runs, the similarity function the model declares, and where
    texts are cut: the model's maximum and, where it differs, this run's (`run_max`, sequence.max)."""
    prompts = ", ".join(f"{name} ({text!r})" for name, text in pipeline.prompts.items()) or "none"
    default = f", default {pipeline.default_prompt_name}" if pipeline.default_prompt_name else ""
    override = f" OVERRIDDEN: {pipeline.override}." if pipeline.override else ""
    return (f"The graph runs {' -> '.join(pipeline.steps)} ({pipeline.source}), so its sentence_embedding is "
            f"what SentenceTransformer.encode() returns.{override} Similarity function the model declares: "
            f"{pipeline.similarity}. Prompts (request parameter prompt_name): {prompts}{default}. Maximum "
            f"sequence length: {pipeline.max_seq_length or 'the tokenizer and position table'}"
            + (f"; this run cuts texts at {run_max} tokens (sequence.max)" if run_max and run_max !=
               pipeline.max_seq_length else "") + ".")


def section(export: ExportMetrics) -> Parts:
    if not export.sentence_pipeline:
        return []
    run_max = export.sequence.max if export.sequence else None
    return [("The model as its users run it", pipeline_text(export.sentence_pipeline, run_max), [])]


def io_table(export: ExportMetrics) -> go.Figure:
    """Graph inputs and outputs with their symbolic shapes."""
    sides = (("input", export.io.inputs), ("output", export.io.outputs))
    rows = [(kind, name, " x ".join(map(str, shape))) for kind, found in sides for name, shape in found.items()]
    exporter = {"legacy": "TorchScript", "dynamo": "torch.export"}.get(export.exporter, export.exporter)
    title = f"{export.architecture} exported by torch.onnx ({exporter}, opset {export.opset}): {export.nodes} nodes"
    return figures.table(title, ["", "name", "shape"], rows)


SPEC = StepSpec(
    STEP, 1, "PyTorch -> ONNX with dynamic batch and sequence axes", run, lines,
    sections=(Section("The model as its users run it", section),),
    needs=("model",), check=lambda config: check_opset(config.exporter, config.opset),
    machine=("torch", "transformers", "onnx"), owns=("model", "onnx"), writes=1.0,
    metrics=ExportMetrics)

"""The optimize step: the variants the deployment may serve, one module per job. ONNX Runtime's fused fp32 graph and
its fp16 and int8 (`onnxruntime_variants`), the shapes TensorRT reads, OpenVINO's fp32, bf16 and NNCF int8 tried
against them (`openvino_variants`), and which reduced precisions are built and kept (`precisions`). Every race of
the step times one bench (`measure.forms.race_bench`), built once."""
from __future__ import annotations

import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from workbench.core.config import RunConfig
from workbench.core.record import RunRecord, StepEntry
from workbench.graphs import onnxfiles
from workbench.graphs.attention import ATTENTION_OPS
from workbench.graphs.settings import OptimizeSettings
from workbench.graphs.tables import Borrowed, ExportMetrics, FormChoice, GraphStats, OptimizeMetrics
from workbench.graphs.variants import convert_fp16, infer_shapes, quantize_int8
from workbench.measure.forms import race_bench
from workbench.measure.settings import BenchSettings
from workbench.models.footprint import release_memory
from workbench.report.page import Parts, Section
from workbench.steps import StepSpec
from workbench.steps.optimize import figures
from workbench.steps.optimize.onnxruntime_variants import build_fp32, fusion_stats, smoke_test, unavailable_fusions
from workbench.steps.optimize.openvino_variants import (
    build_openvino,
    build_openvino_bf16,
    build_openvino_int8,
    check,
    openvino_bf16_line,
    openvino_int8_line,
    openvino_line,
)
from workbench.steps.optimize.precisions import decide_precisions, measure_against_fp32

if TYPE_CHECKING:
    from onnx import ModelProto

STEP = "optimize"


PHASES = {"fp32": "ONNX Runtime's transformer fusions", "fp16": "fp16 conversion of the fp32 graph",
          "int8": "ONNX Runtime's dynamic int8 quantization", "tensorrt": "shapes inferred for TensorRT"}


@contextmanager
def unrecorded_removed(folder: Path, variants: Sequence[str]) -> Iterator[None]:
    """On an error or interrupt, the variants' ONNX files under `folder` go: the failed step's record drops what it
    recorded, and what was built but not yet recorded goes with it."""
    try:
        yield
    except BaseException:
        for variant in variants:
            onnxfiles.remove(folder / f"{variant}.onnx")
        raise


def run(config: RunConfig, record: RunRecord) -> StepEntry:
    """Write the optimized variants the configuration (or, for `precisions: auto`, the deployment's target and a
    measurement here) asks for; their fusion counts in metrics.optimize.variants, the decisions in
    metrics.optimize.precisions."""
    with record.step(STEP):
        export = record.needed(ExportMetrics)
        original = record.artifact("onnx.original")
        layers = export.num_layers
        onnx_dir = record.run_dir / "onnx"
        unfused = fusion_stats(onnxfiles.skeleton(original))
        form: FormChoice | None = None
        borrowed: Borrowed | None = None
        target, decisions = decide_precisions(config, record)
        settings = OptimizeSettings.of(config)
        bench = race_bench(BenchSettings.of(config), list(config.texts()), config.device, config.threads,
                           record.tokenizer(), export)  # every race of the step times these feeds

        def fp32(dest: Path) -> ModelProto:
            nonlocal form, borrowed
            model, form, borrowed = build_fp32(original, dest, export, config, bench, target)
            return model

        shapes_by = None

        def tensorrt(dest: Path) -> ModelProto:
            nonlocal shapes_by
            model, shapes_by = infer_shapes(original, dest)
            return model

        builders = {
            "fp32": fp32,
            "fp16": lambda dest: convert_fp16(onnx_dir / "fp32.onnx", dest, settings.fp16.op_block_list,
                                              settings.fp16.node_block_list),
            "int8": lambda dest: quantize_int8(onnx_dir / "fp32.onnx", dest, settings.int8.per_channel,
                                               settings.int8.nodes_to_exclude),
            "tensorrt": tensorrt,
        }
        wanted = ["fp32", *[p for p, decision in decisions.items() if decision.built], "tensorrt"]
        built: dict[str, GraphStats] = {}
        with unrecorded_removed(onnx_dir, wanted):  # an interrupt leaves no file the record lacks
            for variant in wanted:
                record.phase(f"building {variant}: {PHASES[variant]}")
                start = time.perf_counter()
                dest = onnx_dir / f"{variant}.onnx"
                model = builders[variant](dest)
                fused = variant != "tensorrt"
                stats = fusion_stats(model, layers, unavailable_fusions(export, borrowed)) if fused else \
                    fusion_stats(model)
                stats.seconds = round(time.perf_counter() - start, 3)
                stats.megabytes = round(dest.stat().st_size / 1e6, 2)
                if variant == "fp32":
                    stats.form, stats.borrowed = form, borrowed
                if variant == "tensorrt":
                    stats.shapes = shapes_by
                built[variant] = stats
                del model
                release_memory()  # a base-size graph and its copies: 1-2 GB the next build may need
            timed = {p: onnx_dir / f"{p}.onnx" for p in decisions if p in built}
            if timed and target.measured:
                record.phase(f"timing {', '.join(timed)} against fp32 (does it pay on this host?)")
                measure_against_fp32(config, onnx_dir / "fp32.onnx", decisions, timed, bench)
            for variant, stats in built.items():
                dest = onnx_dir / f"{variant}.onnx"
                if variant in decisions and not decisions[variant].built:
                    onnxfiles.remove(dest)  # measured here and found not to pay
                    continue
                if variant != "tensorrt":
                    stats.smoke_test = smoke_test(record, config, variant, dest)
                if stats.warning:
                    warnings.warn(f"{variant}: {stats.warning}", stacklevel=2)
                precision = "fp32" if variant in ("fp32", "tensorrt") else variant
                record.add_artifact(f"onnx.{variant}", dest, kind="onnx", variant=variant, precision=precision)
                record.set_metric(f"{STEP}.variants.{variant}", stats.recorded())
        record.set_metric(f"{STEP}.precisions.decisions", {p: d.recorded() for p, d in decisions.items()})
        record.set_metric(f"{STEP}.openvino", build_openvino(config, record, bench, target).recorded())
        record.set_metric(f"{STEP}.openvino_bf16", build_openvino_bf16(config, record, bench, target).recorded())
        record.set_metric(f"{STEP}.openvino_int8", build_openvino_int8(config, record, export, bench, target,
                                                                       decisions.get("int8")).recorded())
        record.set_metric(f"{STEP}.variants.original", unfused.recorded())
    return record.step_entry(STEP)


def lines(record: RunRecord) -> list[str]:
    optimize = record.results_as(STEP, OptimizeMetrics) or OptimizeMetrics()
    export = record.needed(ExportMetrics)
    variants, layers = optimize.variants, export.num_layers
    fp32 = variants.get("fp32") or GraphStats(nodes=0)
    attention = sum(fp32.fused.get(op, 0) for op in ATTENTION_OPS)
    fused = (f"Attention fused in {attention} of {layers} layers" if layers else f"{attention} Attention nodes fused")
    unavailable = fp32.unavailable
    if unavailable and "Attention" in unavailable.fusions:
        fused = f"no attention fusion for this family: {unavailable.reason}"
    borrowed = fp32.borrowed
    if borrowed and borrowed.kept:
        fused += f" ({borrowed.rules}'s rules borrowed, attention {borrowed.attention}; {borrowed.reason})"
    sizes = ", ".join(f"{name} {size:.3g} MB" for name, size in record.variant_megabytes().items())
    lines = [f"{fused}; fp32 graph {export.nodes} -> {fp32.nodes if 'fp32' in variants else None} nodes",
             f"variants in this run (as in the table): {sizes}"]
    decisions = optimize.precisions.decisions if optimize.precisions else {}
    lines += [f"{precision} {'built' if d.built else 'not built'}: {d.reason}" for precision, d in decisions.items()]
    if fp32.form:
        lines.append(f"layer norms {fp32.form.chosen}: {fp32.form.reason}")
    if optimize.openvino:
        lines.append(openvino_line(optimize.openvino, record.run_dir))
    if optimize.openvino_bf16:
        lines.append(openvino_bf16_line(optimize.openvino_bf16, record.run_dir))
    if optimize.openvino_int8:
        lines.append(openvino_int8_line(optimize.openvino_int8, record.run_dir))
    return lines


def section(optimize: OptimizeMetrics) -> Parts:
    if not optimize.variants:
        return []
    decisions = optimize.precisions.decisions if optimize.precisions else {}
    decided = " ".join(f"{precision} {'built' if d.built else 'not built'}: {d.reason}."
                       for precision, d in decisions.items())
    text = "Fused operators and node counts per variant." + (f" {decided}" if decided else "")
    parts: Parts = [("ONNX Runtime fusions", text, [figures.fusion_figure(optimize.variants)])]
    if optimize.openvino:
        parts.append(("OpenVINO, tried against the fp32 graph", f"{openvino_line(optimize.openvino, None)}.", []))
    if optimize.openvino_bf16:
        parts.append(("OpenVINO bf16, raced against the fastest fp32 graph",
                      f"{openvino_bf16_line(optimize.openvino_bf16, None)}.", []))
    if optimize.openvino_int8:
        parts.append(("OpenVINO int8 (NNCF), raced against the fastest graph",
                      f"{openvino_int8_line(optimize.openvino_int8, None)}.", []))
    return parts


SPEC = StepSpec(
    STEP, 2, "ONNX Runtime fusions, fp16, int8, symbolic shapes; OpenVINO variants raced", run, lines,
    sections=(Section("ONNX Runtime fusions", section),),
    needs=("model",), reads=("export",), machine=("onnx", "onnxruntime"), writes=2.8, check=check,
    lighter="fewer precisions (-p precisions=[fp32,int8]), no OpenVINO variants (-p optimize.openvino=never)",
    metrics=OptimizeMetrics, after="export", settings=OptimizeSettings,
    first_reads=("precisions", "target", "corpus", "corpus_max_texts"))


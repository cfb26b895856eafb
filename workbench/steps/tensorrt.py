"""The tensorrt step: shape profiles from token lengths, engines via trtexec or the Python API, cached by key."""
from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
from pydantic import Field, field_validator

from workbench.core.atomic import atomic_path, sha256_file, write_text
from workbench.core.config import RunConfig, StepSettings, from_here
from workbench.core.machine import GPU_FINDING, gpu_name
from workbench.core.record import RunRecord, StepEntry
from workbench.graphs import onnxfiles
from workbench.graphs.engines import (
    EngineSpec,
    build_engine,
    cache_key,
    original_nodes_for,
    ort_tensorrt_options,
    require_tensorrt,
    trtexec_command,
)
from workbench.graphs.profiles import design_profiles, padding_waste
from workbench.graphs.settings import OptimizeSettings
from workbench.graphs.tables import (
    EngineBuild,
    EngineRecord,
    ExportMetrics,
    Histogram,
    LengthStats,
    ShapeProfile,
    TensorrtMetrics,
)
from workbench.models.batches import token_lengths
from workbench.precision.tables import ParityMetrics
from workbench.report import figures
from workbench.report.page import Parts, Section
from workbench.serving.settings import lab_settings
from workbench.steps import StepSpec

STEP = "tensorrt"


class TensorrtSettings(StepSettings):
    """The tensorrt step: shape profiles, the builder's workspace, the engine cache."""

    profiles: int = Field(default=2, ge=1, le=8, description="TensorRT profiles (sequence-length buckets)")
    workspace_mb: int = Field(default=4096, ge=64)
    engine_cache_dir: str | None = Field(default=None, description="default: ~/.cache/transformer-workbench/tensorrt")
    _cache_here = field_validator("engine_cache_dir")(staticmethod(from_here))


def default_cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "transformer-workbench" / "tensorrt"


def length_stats(lengths: np.ndarray, bins: int = 40) -> LengthStats:
    counts, edges = np.histogram(lengths, bins=bins)
    return LengthStats(count=int(lengths.size), min=int(lengths.min()), max=int(lengths.max()),
                       percentiles={f"p{q}": float(np.percentile(lengths, q)) for q in (50, 90, 95, 99)},
                       histogram=Histogram(counts=counts.tolist(), edges=edges.tolist()))


def fp16_repair_pins(record: RunRecord) -> list[str]:
    """Nodes the parity step's fp16 repair kept in fp32 (none when it did not run or found no repair)."""
    parity = record.results_as("parity", ParityMetrics)
    fp16 = parity.repair.get("fp16") if parity else None
    return list(fp16.chosen.blocked) if fp16 and fp16.chosen else []


def fp16_pins(config: RunConfig, record: RunRecord) -> dict[str, list[str]]:
    """Nodes of the exported graph to keep fp32 in the fp16 engine: the configured block list and what the parity
    step's fp16 repair found (if it ran), mapped from the fused ORT graph back to the exported one."""
    wanted = list(dict.fromkeys([*OptimizeSettings.of(config).fp16.node_block_list, *fp16_repair_pins(record)]))
    if not wanted:
        return {}
    optimized = onnxfiles.skeleton(record.artifact("onnx.fp32"))
    original = onnxfiles.skeleton(record.artifact("onnx.tensorrt"))
    return original_nodes_for(wanted, optimized, original)


def engine_specs(config: RunConfig, profiles: list[ShapeProfile], pins: dict[str, list[str]]) -> list[EngineSpec]:
    """An fp32 and an fp16 engine (those of a configured precisions list): a TensorRT engine is for a GPU, where fp16
    serves."""
    pinned = list(dict.fromkeys(n for nodes in pins.values() for n in nodes))
    wanted = ("fp32", "fp16") if config.precisions == "auto" else config.precisions
    return [EngineSpec(f"trt_{p}", p, profiles, pinned if p == "fp16" else [], TensorrtSettings.of(config).workspace_mb)
            for p in ("fp32", "fp16") if p in wanted]


def write_build_script(record: RunRecord, commands: dict[str, list[str]]) -> Path:
    lines = ["#!/usr/bin/env bash",
             "# Build the engines of this run with trtexec on an NVIDIA GPU host (TensorRT installed).",
             "# The workbench builds the same engines with the Python API: "
             "workbench run --resume --output-dir <this run> --steps tensorrt",
             "set -euo pipefail", 'cd "$(dirname "$0")/.."', "mkdir -p engines/reports"]
    for name, command in commands.items():
        lines += [f"echo '== {name}'", " \\\n    ".join(shlex.quote(part) if " " in part else part
                                                       for part in command)]
    return write_text(record.run_dir / "engines" / "build_engines.sh", "\n".join(lines) + "\n")


def build_or_reuse(spec: EngineSpec, source: Path, input_names: tuple[str, ...], cache_dir: Path,
                   dest: Path) -> EngineBuild:
    """Build the engine unless the cache holds one for the same key; link (or copy) it into the run."""
    trt = require_tensorrt()
    key = cache_key(sha256_file(source), trt.__version__, gpu_name() or "", spec)
    cached = cache_dir / f"{key}.plan"
    info = EngineBuild(key=key, cache_hit=cached.is_file(), cache=str(cached))
    if not cached.is_file():
        built = build_engine(source, spec, input_names, cache_dir / "timing.cache")
        with atomic_path(cached) as tmp:
            tmp.write_bytes(built.engine)
        info.pinned_layers, info.seconds, info.tensorrt = built.pinned_layers, built.seconds, built.tensorrt
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.unlink(missing_ok=True)
    try:
        os.link(cached, dest)
    except OSError:
        shutil.copyfile(cached, dest)
    return info


def check_engines(config: RunConfig, record: RunRecord, built: dict[str, tuple[Path, EngineSpec]],
                  metrics: TensorrtMetrics) -> None:
    """Compare each engine with PyTorch on the parity lab; results in metrics.tensorrt.parity.<engine>."""
    from workbench.models.loading import load_model
    from workbench.precision.lab import ParityLab, lab_texts
    from workbench.runners.tensorrt import TrtEngineRunner

    loaded = load_model(config)
    lab = ParityLab.build(lab_settings(config), loaded, lab_texts(lab_settings(config), loaded))
    for name, (path, spec) in built.items():
        with TrtEngineRunner(name, path, spec.profiles, spec.precision) as runner:
            metrics.parity = {**metrics.parity, name: lab.compare(runner, spec.precision)}
            record.set_metric(STEP, metrics.recorded())


def run(config: RunConfig, record: RunRecord) -> StepEntry:
    """Design profiles and write build commands everywhere; build and check engines where a GPU and TensorRT are."""
    with record.step(STEP):
        export = record.needed(ExportMetrics)
        source = record.artifact("onnx.tensorrt")
        tokenizer = record.tokenizer()
        lengths = token_lengths(tokenizer, list(config.texts()))
        sequence = export.sequence_range
        max_tokens, max_tokens_source = export.token_budget(config.batch, sequence.max)
        profiles = design_profiles(lengths, TensorrtSettings.of(config).profiles, config.batch, sequence, max_tokens)
        single = design_profiles(lengths, 1, config.batch, sequence, max_tokens)
        metrics = TensorrtMetrics.model_validate({
            "lengths": length_stats(lengths).recorded(),
            "profiles": [p.recorded() for p in profiles], "max_tokens": max_tokens,
            "max_tokens_source": max_tokens_source,
            "padding_waste": {"1": padding_waste(lengths, single, config.batch.opt),
                              str(len(profiles)): padding_waste(lengths, profiles, config.batch.opt)},
        })
        record.set_metric(STEP, metrics.recorded())
        pins = fp16_pins(config, record)
        specs = engine_specs(config, profiles, pins)
        input_names = tuple(export.io.inputs)
        engines_dir = record.run_dir / "engines"
        cached = TensorrtSettings.of(config).engine_cache_dir
        cache_dir = Path(cached) if cached else default_cache_dir()
        commands = {spec.name: trtexec_command(source.relative_to(record.run_dir), Path(f"engines/{spec.name}.plan"),
                                               spec, input_names, Path("engines/timing.cache"),
                                               Path("engines/reports")) for spec in specs}
        script = write_build_script(record, commands)
        record.add_artifact("tensorrt.build_script", script, kind="script")
        metrics.fp16_pins = pins
        metrics.engines = {spec.name: EngineRecord(spec=spec.record(), trtexec=" ".join(commands[spec.name]),
                                                   ort_provider_options=ort_tensorrt_options(spec, input_names,
                                                                                             cache_dir))
                           for spec in specs}
        record.set_metric(STEP, metrics.recorded())
        built = {}
        for spec in specs:
            dest = engines_dir / f"{spec.name}.plan"
            metrics.engines[spec.name].build = build_or_reuse(spec, source, input_names, cache_dir, dest)
            record.add_artifact(f"engine.{spec.name}", dest, kind="engine", variant=spec.name,
                                precision=spec.precision, profiles=[p.recorded() for p in spec.profiles])
            built[spec.name] = (dest, spec)
            record.set_metric(STEP, metrics.recorded())
        check_engines(config, record, built, metrics)
    return record.step_entry(STEP)


def lines(record: RunRecord) -> list[str]:
    """The verdict line: the profiles' sequence ranges and the engines checked."""
    tensorrt = record.results_as(STEP, TensorrtMetrics) or TensorrtMetrics()
    shapes = "; ".join(f"sequence {p.sequence[0]}-{p.sequence[2]} (opt {p.sequence[1]}), batch {p.batch[0]}-"
                       f"{p.batch[2]} (opt {p.batch[1]})" for p in tensorrt.profiles)
    budget = f" within {tensorrt.max_tokens} padded tokens a batch" if tensorrt.max_tokens else ""
    checked = ", ".join(f"{name} {'pass' if v.passed else 'FAIL'}" for name, v in tensorrt.parity.items())
    return [f"{len(tensorrt.profiles)} shape profiles{budget}: {shapes}", f"engines checked: {checked or 'none'}"]


def section(tensorrt: TensorrtMetrics) -> Parts:
    """The report's token-length histogram, padding waste and engine checks."""
    if not tensorrt.profiles:
        return []
    parts: Parts = [("TensorRT shape profiles", "Profiles designed from the corpus token lengths.",
                     [length_histogram(tensorrt), padding_figure(tensorrt)])]
    if tensorrt.parity:
        parts.append(("TensorRT engines against PyTorch", "The same lab as the parity step.",
                      [figures.parity_table(tensorrt.parity)]))
    return parts


def length_histogram(tensorrt: TensorrtMetrics) -> go.Figure:
    """Token lengths of the corpus with the chosen profiles' sequence ranges and opt points."""
    hist = tensorrt.lengths.histogram if tensorrt.lengths else Histogram(counts=[], edges=[])
    edges = hist.edges
    figure = go.Figure(go.Bar(x=[(a + b) / 2 for a, b in zip(edges, edges[1:])], y=hist.counts,
                              width=[b - a for a, b in zip(edges, edges[1:])], name="texts"))
    for index, profile in enumerate(tensorrt.profiles):
        low, opt, high = profile.sequence
        figure.add_vrect(x0=low, x1=high, opacity=0.08, line_width=0, fillcolor="green" if index % 2 else "blue",
                         annotation_text=f"profile {index}: {low}-{high}", annotation_position="top left")
        figure.add_vline(x=opt, line_dash="dot", annotation_text=f"opt {opt}")
    figure.update_layout(title="Token lengths (special tokens included) and the TensorRT profiles",
                         xaxis_title="text length (tokens)", yaxis_title="texts (count)", showlegend=False)
    return figure


def padding_figure(tensorrt: TensorrtMetrics) -> go.Figure:
    """Share of padded token slots with one profile vs the length buckets."""
    waste = tensorrt.padding_waste
    figure = go.Figure()
    for label, share in (("batch padded to its longest", lambda w: w.dynamic),
                         ("padded to profile max", lambda w: w.to_profile_max)):
        figure.add_bar(name=label, x=[f"{k} profile(s)" for k in waste], y=[share(w) * 100 for w in waste.values()])
    figure.update_layout(title="Padding waste", xaxis_title="TensorRT profiles (length buckets)",
                         yaxis_title="padding (% of token slots)", barmode="group")
    return figure


SPEC = StepSpec(
    STEP, 4, "shape profiles from token lengths; TensorRT engines (GPU), cached and checked", run, lines,
    sections=(Section("TensorRT shape profiles", section),),
    needs=("model",), reads=("optimize",), machine=(GPU_FINDING, "tensorrt"), owns=("engines",), writes=0.5,
    metrics=TensorrtMetrics, after="parity", settings=TensorrtSettings, verdicts="parity")

"""The optimize step's ONNX Runtime variants: the fused fp32 graph (its layer-norm form raced here, or a family
without fusion rules fused with borrowed ones where that pays), fusion counts, and a smoke test of each variant."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from workbench.core.atomic import temporary_dir
from workbench.core.config import RunConfig
from workbench.core.data import load_corpus
from workbench.core.record import RunRecord
from workbench.graphs import onnxfiles
from workbench.graphs.attention import ATTENTION_OPS
from workbench.graphs.settings import OptimizeSettings
from workbench.graphs.tables import Borrowed, ExportMetrics, FormChoice, GraphStats, SmokeTest, Unavailable
from workbench.graphs.variants import GRAPH_FORMS, borrowed_fp32, optimize_fp32
from workbench.measure.forms import RaceBench, choose_borrowed, choose_form
from workbench.measure.precisions import Target
from workbench.models.batches import Batch
from workbench.models.families import BORROWED_RULES, with_fusion_rules
from workbench.models.footprint import release_memory
from workbench.models.text import encode
from workbench.runners.onnxruntime import OrtRunner, providers_for

if TYPE_CHECKING:
    from onnx import ModelProto

FUSED_OPS = (
    "EmbedLayerNormalization", "QEmbedLayerNormalization", "Attention", "MultiHeadAttention", "QAttention", "Gelu",
    "FastGelu", "BiasGelu",
    "GemmFastGelu", "LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization", "RotaryEmbedding", "DynamicQuantizeMatMul", "MatMulInteger",
    "DynamicQuantizeLinear",
)


# What ONNX Runtime's transformer optimizer fuses in every layer of the encoder families it has rules for.
TRANSFORMER_FUSIONS = ("EmbedLayerNormalization", "Attention", "SkipLayerNormalization", "BiasGelu")


# Fused operators that do one of those fusions' work (a tanh-approximated GELU fuses as FastGelu).
EQUIVALENT = {"Attention": ATTENTION_OPS, "BiasGelu": ("BiasGelu", "FastGelu", "GemmFastGelu")}


def fusion_stats(model: ModelProto, num_layers: int | None = None,
                 unavailable: Unavailable | None = None) -> GraphStats:
    """Node count, fused-operator counts and, given `num_layers`, whether every layer's attention fused; the
    fusions `unavailable` to this family replace the advice on unfused attention."""
    counts = onnxfiles.op_counts(model)
    stats = GraphStats(nodes=len(model.graph.node), fused={op: counts[op] for op in FUSED_OPS if counts.get(op)})
    if num_layers is None:
        return stats
    attention = sum(counts.get(op, 0) for op in ATTENTION_OPS)
    stats.attention_fused = attention >= num_layers
    if unavailable:
        stats.unavailable = unavailable
    elif attention < num_layers:
        stats.warning = (f"Attention fused in {attention} of {num_layers} layers: export with "
                         "attn_implementation=eager and exporter=legacy for full fusion")
    return stats


def unavailable_fusions(export: ExportMetrics, borrowed: Borrowed | None) -> Unavailable | None:
    """The transformer fusions a family without ONNX Runtime fusion rules does not get, and why (`borrowed`: the
    borrowed rules' outcome, None when not tried)."""
    if export.optimizer_model_type:
        return None
    none = (f"ONNX Runtime's transformer optimizer has no fusion rules for model type {export.architecture!r} "
            f"(it has them for {', '.join(with_fusion_rules())})")
    basic = ("the graph got ONNX Runtime's basic optimizations only (constant folding, redundant nodes removed), "
             "with standard ONNX operators")
    if borrowed is None:
        return Unavailable(fusions=list(TRANSFORMER_FUSIONS),
                           reason=f"{none}; {basic} (optimize.borrowed_rules=never)")
    if not borrowed.kept:
        return Unavailable(fusions=list(TRANSFORMER_FUSIONS), reason=f"{none}; {borrowed.rules}'s rules were tried "
                                                                    f"and not kept, {borrowed.reason}; {basic}")
    missing = [op for op in TRANSFORMER_FUSIONS  # attention must fuse in every layer; the others anywhere
               if sum(borrowed.fused.get(o, 0) for o in EQUIVALENT.get(op, (op,))) < (
                   export.num_layers if op == "Attention" else 1)]
    if not missing:
        return None
    return Unavailable(fusions=missing, reason=f"{none}; with {borrowed.rules}'s rules borrowed these did not fuse "
                                               f"(attention: {borrowed.attention})")


def attention_outcome(fused_ops: dict[str, int], layers: int, biased: int, rules: str) -> str:
    """How attention fused with borrowed `rules` (`fused_ops`: the graph's fused operator counts; `biased`: layers
    fused with their position bias), or why not."""
    fused = sum(fused_ops.get(op, 0) for op in ATTENTION_OPS)
    if fused >= layers:
        return (f"fused in {fused} of {layers} layers, the position bias passed as the attention op's "
                "attention_bias" if biased else f"fused in every layer by {rules}'s rules")
    return (f"fused in {fused} of {layers} layers: the others match neither {rules}'s pattern nor "
            "softmax(Q K^T / c + bias + mask) V with an additive bias")


def smoke_test(record: RunRecord, config: RunConfig, name: str, path: Path) -> SmokeTest:
    """Load the variant in ONNX Runtime and run two real texts through it."""
    tokenizer = record.tokenizer()
    with OrtRunner(name, path, providers_for(config.device), config.threads) as runner:
        feed = encode(tokenizer, list(load_corpus()[:2]), runner.input_names, max_length=64)
        outputs = runner.infer(Batch("smoke", [0, 1], feed))
    record.note_providers(runner.providers)
    return SmokeTest(providers=runner.providers, outputs={k: list(v.shape) for k, v in outputs.items()})


def build_fp32(original: Path, dest: Path, export: ExportMetrics, config: RunConfig, bench: RaceBench,
               target: Target) -> tuple[ModelProto, FormChoice | None, Borrowed | None]:
    """The fused fp32 graph in the layer-norm form `graph_form` sets, or (auto) the one that runs faster here
    (`forms`, timed on `bench`; ONNX Runtime's fused form for a `target` that is another CPU, whose speed this host
    cannot tell); a family without fusion rules has one form only (None) and tries borrowed rules
    (`build_borrowed`)."""
    if not export.optimizer_model_type:
        model, borrowed = build_borrowed(original, dest, export, config, bench, target)
        return model, None, borrowed
    if OptimizeSettings.of(config).graph_form != "auto" or target.kind == "cpu":
        form = OptimizeSettings.of(config).graph_form if OptimizeSettings.of(config).graph_form != "auto" else "fused"
        why = (f"set by optimize.graph_form={form}" if OptimizeSettings.of(config).graph_form != "auto" else
               f"ONNX Runtime's default: {target.name} is not this host, whose timing would not tell")
        return optimize_fp32(original, dest, export, form), FormChoice(chosen=form, reason=why, ms={}), None
    workdir = temporary_dir(dest)  # both forms; removed however the step ends
    try:
        files = {form: workdir / f"{form}.onnx" for form in GRAPH_FORMS}
        for form, path in files.items():  # one model in memory at a time: a base-size graph is 0.4 GB
            optimize_fp32(original, path, export, form)
            release_memory()
        choice = choose_form(files, bench)
        release_memory()
        chosen = onnxfiles.load(files[choice.chosen])
        onnxfiles.save(chosen, dest)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return chosen, choice, None


def build_borrowed(original: Path, dest: Path, export: ExportMetrics, config: RunConfig, bench: RaceBench,
                   target: Target) -> tuple[ModelProto, Borrowed | None]:
    """A family without fusion rules: the basic graph, or the one fused with borrowed rules where its outputs match
    the basic graph's and (optimize.borrowed_rules=auto, `target` this host) it runs clearly faster here; None when not
    tried (never)."""
    if OptimizeSettings.of(config).borrowed_rules == "never":
        return optimize_fp32(original, dest, export), None
    workdir = temporary_dir(dest)  # both graphs; removed however the step ends
    try:
        files = {"basic": workdir / "basic.onnx", "borrowed": workdir / "borrowed.onnx"}
        optimize_fp32(original, files["basic"], export)
        release_memory()
        model, biased = borrowed_fp32(original, files["borrowed"], export)
        fused = fusion_stats(model).fused
        attention = attention_outcome(fused, export.num_layers, biased, BORROWED_RULES)
        del model
        release_memory()
        always = OptimizeSettings.of(config).borrowed_rules == "always"
        untimed = ("set by optimize.borrowed_rules=always" if always else
                   f"kept as its outputs match: {target.name} is not this host, whose timing would not tell"
                   if target.kind == "cpu" else None)
        borrowed = choose_borrowed(files, bench, fused, attention, BORROWED_RULES, untimed)
        release_memory()
        chosen = onnxfiles.load(files["borrowed" if borrowed.kept else "basic"])
        onnxfiles.save(chosen, dest)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return chosen, borrowed


"""The optimize step: ONNX Runtime fusions, fp16 and int8 variants, and symbolic shapes for TensorRT."""
from __future__ import annotations

import shutil
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from workbench.core.advice import run_again
from workbench.core.atomic import temporary_dir
from workbench.core.batches import Batch, Feed
from workbench.core.catalog import Parts, Section, StepSpec
from workbench.core.config import RunConfig
from workbench.core.data import encode, load_corpus
from workbench.core.errors import DependencyMissingError
from workbench.core.machine import OthersBusy, release_memory, too_busy
from workbench.core.record import RunRecord, StepEntry
from workbench.core.results import (
    Borrowed,
    ExportMetrics,
    FormChoice,
    GraphStats,
    InferencePrecision,
    OpenvinoInt8,
    OptimizeMetrics,
    SmokeTest,
    Trial,
    Unavailable,
)
from workbench.core.timing import elapsed
from workbench.graphs import onnxfiles, shared_tables
from workbench.graphs.attention import ATTENTION_OPS
from workbench.graphs.nncf_int8 import CALIBRATION_TEXTS, nncf_problem, quantize_openvino_int8, quantizer
from workbench.graphs.variants import (
    BORROWED_RULES,
    GRAPH_FORMS,
    borrowed_fp32,
    convert_fp16,
    infer_shapes,
    optimize_fp32,
    quantize_int8,
)
from workbench.measure.forms import (
    RUNTIME_ROUNDS,
    choose_borrowed,
    choose_form,
    form_feeds,
    race,
    trial,
)
from workbench.measure.precisions import Decision, Target, paired_speedups, plan, settle, target_for
from workbench.models.loading import FUSION_MODEL_TYPES
from workbench.report import figures
from workbench.runners.files import open_variant
from workbench.runners.onnxruntime import OrtRunner, device_for, providers_for
from workbench.runners.openvino import INSTALL, OpenVinoRunner, bf16_problem, openvino_problem

if TYPE_CHECKING:
    from onnx import ModelProto

STEP = "optimize"
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
OPENVINO_BUILDS = ("openvino", "openvino_bf16", "openvino_int8")  # the OpenVINO variants this step may keep


PHASES = {"fp32": "ONNX Runtime's transformer fusions", "fp16": "fp16 conversion of the fp32 graph",
          "int8": "ONNX Runtime's dynamic int8 quantization", "tensorrt": "shapes inferred for TensorRT"}


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
            f"(it has them for {', '.join(FUSION_MODEL_TYPES)})")
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


def build_fp32(original: Path, dest: Path, export: ExportMetrics, config: RunConfig, record: RunRecord,
               target: Target) -> tuple[ModelProto, FormChoice | None, Borrowed | None]:
    """The fused fp32 graph in the layer-norm form `graph_form` sets, or (auto) the one that runs faster here
    (`forms`; ONNX Runtime's fused form for a `target` that is another CPU, whose speed this host cannot tell); a
    family without fusion rules has one form only (None) and tries borrowed rules (`build_borrowed`)."""
    if not export.optimizer_model_type:
        model, borrowed = build_borrowed(original, dest, export, config, record, target)
        return model, None, borrowed
    if config.optimize.graph_form != "auto" or target.kind == "cpu":
        form = config.optimize.graph_form if config.optimize.graph_form != "auto" else "fused"
        why = (f"set by optimize.graph_form={form}" if config.optimize.graph_form != "auto" else
               f"ONNX Runtime's default: {target.name} is not this host, whose timing would not tell")
        return optimize_fp32(original, dest, export, form), FormChoice(chosen=form, reason=why, ms={}), None
    workdir = temporary_dir(dest)  # both forms; removed however the step ends
    try:
        files = {form: workdir / f"{form}.onnx" for form in GRAPH_FORMS}
        for form, path in files.items():  # one model in memory at a time: a base-size graph is 0.4 GB
            optimize_fp32(original, path, export, form)
            release_memory()
        choice = choose_form(files, form_feeds(config, record, export), providers_for(config.device),
                             config.threads, device_for(config.device))
        release_memory()
        chosen = onnxfiles.load(files[choice.chosen])
        onnxfiles.save(chosen, dest)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return chosen, choice, None


def build_borrowed(original: Path, dest: Path, export: ExportMetrics, config: RunConfig, record: RunRecord,
                   target: Target) -> tuple[ModelProto, Borrowed | None]:
    """A family without fusion rules: the basic graph, or the one fused with borrowed rules where its outputs match
    the basic graph's and (optimize.borrowed_rules=auto, `target` this host) it runs clearly faster here; None when not
    tried (never)."""
    if config.optimize.borrowed_rules == "never":
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
        untimed = ("set by optimize.borrowed_rules=always" if config.optimize.borrowed_rules == "always" else
                   f"kept as its outputs match: {target.name} is not this host, whose timing would not tell"
                   if target.kind == "cpu" else None)
        borrowed = choose_borrowed(files, form_feeds(config, record, export), providers_for(config.device),
                                   config.threads, device_for(config.device), fused, attention, BORROWED_RULES,
                                   untimed)
        release_memory()
        chosen = onnxfiles.load(files["borrowed" if borrowed.kept else "basic"])
        onnxfiles.save(chosen, dest)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return chosen, borrowed


def build_openvino(config: RunConfig, record: RunRecord, export: ExportMetrics, target: Target) -> Trial:
    """The exported graph run by OpenVINO (`runners.openvino`), tried against the fused fp32 graph in ONNX Runtime
    (`forms.trial`): kept as the `openvino` variant where its outputs match and (optimize.openvino=auto) it runs clearly
    faster here; what was tried and why it was kept or not, for metrics.optimize.openvino."""
    why_not = openvino_skipped(config, target)
    if why_not:
        return Trial(kept=False, reason=why_not)
    dest = record.run_dir / "onnx" / "openvino.onnx"
    untimed = "set by optimize.openvino=always" if config.optimize.openvino == "always" else None
    fp32_file = record.run_dir / "onnx" / "fp32.onnx"
    record.phase("trying openvino: the exported graph run by OpenVINO, against fp32")
    try:
        openvino_file(record, dest, "f32")
        with OrtRunner("fp32", fp32_file, providers_for(config.device), config.threads) as fp32, \
                OpenVinoRunner("openvino", dest, config.threads) as openvino:
            tried: Trial = trial("fp32", "openvino", {"fp32": fp32, "openvino": openvino},
                                 form_feeds(config, record, export), untimed, RUNTIME_ROUNDS)
            engine = openvino.providers[0]
    except BaseException:  # interrupted or failed: no file the record does not name
        onnxfiles.remove(dest)
        raise
    release_memory()
    if tried.kept:
        record.add_artifact("onnx.openvino", dest, kind="onnx", variant="openvino", precision="fp32")
    else:
        onnxfiles.remove(dest)
    tried.engine = engine
    return tried


def openvino_file(record: RunRecord, dest: Path, precision: str) -> None:
    """The exported graph written to `dest`, its shared weights in the form OpenVINO packs once
    (`shared_tables.transposed_once`), its metadata telling the runners to run it with OpenVINO at the inference
    `precision` ("f32" or "bf16")."""
    from onnx import helper

    model = shared_tables.untied(record.artifact("onnx.original"))
    shared_tables.transposed_once(model)
    helper.set_model_props(model, {onnxfiles.RUNTIME_KEY: "openvino", onnxfiles.OPENVINO_PRECISION_KEY: precision})
    onnxfiles.save(model, dest)
    del model
    release_memory()


def build_openvino_bf16(config: RunConfig, record: RunRecord, export: ExportMetrics, target: Target) -> Trial:
    """The exported graph run by OpenVINO with its float ops in bf16 (its default on a CPU with bf16, what
    sentence-transformers' OpenVINO backend runs there), raced against the fastest fp32 graph kept (the openvino
    variant, else fp32): kept as the `openvino_bf16` variant (precision bf16, which the parity step holds to fp16's
    gate) where it is clearly faster here (optimize.openvino=auto) or always (optimize.openvino=always). What was
    tried and why it was kept or not, for metrics.optimize.openvino_bf16."""
    why_not = openvino_skipped(config, target) or (
        "not tried: bf16 is not among the run's precisions" if config.precisions != "auto" and
        "bf16" not in config.precisions else None)
    problem = why_not or (f"not tried: {found}" if (found := bf16_problem()) else None)
    if problem:
        return Trial(kept=False, reason=problem)
    dest = record.run_dir / "onnx" / "openvino_bf16.onnx"
    against = "openvino" if "openvino" in record.variant_names() else "fp32"  # names only: no file read
    record.phase(f"trying openvino_bf16: OpenVINO in bf16, against {against}")
    try:
        openvino_file(record, dest, "bf16")
    except BaseException:  # interrupted or failed: no file the record does not name
        onnxfiles.remove(dest)
        raise
    return raced("openvino_bf16", "bf16", dest, against, config, record, export, compiled_at="bf16")


def raced(name: str, precision: str, dest: Path, against: str, config: RunConfig, record: RunRecord,
          export: ExportMetrics, compiled_at: str | None = None) -> Trial:
    """The OpenVINO file at `dest` raced against the kept variant `against` (`forms.race`) and recorded as the `name`
    variant (of `precision`) where clearly faster (optimize.openvino=auto) or always (optimize.openvino=always);
    never where OpenVINO compiles it at another inference precision than `compiled_at`. A file not kept, interrupted
    or failed is removed. Its engine, timing and decision, for metrics.optimize.<name>."""
    try:
        with open_variant(record.variant(against), config.device, config.threads) as default, \
                OpenVinoRunner(name, dest, config.threads, precision) as challenger:
            engine = challenger.providers[0]
            if compiled_at and challenger.inference_precision != compiled_at:
                ms, kept, reason = {}, False, f"not kept: OpenVINO compiled it at {challenger.inference_precision}"
            elif config.optimize.openvino == "always":
                ms, kept, reason = {}, True, "set by optimize.openvino=always"
            else:
                ms, kept, reason = race(against, name, {against: default, name: challenger},
                                        form_feeds(config, record, export), RUNTIME_ROUNDS)
    except BaseException:  # interrupted or failed: no file the record does not name
        onnxfiles.remove(dest)
        raise
    release_memory()
    if kept:
        record.add_artifact(f"onnx.{name}", dest, kind="onnx", variant=name, precision=precision)
    else:
        onnxfiles.remove(dest)
    return Trial(engine=engine, against=against, ms=ms, kept=kept, reason=reason)


def calibration_feeds(config: RunConfig, record: RunRecord, export: ExportMetrics) -> list[Feed]:
    """NNCF's calibration data: CALIBRATION_TEXTS texts spread evenly over the run's corpus (all of them when it has
    fewer), one unpadded text each, cut at the model's limit."""
    texts = config.texts()
    step = max(1, len(texts) // CALIBRATION_TEXTS)
    return [encode(record.tokenizer(), [text], tuple(export.io.inputs), max_length=export.max_sequence)
            for text in list(texts[::step][:CALIBRATION_TEXTS])]


def build_openvino_int8(config: RunConfig, record: RunRecord, export: ExportMetrics, target: Target,
                        int8: Decision | None) -> OpenvinoInt8:
    """NNCF's int8 of the exported graph run by OpenVINO (`graphs.nncf_int8`), raced against the fastest graph kept
    so far (ONNX Runtime's int8, else openvino_bf16, else the openvino variant, else fp32): kept as the
    `openvino_int8` variant where it is clearly faster here (optimize.openvino=auto) or always
    (optimize.openvino=always). Its accuracy is the parity step's to judge (and repair). What was tried and why it
    was kept or not, for metrics.optimize.openvino_int8."""
    why_not = openvino_skipped(config, target) or (
        "not tried: int8 is not among the run's precisions" if int8 is None or (
            config.precisions != "auto" and "int8" not in config.precisions) else
        f"not tried: {nncf_problem()}; {INSTALL}" if nncf_problem() else None)
    if why_not:
        return OpenvinoInt8(kept=False, reason=why_not)
    dest = record.run_dir / "onnx" / "openvino_int8.onnx"
    variants = record.variant_names()  # names only: reading a file would make it an input (a repair's, parity's)
    against = next(v for v in ("int8", "openvino_bf16", "openvino", "fp32") if v in variants)
    feeds = calibration_feeds(config, record, export)
    record.phase(f"building openvino_int8: NNCF calibrates on {len(feeds)} texts and quantizes (the longest "
                 "build here), then races it against " + against)
    try:
        seconds = elapsed(lambda: quantize_openvino_int8(record.artifact("onnx.original"), dest, feeds))
    except Exception as exc:  # noqa: BLE001 - NNCF may refuse a graph it does not know: a finding, kept
        onnxfiles.remove(dest)
        problem = (str(exc).strip().splitlines() or [""])[-1]
        return OpenvinoInt8(kept=False, reason=f"not built: NNCF could not quantize this graph "
                                               f"({type(exc).__name__}: {problem})")
    try:
        release_memory()
        computed_in = choose_openvino_precision(config, record, export, dest)
    except BaseException:  # interrupted or failed: no file the record does not name
        onnxfiles.remove(dest)
        raise
    decided = raced("openvino_int8", "int8", dest, against, config, record, export)
    return OpenvinoInt8(quantizer=quantizer(), calibration_texts=len(feeds), seconds=round(seconds, 3),
                        inference_precision=computed_in, **decided.recorded())


def choose_openvino_precision(config: RunConfig, record: RunRecord, export: ExportMetrics,
                              dest: Path) -> InferencePrecision:
    """The precision OpenVINO computes the float ops of the int8 file at `dest` in. Where the CPU has bf16 that is
    OpenVINO's own default there (what its own int8 deployment runs), bf16, unless the file compiled at f32 runs
    clearly faster (`forms.race`, interleaved) and no slower at any cell while other work left the host mostly idle
    (a race on a busy host keeps the default); bf16 is written into the file's metadata. Elsewhere f32. Timed under
    optimize.openvino=always too (that setting keeps the variant; this picks how it runs). Its accuracy is the parity
    step's to judge, with the file's. What was tried, for metrics.optimize.openvino_int8.inference_precision."""
    problem = bf16_problem()
    if problem:
        return InferencePrecision(chosen="f32", reason=f"bf16 not tried: {problem}")
    with OpenVinoRunner("bf16", dest, config.threads, "int8", "bf16") as bf16, \
            OpenVinoRunner("f32", dest, config.threads, "int8", "f32") as f32:
        if bf16.inference_precision != "bf16":
            return InferencePrecision(chosen="f32",
                                      reason=f"bf16 not tried: OpenVINO compiled it at {bf16.inference_precision}")
        with OthersBusy() as others:
            ms, faster, reason = race("bf16", "f32", {"bf16": bf16, "f32": f32}, form_feeds(config, record, export),
                                      RUNTIME_ROUNDS)
    busy = too_busy(others.cores)
    slower = [cell for cell in ms["f32"] if ms["f32"][cell] > ms["bf16"][cell]]
    if faster and not busy and not slower:
        return InferencePrecision(chosen="f32", ms=ms, reason=f"f32 {reason}")
    onnxfiles.set_metadata(dest, {onnxfiles.OPENVINO_PRECISION_KEY: "bf16"})
    if faster and busy:
        return InferencePrecision(chosen="bf16", ms=ms, reason=(
            f"OpenVINO's default on this CPU: f32 {reason}, but {busy} during the race, so its timing does not "
            "decide; re-run the optimize step on a quiet host"))
    if faster:
        return InferencePrecision(chosen="bf16", ms=ms, reason=(
            f"OpenVINO's default on this CPU: f32 {reason}, but slower at {', '.join(slower)}, and a precision "
            "other than the runtime's default is taken only where it loses nowhere (RoBERTa-base: f32 won 1.08x at "
            "b1 s16 in a race, where one file timed 1.08 apart from itself, and ran 4% slower at b8 s128)"))
    return InferencePrecision(chosen="bf16", ms=ms, reason=f"OpenVINO's default on this CPU; f32 {reason}")


def openvino_skipped(config: RunConfig, target: Target) -> str | None:
    """Why the OpenVINO variant is not tried in this run, or None."""
    if config.optimize.openvino == "never":
        return "not tried (optimize.openvino=never)"
    if target.kind == "gpu" or device_for(config.device) == "cuda":
        return "not tried: the deployment runs on a GPU, and OpenVINO's variant is for CPUs"
    if target.kind == "cpu" and config.optimize.openvino == "auto":
        return (f"not tried: {target.name} is not this host, whose timing would not tell (optimize.openvino=always "
                "keeps it where its outputs match)")
    problem = openvino_problem()
    if problem:
        return f"not tried: {problem}; {INSTALL}"
    return None


def check(config: RunConfig) -> None:
    """Refuse optimize.openvino=always without OpenVINO before the run starts."""
    problem = openvino_problem()
    if config.optimize.openvino == "always" and problem:
        raise DependencyMissingError(f"optimize.openvino=always needs OpenVINO: {problem}",
                                     f"{INSTALL}, or set optimize.openvino: auto")


def decide_precisions(config: RunConfig, record: RunRecord) -> tuple[Target, dict[str, Decision]]:
    """The deployment's target and, per reduced precision, whether it is built and why (`measure.precisions.plan`),
    before any is built."""
    gpu = device_for(config.device) == "cuda"
    target = target_for(config.target.cpu, gpu)
    record.set_metric(f"{STEP}.precisions", {"setting": config.precisions, "target": target.record()})
    return target, plan(config.precisions, target, tensorrt="tensorrt" in config.steps and gpu)


def measure_against_fp32(config: RunConfig, record: RunRecord, export: ExportMetrics,
                         decisions: dict[str, Decision], files: dict[str, Path]) -> None:
    """Each plain reduced-precision variant (`files`, by precision) timed against fp32 at the goal cells on this
    host, in pairs (two sessions in memory at a time), and its decision settled (auto keeps only those that pay)."""
    feeds = form_feeds(config, record, export)
    for precision, path in files.items():
        speedups, ms = paired_speedups({"fp32": record.run_dir / "onnx" / "fp32.onnx", precision: path}, feeds,
                                       providers_for(config.device), config.threads, device_for(config.device))
        settle(decisions[precision], speedups[precision], ms, auto=config.precisions == "auto")


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
        export = record.export_info()
        original = record.artifact("onnx.original")
        layers = export.num_layers
        onnx_dir = record.run_dir / "onnx"
        unfused = fusion_stats(onnxfiles.skeleton(original))
        form: FormChoice | None = None
        borrowed: Borrowed | None = None
        target, decisions = decide_precisions(config, record)

        def fp32(dest: Path) -> ModelProto:
            nonlocal form, borrowed
            model, form, borrowed = build_fp32(original, dest, export, config, record, target)
            return model

        shapes_by = None

        def tensorrt(dest: Path) -> ModelProto:
            nonlocal shapes_by
            model, shapes_by = infer_shapes(original, dest)
            return model

        builders = {
            "fp32": fp32,
            "fp16": lambda dest: convert_fp16(onnx_dir / "fp32.onnx", dest, config.optimize.fp16.op_block_list,
                                              config.optimize.fp16.node_block_list),
            "int8": lambda dest: quantize_int8(onnx_dir / "fp32.onnx", dest, config.optimize.int8.per_channel,
                                               config.optimize.int8.nodes_to_exclude),
            "tensorrt": tensorrt,
        }
        wanted = ["fp32", *[p for p, decision in decisions.items() if decision.build], "tensorrt"]
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
                measure_against_fp32(config, record, export, decisions, timed)
            for variant, stats in built.items():
                dest = onnx_dir / f"{variant}.onnx"
                if variant in decisions and not decisions[variant].build:
                    onnxfiles.remove(dest)  # measured here and found not to pay
                    continue
                if variant != "tensorrt":
                    stats.smoke_test = smoke_test(record, config, variant, dest)
                if stats.warning:
                    warnings.warn(f"{variant}: {stats.warning}", stacklevel=2)
                precision = "fp32" if variant in ("fp32", "tensorrt") else variant
                record.add_artifact(f"onnx.{variant}", dest, kind="onnx", variant=variant, precision=precision)
                record.set_metric(f"{STEP}.variants.{variant}", stats.recorded())
        record.set_metric(f"{STEP}.precisions.decisions", {p: d.record() for p, d in decisions.items()})
        record.set_metric(f"{STEP}.openvino", build_openvino(config, record, export, target).recorded())
        record.set_metric(f"{STEP}.openvino_bf16", build_openvino_bf16(config, record, export, target).recorded())
        record.set_metric(f"{STEP}.openvino_int8",
                          build_openvino_int8(config, record, export, target, decisions.get("int8")).recorded())
        record.set_metric(f"{STEP}.variants.original", unfused.recorded())
    return record.step_entry(STEP)


def lines(record: RunRecord) -> list[str]:
    optimize = record.results_as(STEP, OptimizeMetrics) or OptimizeMetrics()
    export = record.export_info()
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
    megabytes = {name: stats.megabytes for name, stats in variants.items() if stats.megabytes is not None}
    megabytes.update({name: (record.artifact_bytes(f"onnx.{name}") or 0) / 1e6
                      for name in record.variant_names() if name in OPENVINO_BUILDS})
    sizes = ", ".join(f"{name} {size:.3g} MB" for name, size in megabytes.items())
    lines = [f"{fused}; fp32 graph {export.nodes} -> {fp32.nodes if 'fp32' in variants else None} nodes",
             f"variants built: {sizes}"]
    decisions = optimize.precisions.decisions if optimize.precisions else {}
    lines += [f"{precision} {'built' if d.built else 'not built'}: {d.reason}" for precision, d in decisions.items()]
    if fp32.form:
        lines.append(f"layer norms {fp32.form.chosen}: {fp32.form.reason}")
    if optimize.openvino:
        lines.append(openvino_line(optimize.openvino))
    if optimize.openvino_bf16:
        lines.append(openvino_bf16_line(optimize.openvino_bf16))
    if optimize.openvino_int8:
        lines.append(openvino_int8_line(optimize.openvino_int8))
    return lines


def openvino_line(openvino: Trial) -> str:
    """The OpenVINO trial in one line: kept, not kept and why (with how to keep it anyway), or not tried and why."""
    if openvino.kept:
        return f"OpenVINO fp32 kept as the openvino variant: {openvino.reason}"
    if openvino.matches is None:
        return f"OpenVINO fp32 {openvino.reason}"
    anyway = f"; to keep it anyway: {run_again(['optimize'], settings={'optimize.openvino': 'always'})}" \
        if openvino.matches else ""
    return f"OpenVINO fp32 not kept: {openvino.reason}{anyway}"


def openvino_bf16_line(openvino_bf16: Trial) -> str:
    """OpenVINO in bf16 in one line: kept (its accuracy is the parity step's to judge), not kept and why, or not
    tried and why."""
    if openvino_bf16.kept:
        return f"OpenVINO bf16 kept as the openvino_bf16 variant: {openvino_bf16.reason}"
    if not openvino_bf16.ms:
        return f"OpenVINO bf16 {openvino_bf16.reason}"
    return f"OpenVINO bf16 not kept: {openvino_bf16.reason}; to keep it anyway: -p optimize.openvino=always"


def openvino_int8_line(openvino_int8: OpenvinoInt8) -> str:
    """NNCF's int8 on OpenVINO in one line: kept (its accuracy is the parity step's to judge), not kept and why, or
    not tried and why."""
    computed_in = openvino_int8.inference_precision  # older records: none (f32)
    if openvino_int8.kept:
        how = f", its float ops in {computed_in.chosen} ({computed_in.reason})" if computed_in else ""
        return f"OpenVINO int8 (NNCF) kept as the openvino_int8 variant{how}: {openvino_int8.reason}"
    if openvino_int8.against is None:
        return f"OpenVINO int8 (NNCF) {openvino_int8.reason}"
    timed = f" (timed with its float ops in {computed_in.chosen})" if computed_in else ""
    return (f"OpenVINO int8 (NNCF) not kept{timed}: {openvino_int8.reason}; to keep it anyway: "
            "-p optimize.openvino=always")


def section(optimize: OptimizeMetrics) -> Parts:
    if not optimize.variants:
        return []
    decisions = optimize.precisions.decisions if optimize.precisions else {}
    decided = " ".join(f"{precision} {'built' if d.built else 'not built'}: {d.reason}."
                       for precision, d in decisions.items())
    text = "Fused operators and node counts per variant." + (f" {decided}" if decided else "")
    parts: Parts = [("ONNX Runtime fusions", text, [figures.fusion_figure(optimize.variants)])]
    if optimize.openvino:
        parts.append(("OpenVINO, tried against the fp32 graph", f"{openvino_line(optimize.openvino)}.", []))
    if optimize.openvino_bf16:
        parts.append(("OpenVINO bf16, raced against the fastest fp32 graph",
                      f"{openvino_bf16_line(optimize.openvino_bf16)}.", []))
    if optimize.openvino_int8:
        parts.append(("OpenVINO int8 (NNCF), raced against the fastest graph",
                      f"{openvino_int8_line(optimize.openvino_int8)}.", []))
    return parts


SPEC = StepSpec(
    STEP, 2, "ONNX Runtime fusions, fp16, int8, symbolic shapes", run, lines,
    sections=(Section("ONNX Runtime fusions", section),),
    needs=("model",), reads=("export",), machine=("onnx", "onnxruntime"), writes=2.8, check=check,
    metrics=OptimizeMetrics, after="export", settings="optimize",
    first_reads=("precisions", "target", "corpus", "corpus_max_texts"))

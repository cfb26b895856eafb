"""The optimize step's OpenVINO variants: the exported graph run by OpenVINO in fp32 and bf16, and NNCF's int8 of it,
each tried or raced against the fastest graph kept so far and kept only where it pays here (or where a setting says
always); each variant's line for the verdict and the report."""
from __future__ import annotations

from pathlib import Path

from workbench.core.advice import run_again
from workbench.core.config import RunConfig
from workbench.core.errors import DependencyMissingError
from workbench.core.record import RunRecord
from workbench.graphs import onnxfiles, shared_tables
from workbench.graphs.names import VariantName
from workbench.graphs.nncf_int8 import CALIBRATION_TEXTS, nncf_problem, quantize_openvino_int8, quantizer
from workbench.graphs.settings import OptimizeSettings
from workbench.graphs.tables import ExportMetrics, InferencePrecision, OpenvinoInt8, PrecisionDecision, Trial
from workbench.measure.forms import RUNTIME_ROUNDS, RaceBench, race, trial
from workbench.measure.precisions import Target
from workbench.models.batches import Feed
from workbench.models.footprint import release_memory
from workbench.models.text import encode
from workbench.runners.onnxruntime import OrtRunner, device_for
from workbench.runners.openvino import INSTALL, OpenVinoRunner, bf16_problem, openvino_problem
from workbench.runners.registry import open_variant
from workbench.runners.timing import OthersBusy, elapsed, too_busy

# the OpenVINO variants this step may keep
OPENVINO_BUILDS = (VariantName.OPENVINO, VariantName.OPENVINO_BF16, VariantName.OPENVINO_INT8)


def openvino_skipped(config: RunConfig, target: Target) -> str | None:
    """Why the OpenVINO variant is not tried in this run, or None."""
    if OptimizeSettings.of(config).openvino == "never":
        return "not tried (optimize.openvino=never)"
    if target.kind == "gpu" or device_for(config.device) == "cuda":
        return "not tried: the deployment runs on a GPU, and OpenVINO's variant is for CPUs"
    if target.kind == "cpu" and OptimizeSettings.of(config).openvino == "auto":
        return (f"not tried: {target.name} is not this host, whose timing would not tell (optimize.openvino=always "
                "keeps it where its outputs match)")
    problem = openvino_problem()
    if problem:
        return f"not tried: {problem}; {INSTALL}"
    return None


def build_openvino(config: RunConfig, record: RunRecord, bench: RaceBench, target: Target) -> Trial:
    """The exported graph run by OpenVINO (`runners.openvino`), tried against the fused fp32 graph in ONNX Runtime
    (`forms.trial`): kept as the `openvino` variant where its outputs match and (optimize.openvino=auto) it runs clearly
    faster here; what was tried and why it was kept or not, for metrics.optimize.openvino."""
    why_not = openvino_skipped(config, target)
    if why_not:
        return Trial(kept=False, reason=why_not)
    dest = record.run_dir / "onnx" / "openvino.onnx"
    untimed = "set by optimize.openvino=always" if OptimizeSettings.of(config).openvino == "always" else None
    fp32_file = record.run_dir / "onnx" / "fp32.onnx"
    record.phase("trying openvino: the exported graph run by OpenVINO, against fp32")
    try:
        openvino_file(record, dest, "f32")
        with OrtRunner("fp32", fp32_file, bench.providers, bench.threads) as fp32, \
                OpenVinoRunner("openvino", dest, config.threads) as openvino:
            tried: Trial = trial("fp32", "openvino", {"fp32": fp32, "openvino": openvino}, bench.feeds, untimed,
                                 RUNTIME_ROUNDS)
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


def build_openvino_bf16(config: RunConfig, record: RunRecord, bench: RaceBench, target: Target) -> Trial:
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
    kept = record.variant_names()  # names only: no file read
    against = VariantName.OPENVINO if VariantName.OPENVINO in kept else VariantName.FP32
    record.phase(f"trying openvino_bf16: OpenVINO in bf16, against {against}")
    try:
        openvino_file(record, dest, "bf16")
    except BaseException:  # interrupted or failed: no file the record does not name
        onnxfiles.remove(dest)
        raise
    return raced(VariantName.OPENVINO_BF16, "bf16", dest, against, config, record, bench, compiled_at="bf16")


def raced(name: str, precision: str, dest: Path, against: str, config: RunConfig, record: RunRecord,
          bench: RaceBench, compiled_at: str | None = None) -> Trial:
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
            elif OptimizeSettings.of(config).openvino == "always":
                ms, kept, reason = {}, True, "set by optimize.openvino=always"
            else:
                ms, kept, reason = race(against, name, {against: default, name: challenger}, bench.feeds,
                                        RUNTIME_ROUNDS)
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


def build_openvino_int8(config: RunConfig, record: RunRecord, export: ExportMetrics, bench: RaceBench,
                        target: Target, int8: PrecisionDecision | None) -> OpenvinoInt8:
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
    against = next(v for v in (VariantName.INT8, VariantName.OPENVINO_BF16, VariantName.OPENVINO, VariantName.FP32)
                   if v in variants)
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
        computed_in = choose_openvino_precision(config, bench, dest)
    except BaseException:  # interrupted or failed: no file the record does not name
        onnxfiles.remove(dest)
        raise
    decided = raced(VariantName.OPENVINO_INT8, "int8", dest, against, config, record, bench)
    return OpenvinoInt8(quantizer=quantizer(), calibration_texts=len(feeds), seconds=round(seconds, 3),
                        inference_precision=computed_in, **decided.recorded())


def choose_openvino_precision(config: RunConfig, bench: RaceBench, dest: Path) -> InferencePrecision:
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
            ms, faster, reason = race("bf16", "f32", {"bf16": bf16, "f32": f32}, bench.feeds, RUNTIME_ROUNDS)
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


def openvino_line(openvino: Trial, run_dir: Path | None) -> str:
    """The OpenVINO trial in one line: kept, not kept and why (with how to keep it anyway), or not tried and why."""
    if openvino.kept:
        return f"OpenVINO fp32 kept as the openvino variant: {openvino.reason}"
    if openvino.matches is None:
        return f"OpenVINO fp32 {openvino.reason}"
    anyway = _keep_anyway(run_dir) if openvino.matches else ""
    return f"OpenVINO fp32 not kept: {openvino.reason}{anyway}"


def _keep_anyway(run_dir: Path | None) -> str:
    """`; to keep it anyway: ...` for the run in `run_dir` (None: nothing, where no run is at hand)."""
    return f"; to keep it anyway: {run_again(['optimize'], run_dir, {'optimize.openvino': 'always'})}" if run_dir \
        else ""


def openvino_bf16_line(openvino_bf16: Trial, run_dir: Path | None) -> str:
    """OpenVINO in bf16 in one line: kept (its accuracy is the parity step's to judge), not kept and why, or not
    tried and why."""
    if openvino_bf16.kept:
        return f"OpenVINO bf16 kept as the openvino_bf16 variant: {openvino_bf16.reason}"
    if not openvino_bf16.ms:
        return f"OpenVINO bf16 {openvino_bf16.reason}"
    return f"OpenVINO bf16 not kept: {openvino_bf16.reason}{_keep_anyway(run_dir)}"


def openvino_int8_line(openvino_int8: OpenvinoInt8, run_dir: Path | None) -> str:
    """NNCF's int8 on OpenVINO in one line: kept (its accuracy is the parity step's to judge), not kept and why, or
    not tried and why."""
    computed_in = openvino_int8.inference_precision  # older records: none (f32)
    if openvino_int8.kept:
        how = f", its float ops in {computed_in.chosen} ({computed_in.reason})" if computed_in else ""
        return f"OpenVINO int8 (NNCF) kept as the openvino_int8 variant{how}: {openvino_int8.reason}"
    if openvino_int8.against is None:
        return f"OpenVINO int8 (NNCF) {openvino_int8.reason}"
    timed = f" (timed with its float ops in {computed_in.chosen})" if computed_in else ""
    return f"OpenVINO int8 (NNCF) not kept{timed}: {openvino_int8.reason}{_keep_anyway(run_dir)}"



def check(config: RunConfig) -> None:
    """Refuse optimize.openvino=always without OpenVINO before the run starts."""
    problem = openvino_problem()
    if OptimizeSettings.of(config).openvino == "always" and problem:
        raise DependencyMissingError(f"optimize.openvino=always needs OpenVINO: {problem}",
                                     f"{INSTALL}, or set optimize.openvino: auto")

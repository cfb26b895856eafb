"""The parity step: every variant against PyTorch on real text at the shape corners, and precision repair."""
from __future__ import annotations

import shlex
from collections.abc import Collection
from functools import partial
from pathlib import Path

from workbench.core.advice import run_again, set_settings
from workbench.core.atomic import write_text
from workbench.core.config import RunConfig
from workbench.core.errors import MissingArtifactError
from workbench.core.record import RunRecord, StepEntry
from workbench.core.results import Verdict
from workbench.graphs import onnxfiles
from workbench.graphs.names import VariantName
from workbench.graphs.tables import ExportMetrics
from workbench.models.footprint import release_memory
from workbench.models.loading import LoadedModel, load_model
from workbench.precision.compare import raise_if_failed
from workbench.precision.errors import ReferenceMismatchError
from workbench.precision.lab import ParityLab, lab_texts, library_check
from workbench.precision.settings import ParitySettings, RepairSettings
from workbench.precision.tables import CheckScope, LibraryCheck, ParityMetrics, RepairOutcome
from workbench.report.figures import parity_table
from workbench.report.page import Parts, Section
from workbench.report.recommend import Gate, gate
from workbench.report.takeaways import cut_line
from workbench.runners.onnxruntime import SessionSettings
from workbench.runners.registry import open_variant
from workbench.serving.plan import served_groups
from workbench.serving.settings import lab_settings
from workbench.steps import StepSpec
from workbench.steps.parity.figures import error_distribution, node_error_figure, recipes_table, repair_tradeoff
from workbench.steps.parity.repairs import REPAIRABLE, STEP, repair, repair_failing, serving_order

EXACT_VARIANTS = (VariantName.ORIGINAL, VariantName.FP32)


def checked_variants(names: list[str]) -> list[str]:
    """The variants the lab checks first, the fused fp32 graph ahead: all but the exported graph (`original`),
    which is checked after them only where fp32 fails or is missing, to tell the export from the fusion (every
    other variant is built from one of the two, and `original` is served after all of them)."""
    return sorted((name for name in names if name != "original"), key=lambda name: name != "fp32")


def next_in_serving_order(order: tuple[str, ...], built: Collection[str], results: dict[str, Verdict],
                          repairable: Collection[str]) -> str | None:
    """What `check_in_serving_order` does next: None once a variant of `order` passed with every one ahead of it
    checked; else the first built variant of `order` not checked yet, or `<name>_repaired` where `name` (one of
    `repairable`, not repaired yet) failed."""
    for name in order:
        if name in results:
            if results[name].passed:
                return None
            continue
        base = name.removesuffix("_repaired")
        if name != base and base in repairable and base in results and not results[base].passed:
            return name
        if name in built:
            return name
    return None


def first_passed(order: tuple[str, ...], results: dict[str, Verdict]) -> str | None:
    """The variant the deployment would serve among those checked: the first of `order` that passed."""
    return next((name for name in order if name in results and results[name].passed), None)


def check_in_serving_order(config: RunConfig, record: RunRecord, lab: ParityLab, results: dict[str, Verdict]) -> None:
    """parity.variants=served: the variants in the order the deployment serves them until one passes, those served
    after it left unchecked (`unchecked`); a failing fp16/int8 is repaired (in serving order) only where none
    faster than fp32 passed: a repair takes several lab checks, each many minutes on a large model."""
    built = set(record.variants())

    def walk(repairable: set[str]) -> str | None:
        """Check (and repair) in serving order until one passes; the first that passed in that order (each variant
        a bar of its own, one line after it: no bar inside another)."""
        while name := next_in_serving_order(serving_order(config, record), built, results, repairable):
            if name in built:
                results[name] = compare(name, config, record, lab)
            else:
                repairable.discard(base := name.removesuffix("_repaired"))
                if repair(base, config, record, lab, results) is not None:
                    results[name] = compare(name, config, record, lab)
            record.found(f"in serving order, {name}: {'pass' if name in results and results[name].passed else 'FAIL'}")
        return first_passed(serving_order(config, record), results)

    served = walk(set())
    failing = [name for name in REPAIRABLE if name in results and not results[name].passed]
    if served is None or served in EXACT_VARIANTS:
        walk(set(failing) if ParitySettings.of(config).repair.enabled else set())
        return
    for name in failing:
        record.set_metric(f"{STEP}.repair.{name}", RepairOutcome(
            precision=record.variant(name).precision, units=0,
            outcome=f"not run: {served} passed and is faster than fp32 (parity.variants=served repairs only where "
                    f"none faster passes; {set_settings({'parity.variants': 'all'})} repairs it)").recorded())


def unchecked(record: RunRecord, results: dict[str, Verdict], order: tuple[str, ...]) -> dict[str, str]:
    """The built variants the lab did not check, each with why (`order`: the serving order)."""
    served = first_passed(order, results)

    def why(name: str) -> str:
        if name == "original":
            return "the fused fp32 graph built from it passed (checked only where fp32 fails)"
        if name not in order:
            return f"not served by this deployment (it serves {', '.join(order)})"
        return f"{served} passed and is served ahead of it" if served else "not reached"
    return {name: why(name) for name in record.variants() if name not in results}


def compare(name: str, config: RunConfig, record: RunRecord, lab: ParityLab) -> Verdict:
    """Variant `name` against the lab's reference (metrics.parity.variants.<name>)."""
    built = record.variant(name)
    with open_variant(built, config.device, config.threads, SessionSettings(config.threads, arena=False)) as runner:
        record.note_providers(runner.providers)
        result = lab.for_variant(onnxfiles.batch_dependent(built.path)).compare(runner, built.precision,
                                                                                progress=f"parity {name}")
    release_memory()  # the session's weights and arenas: a base-size variant holds 1 GB
    record.set_metric(f"{STEP}.variants.{name}", result.recorded())
    return result


def reproduce_script(record: RunRecord, inputs: Path, reference: Path, results: dict[str, Verdict]) -> Path:
    """A shell script that re-runs each ONNX variant against the saved PyTorch outputs with Polygraphy."""
    lines = ["#!/usr/bin/env bash",
             "# Re-run each variant on the saved corner-batch inputs and compare with the saved PyTorch outputs.",
             "# Polygraphy compares every element, padded positions included, by absolute/relative tolerance;",
             "# the workbench's cosine and label-agreement criteria (run.json metrics.parity) are not applied here.",
             'cd "$(dirname "$0")/.." || exit 1', "status=0"]
    variants = record.variants()
    for name, result in results.items():
        if name not in variants:
            continue
        outputs = result.outputs
        path = variants[name].path.relative_to(record.run_dir)
        command = ["polygraphy run", shlex.quote(str(path)), "--onnxrt --providers cpu",
                   "--load-inputs", str(inputs.relative_to(record.run_dir)),
                   "--load-outputs", str(reference.relative_to(record.run_dir)), "--check-error-stat max"]
        lines.append(f"echo '== {name}'")
        if all("atol" in o.tolerance for o in outputs.values()):
            command += ["--atol", *(f"{n}:{o.tolerance['atol']:g}" for n, o in outputs.items()),
                        "--rtol", *(f"{n}:{o.tolerance.get('rtol', 0):g}" for n, o in outputs.items())]
            lines.append(" ".join(command) + " || status=1")
        else:
            lines.append(f"# {name} is judged by cosine / label agreement, not an absolute tolerance: "
                         "Polygraphy shows its error statistics only")
            lines.append(" ".join(command) + " || true")
    lines.append("exit $status")
    return write_text(record.run_dir / "parity" / "reproduce.sh", "\n".join(lines) + "\n")


def check_module(config: RunConfig, record: RunRecord, loaded: LoadedModel, texts: tuple[str, ...]) -> None:
    """The PyTorch module every variant is compared with, against what the model's users run today (its own
    library); recorded, and the step fails here when they differ: every verdict after would be against the wrong
    reference."""
    record.phase("comparing the PyTorch module with the model's own library, every text")
    check = library_check(lab_settings(config), loaded, texts)
    release_memory()  # the library's own copy of the model
    record.found(f"the module against {check.library}: {'FAIL' if check.checked and not check.passed else 'pass'}")
    record.set_metric(f"{STEP}.reference", check.recorded())
    if check.checked and not check.passed:
        raise ReferenceMismatchError(
            f"the workbench's PyTorch module does not return what {check.reference} returns on the same texts: "
            f"{'; '.join(check.failures)}",
            "read metrics.parity.reference in run.json; check the model's sentence-transformers files (modules.json, "
            "1_Pooling/config.json) and -p pooling, or report the model: the export would not serve what its users "
            "get today")


def run(config: RunConfig, record: RunRecord) -> StepEntry:
    """Compare every variant with PyTorch; repair failing fp16/int8 variants; fp32 variants must pass."""
    with record.step(STEP):
        variants = record.variants()
        if not variants:
            raise MissingArtifactError(f"the run in {record.run_dir} has no ONNX variant to compare",
                                       "run the export and optimize steps first: --steps export,optimize,parity")
        record.phase(f"loading {config.model_slug} with transformers, the reference every variant is compared with")
        loaded = load_model(config)
        texts = lab_texts(lab_settings(config), loaded)
        check_module(config, record, loaded, texts)
        tokens, source = loaded.token_budget(config.batch)
        lab = ParityLab.build(lab_settings(config), loaded, texts,
                              regroup=partial(served_groups, max_tokens=tokens) if any(
                                  onnxfiles.batch_dependent(v.path) for v in variants.values()) else None)
        loaded.drop_weights()  # the reference outputs are computed: nothing runs the module again
        record.set_metric(f"{STEP}.inputs", {
            "texts": len(lab.texts), "corpus_texts": len(config.texts()), "max_tokens": tokens,
            "max_tokens_source": source,
            "batches": [{"name": b.name, "shape": list(b.shape)} for b in lab.batches],
            "reference": lab.reference.name, "reference_seconds": round(lab.reference_seconds, 3),
            "reference_cached": lab.reference_cached})
        scope, why = ParitySettings.of(config).scope(record.needed(ExportMetrics).parameters)
        first = checked_variants(list(variants)) if scope == "all" else [n for n in ("fp32",) if n in variants]
        results = {name: compare(name, config, record, lab) for name in first}  # a bar of batches each
        if "original" in variants and not (results["fp32"].passed if "fp32" in results else False):
            results["original"] = compare("original", config, record, lab)  # the export, or the fusion?
        if scope == "all":
            repair_failing(config, record, lab, results, partial(compare, config=config, record=record, lab=lab))
        else:
            check_in_serving_order(config, record, lab, results)
        record.set_metric(f"{STEP}.scope", CheckScope(variants=scope, reason=why, unchecked=unchecked(
            record, results, serving_order(config, record))).recorded())
        inputs, reference = lab.save_polygraphy_data(record.run_dir / "parity")
        script = reproduce_script(record, inputs, reference, results)
        record.add_artifact("parity.inputs", inputs, kind="polygraphy-inputs")
        record.add_artifact("parity.reference", reference, kind="polygraphy-outputs")
        record.add_artifact("parity.reproduce", script, kind="script")
        for name in EXACT_VARIANTS:
            if name in results:
                raise_if_failed(name, results[name])
    return record.step_entry(STEP)


def lines(record: RunRecord) -> list[str]:
    parity = record.results_as(STEP, ParityMetrics) or ParityMetrics()
    passed = [name for name, v in parity.variants.items() if v.passed]
    lines = [*reference_lines(parity.reference),
             f"parity: {len(passed)} of {len(parity.variants)} variants pass ({', '.join(passed) or 'none'})"]
    lines += [f"  {name}: {'pass' if v.passed else 'FAIL'}, {_gate_on(gate(v))}{_neighbours(v)}{_ungated(v)}"
              for name, v in parity.variants.items()]
    scope = parity.scope
    if scope and scope.variants == "served":
        lines.append(f"  checked in serving order until one passed: {scope.reason}")
    lines += [f"  {name}: not checked: {why}" for name, why in (scope.unchecked if scope else {}).items()]
    for precision, outcome in parity.repair.items():
        chosen = outcome.chosen
        spent = (f"{outcome.seconds:.0f} s of its {outcome.budget_s:g} s budget"
                 if outcome.seconds is not None and outcome.budget_s else "")
        if outcome.outcome == "repaired" and chosen:
            base = f", quantized as {outcome.base}" if outcome.base else ""
            stopped = f"; the search stopped early: {outcome.stopped}" if outcome.stopped else ""
            built, recipes = len(outcome.candidates), len(outcome.bases) + len(outcome.recipes)
            probes = f", {outcome.probes} probes" if outcome.probes else ""
            measured = f"{recipes} recipe{'s' if recipes != 1 else ''} measured, " if recipes else ""
            lines.append(f"{precision}_repaired keeps {len(chosen.blocked)} of {outcome.units} units in fp32"
                         f"{base} ({measured}{built} node-search candidate{'s' if built != 1 else ''} built"
                         f"{probes}{stopped}"
                         f"{'; ' + spent if spent else ''})"
                         + (f"; {outcome.race.reason}" if outcome.race else ""))
        else:
            more = ""
            if outcome.stopped and "repair.budget_s" in outcome.stopped and outcome.budget_s:
                checked = parity.variants.get(precision)
                auto, _ = RepairSettings().budget(checked.seconds if checked else None)
                more = " (more time: " + run_again(["parity"], record.run_dir, {
                    "parity.repair.budget_s": f"{max(2 * outcome.budget_s, auto):g}"}) + ")"
            lines.append(f"{precision} repair: {outcome.outcome}{more}")
    return lines


def reference_lines(check: LibraryCheck | None) -> list[str]:
    """The PyTorch module against the model's own library, in one line."""
    if not check:
        return []
    if not check.checked:
        return [f"reference: {check.library} (not checked against a library call: {check.reason})"]
    primary = list(check.outputs.values())[-1]
    cosine = f", min cosine {primary.min_cosine:.6f}" if primary.min_cosine is not None else ""
    line = f"PyTorch module vs {check.library}: {'pass' if check.passed else 'FAIL'}, max abs " \
        f"{primary.max_abs:.2g}{cosine}"
    cut = check.cut
    if not cut:
        return [line]
    return [line, cut_line(cut.deployment, cut.library, cut.texts_beyond, check.library, cut.beyond)]


def _neighbours(verdict: Verdict) -> str:
    retrieval, sparse = verdict.retrieval, next((o.sparse for o in verdict.outputs.values() if o.sparse), None)
    if sparse:
        return (f", top-{sparse['top_k']} terms {sparse['top_k_overlap']:.3f}, active terms "
                f"{sparse['active_overlap']:.3f}")
    return f", recall@10 {retrieval['recall_at_10']:.3f}" if retrieval else ""


def _ungated(verdict: Verdict) -> str:
    """The outputs measured but not served, which do not decide the verdict, and what they missed."""
    measured = [name for name, output in verdict.outputs.items() if not output.gated]
    if not measured:
        return ""
    missed = '; '.join(verdict.ungated) or f"{', '.join(measured)} within their gates"
    return f"; gated on {', '.join(verdict.gated_on)} (served); not gated: {missed}"


def _gate_on(judged: Gate | None) -> str:
    """The criterion a variant passes by the least and the output it is on (the gates differ per output)."""
    return f"{judged} on {judged.output}" if judged else "no gate"


def reference_text(check: LibraryCheck) -> str:
    """What the PyTorch module every variant is compared with was checked against, and how close it came."""
    if not check.checked:
        return f"Reference: {check.reference} ({check.reason})."
    parts = [f"{name} max abs {o.max_abs:.2g}" + (f", min cosine {o.min_cosine:.8f}" if o.min_cosine is not None
                                                   else "") for name, o in check.outputs.items()]
    norms = f"; embedding norms {check.norms[0]:.6f}-{check.norms[1]:.6f}" if check.norms else ""
    return (f"The PyTorch module against {check.reference} on {check.texts} texts: "
            f"{'pass' if check.passed else 'FAIL'} ({'; '.join(parts)}{norms}).")


def section(parity: ParityMetrics) -> Parts:
    parts: Parts = []
    checked = f"{reference_text(parity.reference)} " if parity.reference else ""
    if parity.variants:
        variants = parity.variants
        parts.append(("Parity against PyTorch", f"{checked}Real text at the shape corners and the whole corpus; "
                      "padding excluded.", [parity_table(variants), error_distribution(variants)]))
    elif checked:
        parts.append(("Parity against PyTorch", checked, []))
    for precision, outcome in parity.repair.items():
        chosen = outcome.chosen
        kept = (f"{len(chosen.blocked)} of {outcome.units} ({', '.join(chosen.blocked) or 'none'})"
                if chosen else f"none of {outcome.units}")
        base = ""
        if outcome.base:
            base = (f" Quantized as: {outcome.base}." if chosen
                    else f" Nothing was written; the search started from the base recipe: {outcome.base}.")
        charts = [repair_tradeoff(outcome)] if outcome.candidates or outcome.bases else []
        if outcome.bases or outcome.recipes:
            charts.append(recipes_table(outcome))
        if outcome.node_error.per_node:
            charts.append(node_error_figure(outcome))
        parts.append((f"{precision} precision repair", f"Outcome: {outcome.outcome}; units kept in fp32: "
                      f"{kept}.{base}", charts))
    return parts


SPEC = StepSpec(
    STEP, 3, "every variant vs PyTorch on real text; fp16/int8 precision repair", run, lines,
    sections=(Section("Parity against PyTorch", section),),
    needs=("model",), reads=("optimize",), machine=("torch", "onnxruntime"), owns=("parity", "repair"), writes=1.2,
    lighter="a lower batch.max_tokens or sequence.max, only the variants the deployment serves "
            "(-p parity.variants=served)",
    metrics=ParityMetrics, after="optimize", settings=ParitySettings, first_reads=("tolerances",),
    verdicts="variants")

"""report.html: one self-contained page (plotly embedded once, works offline) built from run.json."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import jinja2

from workbench.core.atomic import write_text
from workbench.core.catalog import Parts, Section
from workbench.core.record import RunRecord, StepEntry, StepStatus
from workbench.core.results import (
    BenchMetrics,
    ExportMetrics,
    OptimizeMetrics,
    ParityMetrics,
    TritonMetrics,
)
from workbench.report import figures
from workbench.report.recommend import recommend
from workbench.report.takeaways import openvino_int8_line, openvino_line

TEMPLATE = Path(__file__).parent / "templates" / "report.html.j2"
class Declared(Protocol):
    """A step declaration as far as the page goes (workbench.steps.StepSpec)."""

    @property
    def name(self) -> str: ...

    @property
    def sections(self) -> tuple[Section, ...]: ...


def pipeline_text(pipeline: dict[str, Any]) -> str:
    """The sentence-transformers pipeline the graph runs, and the similarity function the model declares."""
    prompts = ", ".join(f"{name} ({text!r})" for name, text in pipeline["prompts"].items()) or "none"
    default = f", default {pipeline['default_prompt_name']}" if pipeline.get("default_prompt_name") else ""
    override = f" OVERRIDDEN: {pipeline['override']}." if pipeline.get("override") else ""
    return (f"The graph runs {' -> '.join(pipeline['steps'])} ({pipeline['source']}), so its sentence_embedding is "
            f"what SentenceTransformer.encode() returns.{override} Similarity function the model declares: "
            f"{pipeline['similarity']}. Prompts (request parameter prompt_name): {prompts}{default}. Maximum "
            f"sequence length: {pipeline['max_seq_length'] or 'the tokenizer and position table'}.")


def pipeline_section(export: ExportMetrics) -> Parts:
    if not export.sentence_pipeline:
        return []
    return [("The model as its users run it", pipeline_text(export.sentence_pipeline), [])]


def reference_text(check: dict[str, Any]) -> str:
    """What the PyTorch module every variant is compared with was checked against, and how close it came."""
    if not check["checked"]:
        return f"Reference: {check['reference']} ({check['reason']})."
    parts = [f"{name} max abs {o['max_abs']:.2g}" + (f", min cosine {o['min_cosine']:.8f}" if "min_cosine" in o
                                                       else "") for name, o in check["outputs"].items()]
    norms = f"; embedding norms {check['norms'][0]:.6f}-{check['norms'][1]:.6f}" if "norms" in check else ""
    return (f"The PyTorch module against {check['reference']} on {check['texts']} texts: "
            f"{'pass' if check['passed'] else 'FAIL'} ({'; '.join(parts)}{norms}).")


def fusions_section(optimize: OptimizeMetrics) -> Parts:
    if not optimize.variants:
        return []
    decisions = (optimize.precisions or {}).get("decisions", {})
    decided = " ".join(f"{precision} {'built' if d['built'] else 'not built'}: {d['reason']}."
                       for precision, d in decisions.items())
    text = "Fused operators and node counts per variant." + (f" {decided}" if decided else "")
    parts: Parts = [("ONNX Runtime fusions", text, [figures.fusion_figure(optimize.variants)])]
    if optimize.openvino:
        parts.append(("OpenVINO, tried against the fp32 graph", f"{openvino_line(optimize.openvino)}.", []))
    if optimize.openvino_int8:
        parts.append(("OpenVINO int8 (NNCF), raced against the fastest graph",
                      f"{openvino_int8_line(optimize.openvino_int8)}.", []))
    return parts


def parity_section(parity: ParityMetrics) -> Parts:
    parts: Parts = []
    checked = f"{reference_text(parity.reference)} " if parity.reference else ""
    if parity.variants:
        variants = {name: verdict.recorded() for name, verdict in parity.variants.items()}
        parts.append(("Parity against PyTorch", f"{checked}Real text at the shape corners and the whole corpus; "
                      "padding excluded.", [figures.parity_table(variants), figures.error_distribution(variants)]))
    elif checked:
        parts.append(("Parity against PyTorch", checked, []))
    for precision, outcome in parity.repair.items():
        chosen = outcome.chosen
        kept = (f"{len(chosen.blocked)} of {outcome.units} ({', '.join(chosen.blocked) or 'none'})"
                if chosen else f"none of {outcome.units}")
        base = f" Quantized as: {outcome.base}." if outcome.base else ""
        recorded = outcome.recorded()
        charts = [figures.repair_tradeoff(recorded)]
        if outcome.bases or outcome.recipes:
            charts.append(figures.recipes_table(recorded))
        if outcome.node_error.get("per_node"):
            charts.append(figures.node_error_figure(recorded))
        parts.append((f"{precision} precision repair", f"Outcome: {outcome.outcome}; units kept in fp32: "
                      f"{kept}.{base}", charts))
    return parts


def triton_section(triton: TritonMetrics) -> Parts:
    if triton.served_parity is None:
        return []
    against = triton.served_reference or "PyTorch"
    served = {f"served {p}": r.recorded() for p, r in triton.served_parity.items()}
    served.update({f"served, prompt_name={name!r}": r.recorded() for name, r in triton.prompt_parity.items()})
    return [("Served parity", f"The deployment against {against} over HTTP and gRPC; each named prompt over HTTP "
             "against encode(texts, prompt_name=...).", [figures.parity_table(served)])]


def latency_section(bench: BenchMetrics) -> Parts:
    latency = bench.latency
    if not latency:
        return []
    warning = f"{disturbed_warning(bench)} " if latency.get("disturbed") else ""
    charts = [figures.latency_figure(latency), figures.speedup_figure(latency)]
    if latency.get("runners"):
        charts.append(figures.runners_table(latency))
    if latency.get("sessions"):
        charts.append(figures.sessions_table(latency))
    return [("In-process latency", warning + latency_text(latency), charts)]


def latency_text(latency: dict[str, Any]) -> str:
    """How the grid was measured, on the device it ran on."""
    if latency.get("device", "cpu") == "cpu":
        threads = f"{latency['threads']} thread{'s' * (latency['threads'] != 1)}"
        return (f"Interleaved rounds, {threads} for PyTorch (ONNX Runtime: the settings in the "
                "table below), median per call; speedup over PyTorch eager fp32 on the CPU. fp32 matmul peak "
                "measured in the same run (the faster of PyTorch and ONNX Runtime): "
                f"{latency['peaks']['fp32']:.0f} GFLOP/s.")
    peaks = latency["peaks"]
    graphs = "; ".join(f"{cell}: " + ", ".join(f"{v} {o}" for v, o in outcome.items())
                       for cell, outcome in latency.get("cuda_graph", {}).items())
    return ("Interleaved rounds on CUDA, median per call; every call ends when the GPU is done with it. End to end: "
            "numpy arrays in and out (what a server pays); on device: inputs copied to the GPU once per batch, "
            "outputs left there. Speedup over PyTorch eager fp32 on the same device with the same I/O (TF32 off). "
            f"Matmul peaks measured in the same run: fp32 {peaks['fp32']:.0f} GFLOP/s, fp16 (tensor cores) "
            f"{peaks['fp16']:.0f} GFLOP/s; each row's share is against its own precision's. CUDA graphs: "
            f"{graphs or 'none measured'}.")


def served_section(bench: BenchMetrics) -> Parts:
    served = bench.served or {}
    if "skipped" in served:
        return [("Served throughput and latency", f"Not measured: {served['skipped']}.", [])]
    if "rerank" in served:
        return [("Served throughput and latency", f"Load tool: {served['tool']} over {served['protocol']}; "
                 f"measured: {served['variant']}.", [figures.rerank_table(served["rerank"])])]
    if "batching_on" not in served:
        return []
    measured = f"{served['variant']} in the " if "variant" in served else ""
    parts: Parts = [("Served throughput and latency", f"Load tool: {served['tool']} over "
                     f"{served.get('protocol', 'http')}; one text per request; measured: {measured}"
                     f"{served['variant_plan'].get('layout', 'ensemble')} layout.",
                     [figures.throughput_figure(served), figures.breakdown_figure(served)])]
    if "efficiency" in served:
        parts.append(("Serving efficiency", "What the server delivers of what the same variant does in process on "
                      "the same texts with the same threads (targets: throughput >= 0.8, p50 <= 1.5x).",
                      [figures.efficiency_table(served["efficiency"])]))
    if "layouts" in served:
        parts.append(("Repository layouts", "The same variant served as an ensemble and as one fused Python model, "
                      "batching on.", [figures.layouts_figure(served["layouts"])]))
    return parts + [
        ("Dynamic batching search", _search_text(served["search"]), [figures.search_figure(served["search"])]),
        ("Where tokenization runs", "Text in, tokenized in Triton, against token ids sent straight to the ensemble's "
         "network model (tokenized in the client), same concurrencies.", [figures.tokenization_figure(served)])]


def _fill(record: RunRecord, step: str) -> str:
    return f"`workbench run --resume --output-dir {record.run_dir} --steps {step}`"


def _missing(record: RunRecord, step: StepEntry) -> str:
    """Why a section of `step` is empty, and how to fill it."""
    fill = f"run {_fill(record, step.name)} to fill it"
    if step.status is None:
        return f"Not in this run: the {step.name} step did not run; {fill}."
    if step.status == StepStatus.OK:
        return f"The {step.name} step ran but recorded nothing for this section; {fill}."
    state = {StepStatus.FAILED: "failed", StepStatus.RUNNING: "is still running"}.get(step.status,
                                                                                      f"was {step.status}")
    return f"The {step.name} step {state}" + (f" ({step.detail})" if step.detail else "") + f"; {fill}."


def readable_deployment(record: RunRecord) -> TritonMetrics | str | None:
    """The triton step's deployment when that step is ok now, or why its record cannot be read (damaged, or
    written by a workbench this one cannot read)."""
    try:
        return record.deployment()
    except ValueError as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"


def served_note(record: RunRecord) -> str:
    """What Triton serves from this run (the triton step's deployment, when that step is ok now)."""
    deployment = readable_deployment(record)
    if isinstance(deployment, str):
        return f"Served: unknown, the triton step's record is unreadable ({deployment}); run " \
               f"{_fill(record, 'triton')} to deploy again."
    if deployment is None:
        return (f"Served: nothing current (triton: {record.step_entry('triton').label}); run "
                f"{_fill(record, 'triton')} to deploy.")
    unverified = "" if deployment.verified else " (unverified)"
    return f"Served: {deployment.variant} via the {deployment.layout} layout{unverified}."


def sections(record: RunRecord, steps: tuple[Declared, ...]) -> Parts:
    """Every section the `steps` declare, in their order: its figures, or why it is empty. A skipped step shows
    what it measured before it stopped (the tensorrt step's profiles on a host without a GPU); a stale one says so
    first."""
    parts: Parts = []
    served = served_note(record)
    for section, step in ((section, record.step_entry(declared.name)) for declared in steps
                          for section in declared.sections):
        try:
            written = step.status in (StepStatus.OK, StepStatus.STALE, StepStatus.SKIPPED)
            typed = record.results(step.name) if written else None
            rendered = section.render(typed) if typed is not None else []
        except (KeyError, TypeError, ValueError) as exc:  # metrics an older workbench wrote, or a damaged record
            rendered = [(section.title, f"Could not be drawn from the recorded metrics ({type(exc).__name__}: "
                                        f"{exc}); run {_fill(record, step.name)} to measure again.", [])]
        else:
            if rendered and section.served:
                title, text, made = rendered[0]
                rendered[0] = (title, f"{served} {text}", made)
        if rendered and step.status in (StepStatus.STALE, StepStatus.SKIPPED):
            title, text, made = rendered[0]
            note = (f"STALE: {step.detail}; these figures are from before, run {_fill(record, step.name)} to "
                    "refresh them." if step.status == StepStatus.STALE else f"Skipped: {step.detail}.")
            rendered[0] = (title, f"{note} {text}", made)
        parts += rendered or [(section.title, _missing(record, step), [])]
    return parts


def _search_text(search: dict[str, Any]) -> str:
    chosen = search.get("chosen")
    if not chosen:
        return f"No configuration kept p99 under {search['p99_limit_ms']} ms at concurrency {search['concurrency']}."
    return (f"Best throughput with p99 under {search['p99_limit_ms']} ms at concurrency {search['concurrency']}: "
            f"max_queue_delay {chosen['max_queue_delay_us']} us, {chosen['instances']} instance(s): "
            f"{chosen['throughput']:.1f} req/s, p99 {chosen['p99']:.1f} ms.")


def disturbed_warning(bench: BenchMetrics) -> str:
    """The warning the report opens with when the in-process grid's own medians show other work distorted it."""
    disturbed = (bench.latency or {}).get("disturbed")
    if not disturbed:
        return ""
    more = f" (and {len(disturbed) - 1} more)" if disturbed[1:] else ""
    return (f"DISTURBED TIMINGS: {disturbed[0]}{more}. Other work on the host distorted the in-process grid, ratios "
            "included: do not compare or deploy by the speedups below; re-run the bench step on a quiet host.")


def headline(bench: BenchMetrics) -> list[str]:
    """A warning when other work loaded the host, then what batching and serving delivered (the speedups are in
    the recommendation)."""
    lines = []
    host = bench.host
    if host:  # runs before busy_before recorded only the load average, which counts the run's own earlier steps
        busy, measure = ((host["busy_before"], "other work kept {:.1f} of {} cores busy") if "busy_before" in host
                         else (host["load_before"], "load average {:.1f} on {} cores"))
        if busy > host["cpu_count"] / 2:
            lines.append(f"The host was busy when measuring began ({measure.format(busy, host['cpu_count'])}): "
                         "absolute times do not hold; ratios hold only where the other "
                         "work slowed every runner alike.")
    served = bench.served or {}
    if "batching_on" in served and "batching_off" in served:
        top = str(max(served["levels"]))
        on, off = served["batching_on"]["text"][top], served["batching_off"]["text"][top]
        lines.append(f"Dynamic batching at concurrency {top}: {on['throughput']:.1f} vs {off['throughput']:.1f} "
                     f"req/s ({on['throughput'] / off['throughput']:.2f}x).")
    if "efficiency" in served:
        efficiency = served["efficiency"]
        lines.append(f"Serving efficiency at concurrency {efficiency['concurrency']}: "
                     f"{efficiency['throughput_ratio']['batching_on']:.2f} of in-process throughput (batching on)"
                     + (f"; p50 at concurrency 1 {efficiency['p50_ratio_c1']:.2f}x in process."
                        if "p50_ratio_c1" in efficiency else "."))
    return lines


def recommendation_rows(record: RunRecord) -> list[dict[str, str]]:
    """The recommendation table: per goal the variant, its speedup and parity margin, or what to run to get one."""
    rows = []
    disturbed = " (disturbed timings)" if record.metric("bench.latency.disturbed") else ""
    for choice in recommend(record):
        found = choice.variant is not None
        rows.append({"goal": choice.goal, "cell": choice.where, "variant": choice.variant or "none",
                     "speedup": f"{choice.speedup:.3g}x{disturbed}" if found else "",
                     "gate": (f"{choice.gate} on {choice.gate.output}" if choice.gate else "")
                     + (f"; nearest neighbours as PyTorch's: top-1 {choice.retrieval['agreement_at_1']:.1%}, "
                        f"top-10 {choice.retrieval['recall_at_10']:.1%}" if choice.retrieval else ""),
                     "why": choice.reason + ("" if found else f"; run {_fill(record, ','.join(choice.steps))}.")
                     + _served_differs(record, choice.variant)})
    return rows


def _features(env: dict[str, Any]) -> str:
    """The CPU flags that decide int8 and fp32 speed (runs recorded before they were, say nothing)."""
    features = env.get("cpu_features")
    if features is None:
        return ""
    return f"; {' '.join(features['flags']) or 'no AVX2'}; int8 dot product: {features['int8_dot_product'] or 'none'}"


def _served_differs(record: RunRecord, variant: str | None) -> str:
    """A note when Triton serves another variant than the one recommended (the triton step chose before bench)."""
    deployment = readable_deployment(record)
    if variant is None or not isinstance(deployment, TritonMetrics) or deployment.variant == variant:
        return ""
    return (f". Triton serves {deployment.variant} (the triton step's order, chosen before bench measured); to "
            f"serve {variant}: {_fill(record, 'triton,bench,report')[:-1]} -p triton.variant={variant}`")


def build_report(record: RunRecord, dest: Path, steps: tuple[Declared, ...]) -> Path:
    """Render the record's sections as the `steps` declare them; the step writing the report leaves itself out of
    the summary."""
    rendered = []
    first = True
    for title, text, made in sections(record, steps):
        html_parts = []
        for figure in made:
            html_parts.append(figure.to_html(full_html=False, include_plotlyjs=first, config={"responsive": True}))
            first = False
        rendered.append({"title": title, "text": text, "figures": html_parts})
    env = record.environment
    config = record.config
    steps = [step for step in record.step_entries() if step.status != StepStatus.RUNNING]
    bench = record.step_entry("bench")
    measured = BenchMetrics.model_validate(bench.metrics) if bench.status in (StepStatus.OK, StepStatus.STALE) else None
    page = jinja2.Template(TEMPLATE.read_text(encoding="utf-8"), autoescape=True).render(
        title=f"{config.model} · {config.task}", created=record.created,
        environment=f"{env['cpu']} ({env['cpu_count']} cores{_features(env)}), GPU: {env['gpu'] or 'none'}, "
                    f"onnxruntime {env['packages'].get('onnxruntime') or env['packages'].get('onnxruntime-gpu')}",
        steps=steps, headline=headline(measured) if measured else [], sections=rendered,
        warning=disturbed_warning(measured) if measured else "",
        recommendations=recommendation_rows(record), served=served_note(record))
    return write_text(dest, page)

"""report.html: one self-contained page (plotly embedded once, works offline) built from run.json."""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import jinja2
from markupsafe import Markup, escape

from workbench.core.advice import in_lab, run_again
from workbench.core.atomic import write_text
from workbench.core.record import RunRecord, StepEntry, StepStatus
from workbench.core.results import HostEnvironment
from workbench.graphs.tables import ExportMetrics
from workbench.report.figures import Snippet
from workbench.report.recommend import recommend

TEMPLATE = Path(__file__).parent / "templates" / "report.html.j2"
Parts = list[tuple[str, str, list[Any]]]  # a report section's (title, text, figures)


@dataclass(frozen=True)
class Section:
    """Part of report.html, declared by the step whose metrics fill it (`StepSpec.sections`): its title and how the
    metrics render (none: the step left nothing); a served section names what Triton serves."""

    title: str
    render: Callable[[Any], Parts]  # the step's metrics model (StepSpec.metrics) in, parts out
    served: bool = False


class Declared(Protocol):
    """A step declaration as far as the page goes (workbench.steps.StepSpec)."""

    @property
    def name(self) -> str: ...

    @property
    def sections(self) -> tuple[Section, ...]: ...

    @property
    def headline(self) -> Callable[[Any], list[str]] | None: ...

    @property
    def warning(self) -> Callable[[Any], str] | None: ...

    @property
    def served(self) -> Callable[[RunRecord], str] | None: ...

    @property
    def served_differs(self) -> Callable[[RunRecord, str], str] | None: ...


def served_note(record: RunRecord, steps: tuple[Declared, ...]) -> str:
    """What the served sections open with: what the step that deploys says it serves (`StepSpec.served`)."""
    return next((step.served(record) for step in steps if step.served), "")


def again_both_ways(record: RunRecord, step: str, settings: dict[str, object] | None = None) -> str:
    """The same steps (and `settings`) both ways, the way the user is working first: `run 07_bench.ipynb (from a
    terminal: `workbench run ... --steps bench`)` in JupyterLab, `run `workbench run ... --steps bench` (in
    JupyterLab: 07_bench.ipynb)` elsewhere."""
    steps = step.split(",")
    notebooks = run_again(steps, settings=settings, lab=True)
    line = run_again(steps, record.run_dir, settings, lab=False)
    if in_lab():
        return f"{notebooks} (from a terminal: `{line}`)"
    return f"run `{line}` (in JupyterLab: {notebooks.removeprefix('run ')})"


def code(text: str) -> Markup:
    """`text` escaped, its `quoted` parts as <code>."""
    return Markup(re.sub(r"`([^`]+)`", r"<code>\1</code>", str(escape(text))))


def _missing(record: RunRecord, step: StepEntry) -> str:
    """Why a section of `step` is empty, and how to fill it."""
    fill = f"{again_both_ways(record, step.name)} to fill it"
    if step.status is None:
        return f"Not in this run: the {step.name} step did not run; {fill}."
    if step.status == StepStatus.OK:
        return f"The {step.name} step ran but recorded nothing for this section; {fill}."
    state = {StepStatus.FAILED: "failed", StepStatus.RUNNING: "is still running"}.get(step.status,
                                                                                      f"was {step.status}")
    return f"The {step.name} step {state}" + (f" ({step.detail})" if step.detail else "") + f"; {fill}."


def sections(record: RunRecord, steps: tuple[Declared, ...]) -> Parts:
    """Every section the `steps` declare, in their order: its figures, or why it is empty. A skipped step shows
    what it measured before it stopped (the tensorrt step's profiles on a host without a GPU); a stale one says so
    first."""
    parts: Parts = []
    served = served_note(record, steps)
    for section, step in ((section, record.step_entry(declared.name)) for declared in steps
                          for section in declared.sections):
        try:
            written = step.status in (StepStatus.OK, StepStatus.STALE, StepStatus.SKIPPED)
            typed = record.results(step.name) if written else None
            rendered = section.render(typed) if typed is not None else []
        except (KeyError, TypeError, ValueError) as exc:  # metrics an older workbench wrote, or a damaged record
            rendered = [(section.title, f"Could not be drawn from the recorded metrics ({type(exc).__name__}: "
                                        f"{exc}); {again_both_ways(record, step.name)} to measure again.", [])]
        else:
            if rendered and section.served:
                title, text, made = rendered[0]
                rendered[0] = (title, f"{served} {text}", made)
        if rendered and step.status in (StepStatus.STALE, StepStatus.SKIPPED):
            title, text, made = rendered[0]
            note = (f"STALE: {step.detail}; these figures are from before, {again_both_ways(record, step.name)} to "
                    "refresh them." if step.status == StepStatus.STALE else f"Skipped: {step.detail}.")
            rendered[0] = (title, f"{note} {text}", made)
        parts += rendered or [(section.title, _missing(record, step), [])]
    return parts


def opening(record: RunRecord, steps: tuple[Declared, ...]) -> tuple[list[str], list[str]]:
    """What the page opens with: the lines and warnings the `steps` declare (`StepSpec.headline`, `.warning`), from
    the metrics of those that are ok or stale (metrics that cannot be read open nothing: their section says why)."""
    lines, warnings = [], []
    for declared in steps:
        if record.status(declared.name) not in (StepStatus.OK, StepStatus.STALE):
            continue
        try:
            metrics = record.results(declared.name) if declared.headline or declared.warning else None
        except (KeyError, TypeError, ValueError):  # metrics an older workbench wrote, or a damaged record
            metrics = None
        if metrics is None:
            continue
        lines += declared.headline(metrics) if declared.headline else []
        warning = declared.warning(metrics) if declared.warning else ""
        warnings += [warning] if warning else []
    return lines, warnings


def recommendation_rows(record: RunRecord, steps: tuple[Declared, ...]) -> list[dict[str, str]]:
    """The recommendation table: per goal the variant, its speedup and parity margin, or what to run to get one,
    and where the deployment serves another variant, what the step that deploys says (`StepSpec.served_differs`)."""
    differs = next((step.served_differs for step in steps if step.served_differs), None)
    rows = []
    for choice in recommend(record):
        run = ",".join(choice.steps)
        disturbed = " (disturbed timings: not a speed to expect)" if choice.disturbed else ""
        found = choice.variant is not None
        rows.append({"goal": choice.goal, "cell": choice.where, "variant": choice.variant or "none",
                     "speedup": f"{choice.speedup:.3g}x{disturbed}" if found else "",
                     "gate": (f"{choice.gate} on {choice.gate.output}" if choice.gate else "")
                     + (f"; nearest neighbours as PyTorch's: top-1 {choice.retrieval['agreement_at_1']:.1%}, "
                        f"top-10 {choice.retrieval['recall_at_10']:.1%}" if choice.retrieval else ""),
                     "why": choice.reason + ("" if found else f"; {again_both_ways(record, run)}.")
                     + (differs(record, choice.variant) if differs and choice.variant else "")})
    return rows


def _features(env: HostEnvironment) -> str:
    """The CPU flags that decide int8 and fp32 speed (runs recorded before they were, say nothing)."""
    features = env.cpu_features
    if features is None:
        return ""
    return f"; {' '.join(features.flags) or 'no AVX2'}; int8 dot product: {features.int8_dot_product or 'none'}"


def build_report(record: RunRecord, dest: Path, steps: tuple[Declared, ...]) -> Path:
    """Render the record's sections as the `steps` declare them; the step writing the report leaves itself out of
    the summary."""
    rendered = []
    first = True
    for title, text, made in sections(record, steps):
        html_parts = []
        for figure in made:
            if isinstance(figure, Snippet):
                html_parts.append(figure.to_html())
                continue
            html_parts.append(figure.to_html(full_html=False, include_plotlyjs=first, config={"responsive": True}))
            first = False
        rendered.append({"title": title, "text": text, "figures": html_parts})
    env = record.environment
    config = record.config
    export = record.results_of(ExportMetrics)
    headline, warnings = opening(record, steps)
    entries = [entry for entry in record.step_entries() if entry.status != StepStatus.RUNNING]
    templates = jinja2.Environment(autoescape=True)
    templates.filters["code"] = code
    page = templates.from_string(TEMPLATE.read_text(encoding="utf-8")).render(
        title=f"{config.model} · {export.task if export and export.task else config.task_choice.name}",
        created=record.created,
        environment=f"{env.cpu} ({env.cpu_count} cores{_features(env)}), GPU: {env.gpu or 'none'}, "
                    f"onnxruntime {env.packages.get('onnxruntime') or env.packages.get('onnxruntime-gpu')}",
        settings=", ".join(record.own_settings()) or "none",
        steps=entries, headline=headline, sections=rendered, warning=" ".join(warnings),
        recommendations=recommendation_rows(record, steps), served=served_note(record, steps))
    return write_text(dest, page)

"""report.html: one self-contained page (plotly embedded once, works offline) built from run.json."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2

from workbench import figures
from workbench.atomic import write_text

TEMPLATE = Path(__file__).parent / "templates" / "report.html.j2"


def _sections(metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """(title, text, figures) for every part of the run that left metrics."""
    sections: list[dict[str, Any]] = []

    def add(title: str, text: str, *made: Any) -> None:
        sections.append({"title": title, "text": text, "figures": [f for f in made if f is not None]})

    if "fusions" in metrics:
        add("ONNX Runtime fusions", "Fused operators and node counts per variant.",
            figures.fusion_figure(metrics["fusions"]))
    parity = metrics.get("parity", {})
    if parity.get("variants"):
        add("Parity against PyTorch", "Real text at the shape corners and the whole corpus; padding excluded.",
            figures.parity_table(parity["variants"]), figures.error_distribution(parity["variants"]))
    for precision, outcome in parity.get("repair", {}).items():
        add(f"{precision} precision repair", f"Outcome: {outcome['outcome']}; nodes kept in fp32: "
            f"{len(outcome['chosen']['blocked']) if outcome.get('chosen') else 'none'} of {outcome['units']}.",
            figures.repair_tradeoff(outcome))
    if "latency" in metrics:
        latency = metrics["latency"]
        add("In-process latency", f"Interleaved rounds, {latency['threads']} threads, median per call; speedup "
            f"over PyTorch eager fp32. Matmul peak measured in the same run: {latency['peak_gflops']:.0f} GFLOP/s.",
            figures.latency_figure(latency), figures.speedup_figure(latency))
    served = metrics.get("served", {})
    if "batching_on" in served:
        add("Served throughput and latency", f"Load tool: {served['tool']}; one text per request.",
            figures.throughput_figure(served), figures.breakdown_figure(served))
        add("Dynamic batching search", _search_text(served["search"]), figures.search_figure(served["search"]))
        add("Where tokenization runs", "Text to the ensemble (tokenizer in Triton) against token ids sent "
            "straight to the model (tokenized in the client), same concurrencies.", figures.tokenization_figure(served))
    if "served_parity" in metrics:
        add("Served parity", "The deployed ensemble against PyTorch over HTTP and gRPC.",
            figures.parity_table({f"served {p}": r for p, r in metrics["served_parity"].items()}))
    if "generation" in metrics:
        add("Translation and text generation", "transformers generate against CTranslate2, both served through "
            "Triton's Python backend; greedy decoding, one text per request.",
            *figures.generation_figures(metrics["generation"]))
    if "tensorrt" in metrics:
        add("TensorRT shape profiles", "Profiles designed from the corpus token lengths.",
            figures.length_histogram(metrics["tensorrt"]), figures.padding_figure(metrics["tensorrt"]))
    return sections


def _search_text(search: dict[str, Any]) -> str:
    chosen = search.get("chosen")
    if not chosen:
        return f"No configuration kept p99 under {search['p99_limit_ms']} ms at concurrency {search['concurrency']}."
    return (f"Best throughput with p99 under {search['p99_limit_ms']} ms at concurrency {search['concurrency']}: "
            f"max_queue_delay {chosen['max_queue_delay_us']} us, {chosen['instances']} instance(s): "
            f"{chosen['throughput']:.1f} req/s, p99 {chosen['p99']:.1f} ms.")


def headline(metrics: dict[str, Any]) -> list[str]:
    """One sentence per speedup the run measured."""
    lines = []
    latency = metrics.get("latency", {})
    for cell, best in latency.get("best", {}).items():
        lines.append(f"{cell}: fastest variant that passes parity is {best['variant']}, "
                     f"{best['speedup']:.2f}x PyTorch eager.")
    served = metrics.get("served", {})
    if "batching_on" in served and "batching_off" in served:
        top = str(max(served["levels"]))
        on, off = served["batching_on"]["text"][top], served["batching_off"]["text"][top]
        lines.append(f"Dynamic batching at concurrency {top}: {on['throughput']:.1f} vs {off['throughput']:.1f} "
                     f"req/s ({on['throughput'] / off['throughput']:.2f}x).")
    return lines


def build_report(record: Any, dest: Path) -> Path:
    data = record.data
    rendered = []
    first = True
    sections = _sections(data["metrics"])
    for section in sections:
        html_parts = []
        for figure in section["figures"]:
            html_parts.append(figure.to_html(full_html=False, include_plotlyjs=first, config={"responsive": True}))
            first = False
        rendered.append({**section, "figures": html_parts})
    env = data["environment"]
    steps = {name: {"status": step["status"], "seconds": step.get("seconds", ""),
                    "label": "ok, verified: false" if step.get("verified") is False else step["status"],
                    "note": "still running while it writes this report" if step["status"] == "running"
                    else (step.get("unverified_reason") or step.get("reason") or step.get("error") or ""
                          ).split("\n")[0]}
             for name, step in data["steps"].items()}
    page = jinja2.Template(TEMPLATE.read_text(encoding="utf-8"), autoescape=True).render(
        title=f"{data['config']['model']} · {data['config']['task']}", created=data["created"],
        environment=f"{env['cpu']} ({env['cpu_count']} cores), GPU: {env['gpu'] or 'none'}, "
                    f"onnxruntime {env['packages'].get('onnxruntime') or env['packages'].get('onnxruntime-gpu')}",
        steps=steps, headline=headline(data["metrics"]), sections=rendered)
    return write_text(dest, page)

"""The verdict line each step notebook ends with, computed from what the run recorded: one function per step, which
the step's declaration names (`StepSpec.takeaway`)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from workbench.core.config import RepairSettings
from workbench.core.record import RunRecord, StepStatus
from workbench.core.results import ParityMetrics, TritonMetrics, Verdict
from workbench.graphs.attention import ATTENTION_OPS
from workbench.measure.latency import disturbance_note
from workbench.report.recommend import Gate, gate, recommend


class Declared(Protocol):
    """A step declaration as far as its verdict line goes (workbench.steps.StepSpec)."""

    @property
    def name(self) -> str: ...

    @property
    def takeaway(self) -> Callable[[RunRecord], list[str]]: ...


def takeaway(step: Declared, record: RunRecord) -> str:
    """One or a few lines: what the step found (its declared `takeaway`), or why it did not run."""
    entry = record.step_entry(step.name)
    if entry.status == StepStatus.OK:
        return "\n".join(step.takeaway(record))
    # a skipped step can still have found something, e.g. TensorRT's profiles
    found = step.takeaway(record) if entry.status == StepStatus.SKIPPED and entry.metrics else []
    return "\n".join([f"{step.name}: {entry.label} - {entry.detail.splitlines()[0] if entry.detail else ''}",
                      *found])


def export_lines(record: RunRecord) -> list[str]:
    info = record.metric("export")
    dynamic = [name for name, axes in info["io"]["inputs"].items() if axes[:2] == ["batch", "sequence"]]
    lines = [f"{info['architecture']}: {info['parameters']:,} parameters exported to ONNX opset {info['opset']} "
             f"({info['nodes']} nodes, onnx.checker passed); batch and sequence axes dynamic on "
             f"{len(dynamic)} of {len(info['io']['inputs'])} inputs"]
    sequence = info.get("sequence")
    if sequence:
        lines.append(f"tokens per text: {sequence['min']}-{sequence['max']} (opt {sequence['opt']}); max "
                     f"{sequence['sources']['max']}; the model takes {info['max_sequence']}")
    pipeline = info.get("sentence_pipeline")
    if pipeline:
        override = f"; {pipeline['override']}" if pipeline.get("override") else ""
        options = ["lowercased first (do_lower_case)"] if pipeline.get("do_lower_case") else []
        if pipeline.get("include_prompt") is False:
            options.append("pooled without the prompt's tokens (include_prompt: false)")
        lines.append(f"in the graph: {' -> '.join(pipeline['steps'])} "
                     f"({'from modules.json' if pipeline['declared'] else 'no sentence-transformers files'}), "
                     f"similarity {pipeline['similarity']}{override}"
                     + "".join(f"; {option}" for option in options))
    return lines


def optimize_lines(record: RunRecord) -> list[str]:
    variants = record.metric("optimize.variants")
    layers = record.metric("export.num_layers")
    fp32 = variants.get("fp32", {})
    attention = sum(fp32.get("fused", {}).get(op, 0) for op in ATTENTION_OPS)
    fused = (f"Attention fused in {attention} of {layers} layers" if layers else f"{attention} Attention nodes fused")
    unavailable = fp32.get("unavailable")
    if unavailable and "Attention" in unavailable["fusions"]:
        fused = f"no attention fusion for this family: {unavailable['reason']}"
    borrowed = fp32.get("borrowed")
    if borrowed and borrowed["kept"]:
        fused += f" ({borrowed['rules']}'s rules borrowed, attention {borrowed['attention']}; {borrowed['reason']})"
    sizes = ", ".join(f"{name} {stats['megabytes']:.0f} MB" for name, stats in variants.items() if "megabytes" in stats)
    lines = [f"{fused}; fp32 graph {record.metric('export.nodes')} -> {fp32.get('nodes')} nodes",
             f"variants built: {sizes}"]
    decisions = record.metric("optimize.precisions.decisions") or {}
    lines += [f"{precision} {'built' if d['built'] else 'not built'}: {d['reason']}"
              for precision, d in decisions.items()]
    if fp32.get("form"):
        lines.append(f"layer norms {fp32['form']['chosen']}: {fp32['form']['reason']}")
    openvino = record.metric("optimize.openvino")
    if openvino:
        lines.append(openvino_line(openvino))
    openvino_int8 = record.metric("optimize.openvino_int8")
    if openvino_int8:
        lines.append(openvino_int8_line(openvino_int8))
    return lines


def openvino_line(openvino: dict[str, Any]) -> str:
    """The OpenVINO trial in one line: kept, not kept and why (with how to keep it anyway), or not tried and why."""
    if openvino["kept"]:
        return f"OpenVINO fp32 kept as the openvino variant: {openvino['reason']}"
    if "ms" not in openvino:
        return f"OpenVINO fp32 {openvino['reason']}"
    anyway = "; to keep it anyway: -p openvino=always" if openvino.get("matches") else ""
    return f"OpenVINO fp32 not kept: {openvino['reason']}{anyway}"


def openvino_int8_line(openvino_int8: dict[str, Any]) -> str:
    """NNCF's int8 on OpenVINO in one line: kept (its accuracy is the parity step's to judge), not kept and why, or
    not tried and why."""
    if openvino_int8["kept"]:
        return f"OpenVINO int8 (NNCF) kept as the openvino_int8 variant: {openvino_int8['reason']}"
    if "ms" not in openvino_int8:
        return f"OpenVINO int8 (NNCF) {openvino_int8['reason']}"
    return f"OpenVINO int8 (NNCF) not kept: {openvino_int8['reason']}; to keep it anyway: -p openvino=always"


def parity_lines(record: RunRecord) -> list[str]:
    parity = ParityMetrics.model_validate(record.metric("parity") or {})
    passed = [name for name, v in parity.variants.items() if v.passed]
    lines = [*_reference(parity.reference),
             f"parity: {len(passed)} of {len(parity.variants)} variants pass ({', '.join(passed) or 'none'})"]
    lines += [f"  {name}: {'pass' if v.passed else 'FAIL'}, {_gate_on(gate(v))}{_neighbours(v)}"
              for name, v in parity.variants.items()]
    for precision, outcome in parity.repair.items():
        chosen = outcome.chosen
        spent = (f"{outcome.seconds:.0f} s of its {outcome.budget_s:g} s budget"
                 if outcome.seconds is not None and outcome.budget_s else "")
        if outcome.outcome == "repaired" and chosen:
            base = f", quantized as {outcome.base}" if outcome.base else ""
            stopped = f"; the search stopped early: {outcome.stopped}" if outcome.stopped else ""
            built = len(outcome.candidates)
            lines.append(f"{precision}_repaired keeps {len(chosen.blocked)} of {outcome.units} units in fp32"
                         f"{base} ({built} candidate{'s' if built != 1 else ''} built{stopped}"
                         f"{'; ' + spent if spent else ''})"
                         + (f"; {outcome.race['reason']}" if outcome.race else ""))
        else:
            more = ""
            if outcome.stopped and "repair.budget_s" in outcome.stopped and outcome.budget_s:
                budget = max(2 * outcome.budget_s, RepairSettings.model_fields["budget_s"].default)
                more = (f" (more time: workbench run --resume --output-dir {record.run_dir} --steps parity "
                        f"-p repair.budget_s={budget:g})")
            lines.append(f"{precision} repair: {outcome.outcome}{more}")
    return lines


def _reference(check: dict[str, Any] | None) -> list[str]:
    """The PyTorch module against the model's own library, in one line."""
    if not check:
        return []
    if not check["checked"]:
        return [f"reference: {check['library']} (not checked against a library call: {check['reason']})"]
    primary = list(check["outputs"].values())[-1]
    cosine = f", min cosine {primary['min_cosine']:.6f}" if "min_cosine" in primary else ""
    line = f"PyTorch module vs {check['library']}: {'pass' if check['passed'] else 'FAIL'}, max abs " \
        f"{primary['max_abs']:.2g}{cosine}"
    cut = check.get("cut")
    return [line, cut_line(cut, check["library"], cut.get("beyond") or {})] if cut else [line]


def cut_line(cut: dict[str, Any], library: str, beyond: dict[str, Any]) -> str:
    """Where the run cuts texts against where the model's library does, in words: equal up to the run's cut, and
    what the texts past it get (`beyond`: their comparison, when the run cuts shorter)."""
    deployment, own, count = cut["deployment"], cut["library"], cut["texts_beyond"]
    if deployment >= own:
        return (f"texts are cut at {deployment} tokens, where {library} cuts them ({_texts(count)} longer, inside the "
                "gate)")
    worst = ""
    if beyond:
        primary = list(beyond["outputs"].values())[-1]
        worst = f": min cosine {primary['min_cosine']:.4f}" if "min_cosine" in primary else \
            f": max abs {primary['max_abs']:.3g}"
    return (f"equal to {library} up to {deployment} tokens; longer texts are cut at {deployment} where {library} "
            f"cuts at {own} ({_texts(count)} longer{worst}; leave sequence.max at auto to cut where the library "
            "does)")


def _texts(count: int) -> str:
    return f"{count} checked text{'' if count == 1 else 's'}"


def _neighbours(verdict: Verdict) -> str:
    retrieval = verdict.retrieval
    return f", recall@10 {retrieval['recall_at_10']:.3f}" if retrieval else ""


def triton_lines(record: RunRecord) -> list[str]:
    deployment = TritonMetrics.model_validate(record.metric("triton"))
    parity = " and ".join(f"{PROTOCOLS.get(protocol, protocol)} {'pass' if r.passed else 'FAIL'}"
                          for protocol, r in (deployment.served_parity or {}).items())
    verified = "verified" if deployment.verified else "NOT verified (allow_unverified)"
    against = f" against {deployment.served_library}" if deployment.served_library else ""
    prompts = ", ".join(f"{name or '(empty)'} {'pass' if r.passed else 'FAIL'}"
                        for name, r in deployment.prompt_parity.items())
    flavor = deployment.flavor.value if deployment.flavor else "?"
    cut = record.metric("triton.cut")
    beyond = next(iter((cut or {}).get("beyond", {}).values()), {})
    within = f" on texts up to {cut['deployment']} tokens" if cut and not cut["gated"] else ""
    replaced = record.metric("triton.replaced")
    runtime = ", run by OpenVINO" if (deployment.variant or "").startswith("openvino") else ""
    return [f"served {deployment.variant} ({verified}) as {deployment.name!r} via the {deployment.layout} "
            f"layout ({flavor}{runtime})", f"served parity{against}{within}: {parity or 'not checked'}",
            *([cut_line(cut, deployment.served_library or "the library", beyond)] if cut else []),
            *([f"replaced the deployment {deployment.name!r} that run {replaced} had published (name it apart with "
               "-p triton.name=... to keep both)"] if replaced else []),
            *([f"prompts (request parameter prompt_name) against encode(prompt_name=...): {prompts}"]
              if prompts else [])]


def _disturbed(record: RunRecord) -> list[str]:
    found = record.metric("bench.latency.disturbed") or []
    return [f"{disturbance_note(found)} below"] if found else []


def bench_lines(record: RunRecord) -> list[str]:
    lines = [*_disturbed(record), *(r.line() for r in recommend(record))]
    served = record.metric("bench.served") or {}
    if "skipped" in served:
        lines.append(f"served benchmark skipped: {served['skipped']}")
    return lines


def report_lines(record: RunRecord) -> list[str]:
    return [*_disturbed(record), *(r.line() for r in recommend(record)), f"report: {record.run_dir / 'report.html'}"]


PROTOCOLS = {"http": "HTTP", "grpc": "gRPC"}


def _gate_on(judged: Gate | None) -> str:
    """The criterion a variant passes by the least and the output it is on (the gates differ per output)."""
    return f"{judged} on {judged.output}" if judged else "no gate"

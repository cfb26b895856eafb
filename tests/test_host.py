"""What a run builds follows the deployment's target, on hosts this suite does not run on: CPU flags and speeds are
faked here, never assumed. A repair ends within its budget with an honest verdict, and the parity lab's reference is
kept between runs of the same model and texts."""
from __future__ import annotations

import pytest

from workbench.core.config import RunConfig
from workbench.core.data import load_corpus
from workbench.core.record import RunRecord
from workbench.graphs.tables import PrecisionDecision
from workbench.measure import precisions as precisions_module
from workbench.precision.tables import ParityMetrics
from workbench.serving.flavor import Flavor
from workbench.serving.plan import CPU_FP32_FIRST, CPU_INT8_FIRST, preference
from workbench.steps import export, optimize, parity, verdict_line
from workbench.steps.optimize import precisions as optimize_precisions

SMALL = {"batch": {"min": 1, "opt": 4, "max": 8}, "sequence": {"max": 64}, "threads": 1}
AVX2 = {"avx2", "fma", "sse4_2"}  # a common cloud host: no AVX-512, no VNNI, no AMX
SAPPHIRE = {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "amx_tile", "amx_int8", "amx_bf16", "avx512_fp16"}


def _host(monkeypatch, flags: set[str], speedup: dict[str, float] | None = None) -> list[dict]:
    """This host as `flags` and, where the optimize step times a variant against fp32, `speedup` per precision at
    every goal cell (None: the step must not time anything here). The timings asked for are listed."""
    asked: list[dict] = []
    monkeypatch.setattr(precisions_module, "cpu_flags", lambda: set(flags))

    def timed(files, feeds, providers, threads, device):
        asked.append(dict(files))
        assert speedup is not None, "a target that is not this host is never measured"
        return ({name: {cell: speedup[name] for cell in feeds} for name in files if name != "fp32"},
                {name: {cell: 10.0 / speedup.get(name, 1.0) for cell in feeds} for name in files})
    monkeypatch.setattr(optimize_precisions, "paired_speedups", timed)
    return asked


def _run(model, root, steps=(export, optimize), **settings):
    config = RunConfig.model_validate({"model": str(model), **SMALL, **settings})
    record = RunRecord.create(root / "run", config)
    for step in steps:
        assert step.run(config, record).status == "ok", record.data["steps"]
    return config, record


def test_auto_skips_int8_measured_slower_and_its_repair_and_serves_fp32_first(tiny_bert, tmp_path, monkeypatch):
    asked = _host(monkeypatch, AVX2, {"int8": 0.95})
    _, record = _run(tiny_bert, tmp_path, steps=(export, optimize, parity))
    assert [sorted(files) for files in asked] == [["fp32", "int8"]], "fp16: no fp16 arithmetic here, not timed"
    decisions = record.metric("optimize.precisions.decisions")
    assert not decisions["int8"]["built"] and decisions["int8"]["pays"] is False
    assert decisions["int8"]["reason"].startswith("does not pay on this host: 0.95x fp32 at b1 s16")
    assert "no fp16 arithmetic" in decisions["fp16"]["reason"] and not decisions["fp16"]["built"]
    assert set(record.variants()) == {"original", "fp32"} and not record.metric("parity.repair")
    assert "int8 not built: does not pay on this host" in verdict_line("optimize", record)
    assert "-p precisions=[fp32,int8]" in verdict_line("optimize", record), "what to run to get it"
    assert preference(Flavor.PYTHON_ORT, PrecisionDecision.model_validate(decisions["int8"]))[0] == CPU_FP32_FIRST


def test_auto_builds_and_repairs_int8_where_it_pays_even_without_vnni(tiny_bert, tmp_path, monkeypatch):
    _host(monkeypatch, AVX2, {"int8": 1.3})
    strict = {"sentence_embedding": {"min_cosine": 0.999995}}
    _, record = _run(tiny_bert, tmp_path, steps=(export, optimize, parity), tolerances=strict)
    decision = record.metric("optimize.precisions.decisions.int8")
    assert decision["built"] and decision["pays"] and "1.30x fp32" in decision["reason"]
    assert record.metric("parity.repair.int8.outcome") is not None, "a failing int8 that pays is repaired"
    assert preference(Flavor.PYTHON_ORT, PrecisionDecision.model_validate(decision))[0] == CPU_INT8_FIRST


def test_an_explicit_list_builds_what_it_names_and_measures_it_for_the_serving_order(tiny_bert, tmp_path,
                                                                                    monkeypatch):
    _host(monkeypatch, AVX2, {"int8": 0.9, "fp16": 0.5})
    _, record = _run(tiny_bert, tmp_path, precisions=["fp32", "fp16", "int8"])
    decisions = record.metric("optimize.precisions.decisions")
    assert decisions["int8"]["built"] and decisions["int8"]["reason"].startswith("configured (precisions); measured")
    assert decisions["fp16"]["built"] and decisions["int8"]["pays"] is False
    assert {"fp16", "int8"} <= set(record.variants())
    assert preference(Flavor.PYTHON_ORT, PrecisionDecision.model_validate(decisions["int8"]))[0] == CPU_FP32_FIRST


@pytest.mark.parametrize(("target", "built"), [("avx512_vnni", True), ("amx", True), ("avx2", False)])
def test_a_named_target_decides_by_its_instructions_without_measuring_here(tiny_bert, tmp_path, monkeypatch,
                                                                           target, built):
    _host(monkeypatch, AVX2)  # this host has no VNNI: the named target's instructions decide
    _, record = _run(tiny_bert, tmp_path, target={"cpu": target})
    decision = record.metric("optimize.precisions.decisions.int8")
    assert decision["built"] is built and decision["pays"] is built and not decision["speedups"]
    assert record.metric("optimize.precisions.target.kind") == "cpu"
    assert ("int8" in record.variants()) is built
    assert (preference(Flavor.PYTHON_ORT, PrecisionDecision.model_validate(decision))[0] == CPU_INT8_FIRST) is built
    form = record.metric("optimize.variants.fp32.form")
    assert form["chosen"] == "fused" and not form["ms"], "the layer-norm form is not timed for another CPU"
    assert f"CPU (target.cpu={target}) is not this host" in form["reason"]


def test_fp16_is_measured_only_on_a_cpu_with_fp16_arithmetic(tiny_bert, tmp_path, monkeypatch):
    asked = _host(monkeypatch, SAPPHIRE, {"int8": 2.0, "fp16": 1.25})
    _, record = _run(tiny_bert, tmp_path)
    assert [sorted(files) for files in asked] == [["fp16", "fp32"], ["fp32", "int8"]], "each against fp32, in pairs"
    decisions = record.metric("optimize.precisions.decisions")
    assert decisions["fp16"]["built"] and decisions["fp16"]["reason"].startswith("pays on this host: 1.25x")
    assert {"fp16", "int8"} <= set(record.variants())


def test_a_repair_out_of_time_says_so_and_publishes_nothing_as_repaired(tiny_bert, tmp_path, monkeypatch):
    _host(monkeypatch, AVX2, {"int8": 1.5})
    strict = {"sentence_embedding": {"min_cosine": 0.9999999}}
    _, record = _run(tiny_bert, tmp_path, steps=(export, optimize, parity), tolerances=strict,
                     parity={"repair": {"budget_s": 0.5}})
    repair = record.metric("parity.repair.int8")
    assert repair["outcome"].startswith(
        "not repaired: its 0.5 s ran out (parity.repair.budget_s): the closest candidate")
    assert repair["closest"]["min_cosine"] < 0.9999999 and repair["chosen"] is None
    assert f"the closest candidate (recipe: {repair['base']}" in repair["outcome"], \
        "the recipe named whether the search built the candidate or only the recipes were built"
    assert repair["stopped"] == "its 0.5 s ran out (parity.repair.budget_s)", "the record names the bound"
    assert "int8_repaired" not in record.variants()
    report = dict((title, text) for title, text, _ in parity.section(record.results_as("parity", ParityMetrics)))
    assert report["int8 precision repair"].endswith(f"units kept in fp32: none of {repair['units']}. Nothing was "
                                                    f"written; the search started from the base recipe: "
                                                    f"{repair['base']}."), "no file reads as produced"
    line = verdict_line("parity", record)
    resume = f"workbench run --resume --output-dir {record.run_dir} --steps parity -p parity.repair.budget_s=180"
    assert resume in line, \
        "a budget likely to finish (the default), not a doubling that leads to a run of retries"


def test_the_reference_is_kept_between_runs_of_the_same_model_and_texts(tiny_bert, tmp_path, monkeypatch):
    _host(monkeypatch, AVX2, {"int8": 0.9})
    cache = {"parity": {"reference_cache_dir": str(tmp_path / "cache")}, "precisions": ["fp32"]}
    first = _run(tiny_bert, tmp_path / "a", steps=(export, optimize, parity), **cache)[1]
    second = _run(tiny_bert, tmp_path / "b", steps=(export, optimize, parity), **cache)[1]
    assert first.metric("parity.inputs.reference_cached") is False
    assert second.metric("parity.inputs.reference_cached") is True
    assert second.metric("parity.reference.reference_cached") is True, "the library's answers too"
    assert second.metric("parity.variants.fp32.outputs.sentence_embedding.min_cosine") == pytest.approx(
        first.metric("parity.variants.fp32.outputs.sentence_embedding.min_cosine"), abs=1e-9)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(load_corpus()[:100]), encoding="utf-8")
    third = _run(tiny_bert, tmp_path / "c", steps=(export, optimize, parity), corpus=str(corpus), **cache)[1]
    assert third.metric("parity.inputs.reference_cached") is False, "other texts: computed again"

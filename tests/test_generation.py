"""Translation and text generation: tiny Marian and GPT-2, transformers vs CTranslate2, in process and served."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from workbench.core.config import RunConfig
from workbench.core.data import load_corpus
from workbench.core.record import RunRecord
from workbench.interrupt import remove_partials
from workbench.report.page import build_report
from workbench.serving.backend import generation_core as core
from workbench.serving.batching import batch_sizes
from workbench.serving.client import AsyncTritonClient, TritonClient, text_array
from workbench.serving.errors import ServedError
from workbench.serving.generation import (
    GEN_TASKS,
    compare_greedy,
    convert_ct2,
    load_ct2,
    load_hf,
    materialize,
    prepared_inputs,
)
from workbench.serving.generation_repository import GenerationPlan, generation_models
from workbench.serving.repository import read_repository, write_models
from workbench.serving.server import TritonServer
from workbench.steps import generation, specs

pytestmark = pytest.mark.slow
CASES = {"translation": ("tiny:marian", ">>fra<<"), "text-generation": ("tiny:gpt2", None)}
TEXTS = [t for t in load_corpus() if len(t) < 90][:12]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Both tiny models, converted, compared in process, and served from one repository."""
    root = tmp_path_factory.mktemp("generation")
    cases, models = {}, {}
    for name, (tiny, language) in CASES.items():
        task = GEN_TASKS[name]
        folder = materialize(tiny, root / name / "hf")
        convert_ct2(folder, root / name / "ct2")
        model, tokenizer = load_hf(task, folder, threads=1)
        engine = load_ct2(task, root / name / "ct2", threads=1)
        sequences = prepared_inputs(tokenizer, TEXTS, language, 128)
        greedy, hf_ids = compare_greedy(task, model, engine, tokenizer, sequences, 24, language)
        plan = GenerationPlan(name=name.replace("-", "_"), kind=task.kind, hf_dir=folder, ct2_dir=root / name / "ct2",
                              max_input_tokens=128, max_new_tokens=24, max_new_tokens_limit=64, max_batch_size=8,
                              threads=1, max_queue_delay_us=2000)
        models.update(generation_models(plan))
        cases[name] = {"plan": plan, "greedy": greedy, "hf_ids": hf_ids, "language": language, "tokenizer": tokenizer}
    repository = write_models(models, root / "repository")
    with TritonServer(repository, root / "server") as server:
        yield cases, server


def arrays(texts, language, max_new_tokens=None):
    out = {"TEXT": text_array(texts)}
    if language:
        out["TARGET_LANG"] = text_array([language] * len(texts))
    if max_new_tokens is not None:
        out["MAX_NEW_TOKENS"] = np.full((len(texts), 1), max_new_tokens, np.int32)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_fp32_is_identical_in_process(built, case):
    greedy = built[0][case]["greedy"]
    assert greedy.identical == greedy.sequences == len(TEXTS), greedy.first_difference
    assert greedy.hf_tokens == greedy.ct2_tokens > len(TEXTS)
    assert len({tuple(ids) for ids in built[0][case]["hf_ids"]}) > 1, "outputs vary with the input"


@pytest.mark.parametrize("case", list(CASES))
def test_served_engines_answer_like_hf_in_process(built, case):
    cases, server = built
    info = cases[case]
    with TritonClient(server.http_url, "http") as client:
        for engine in ("hf", "ct2"):
            out = client.infer(f"{info['plan'].name}_{engine}_text", arrays(TEXTS[:5], info["language"]))
            assert core.unpack(out["OUTPUT_IDS"], out["OUTPUT_LENGTHS"]) == info["hf_ids"][:5], engine
            decoded = info["tokenizer"].batch_decode(info["hf_ids"][:5], skip_special_tokens=True)
            assert [t.decode() for t in out["OUTPUT_TEXT"].ravel()] == decoded


def test_requests_of_different_lengths_batch_together_and_stay_exact(built):
    cases, server = built
    info = cases["text-generation"]
    name = info["plan"].name

    async def concurrently():
        client = AsyncTritonClient(server.http_url, "http")
        try:
            return await asyncio.gather(*(client.infer(f"{name}_hf_text", arrays([t], None)) for t in TEXTS))
        finally:
            await client.close()

    with TritonClient(server.http_url, "http") as client:
        before = batch_sizes(client.statistics(f"{name}_hf"))
        answers = asyncio.run(concurrently())
        after = batch_sizes(client.statistics(f"{name}_hf"))
    got = [core.unpack(a["OUTPUT_IDS"], a["OUTPUT_LENGTHS"])[0] for a in answers]
    assert got == info["hf_ids"], "left padding and masks keep batched answers exact"
    assert any(size > 1 and after[size] > before.get(size, 0) for size in after), after


def test_max_new_tokens_cuts_the_answer(built):
    cases, server = built
    info = cases["translation"]
    with TritonClient(server.http_url, "http") as client:
        out = client.infer(f"{info['plan'].name}_ct2_text", arrays(TEXTS[:3], info["language"], 5))
    assert core.unpack(out["OUTPUT_IDS"], out["OUTPUT_LENGTHS"]) == [ids[:5] for ids in info["hf_ids"][:3]]


@pytest.mark.parametrize("case, request_arrays, message", [
    ("translation", lambda: arrays([""], ">>fra<<"), "TEXT\\[0\\] is empty"),
    ("translation", lambda: arrays(["word " * 300], ">>fra<<"), "takes at most 128"),
    ("translation", lambda: arrays(["hello"], ">>xyz<<"), "unknown target language '>>xyz<<'.*>>deu<<"),
    ("text-generation", lambda: arrays(["hello"], "fra_Latn"), "not multilingual"),
    ("text-generation", lambda: arrays(["hello"], None, 0), "MAX_NEW_TOKENS 0 is out of range: use 1 to 64"),
    ("text-generation", lambda: arrays(["hello"], None, 1000), "MAX_NEW_TOKENS 1000 is out of range"),
])
def test_bad_requests_are_refused_and_the_server_stays_healthy(built, case, request_arrays, message):
    cases, server = built
    with TritonClient(server.http_url, "http") as client:
        for engine in ("hf", "ct2"):
            with pytest.raises(ServedError, match=message):
                client.infer(f"{cases[case]['plan'].name}_{engine}_text", request_arrays())
    assert server.is_ready()


def test_repository_configs_read_back(built):
    cases, server = built
    parsed = read_repository(server.repository)
    ensemble = parsed["translation_ct2_text"]
    assert [s.model_name for s in ensemble.ensemble_scheduling.step] == [
        "translation_tokenize", "translation_ct2", "translation_detokenize"]
    assert {i.name: i.optional for i in ensemble.input} == {"TEXT": False, "TARGET_LANG": True, "MAX_NEW_TOKENS": True}
    assert parsed["text_generation_hf"].parameters["kind"].string_value == "decoder"


def test_language_conventions():
    class Tokenizer:
        def __init__(self, vocab, specials=()):
            self.vocab, self.additional_special_tokens = vocab, list(specials)

        def get_vocab(self):
            return self.vocab

    assert core.language_style(Tokenizer({">>fra<<": 1, "a": 2})) == (core.SOURCE_PREFIX, [">>fra<<"])
    nllb = Tokenizer({"a": 1}, ["fra_Latn", "deu_Latn", "<mask>"])
    assert core.language_style(nllb) == (core.TARGET_PREFIX, ["deu_Latn", "fra_Latn"])
    with pytest.raises(core.InputError, match="multilingual: send TARGET_LANG"):
        core.check_language(core.TARGET_PREFIX, ["fra_Latn"], None)
    assert core.language_style(Tokenizer({"a": 1})) == (None, [])


def test_generation_step_and_its_report_section(tmp_path):
    config = RunConfig.model_validate({
        "threads": 1, "triton": {"repository_dir": str(tmp_path / "repos")},
        "generation": {"target_language": ">>fra<<", "texts": 8, "max_new_tokens": 16, "concurrency": [1, 4],
                       "requests_per_level": 12}})
    record = RunRecord.create(tmp_path / "run", config)
    results = generation.run(config, record).metrics
    assert record.data["steps"]["generation"]["status"] == "ok"
    for task, result in results.items():
        assert result["in_process"]["identical"] == result["in_process"]["sequences"] == 8, task
        assert result["served"] == {e: {"identical_to_hf_in_process": 8, "sequences": 8} for e in ("hf", "ct2")}
        for levels in result["load"].values():
            assert set(levels) == {"1", "4"}
            assert all(v["tokens_per_s"] > 0 and v["errors"] == 0 and v["requests"] == 12 for v in levels.values())
        assert (tmp_path / "repos" / result["name"] / f"{result['name']}_hf_text" / "config.pbtxt").is_file()
    html = build_report(record, tmp_path / "report.html", specs()).read_text()
    assert "Translation and text generation" in html and "transformers vs CTranslate2" in html
    assert sorted(p.name for p in (tmp_path / "run" / "generation").iterdir()) == ["text-generation", "translation"]
    for task, result in results.items():
        artifact = record.data["artifacts"][f"generation.{task}.repository"]
        assert artifact["path"].endswith(f"generation/{task}/model_repository/{result['name']}"), artifact


def test_a_generation_step_that_fails_midway_publishes_and_records_no_task(tmp_path, monkeypatch):
    """The translation served, the text generation's model then fails to load: no repository is published, no task
    is recorded, and the work left is all `.partial` (what the pipeline removes when it records the stop)."""
    config = RunConfig.model_validate({
        "threads": 1, "triton": {"repository_dir": str(tmp_path / "repos")},
        "generation": {"text_generation_model": str(tmp_path / "no-such-model"), "texts": 4, "max_new_tokens": 8,
                       "concurrency": [1], "requests_per_level": 4, "seconds_per_level": 1}})
    record = RunRecord.create(tmp_path / "run", config)
    with pytest.raises(Exception, match="no-such-model"):
        generation.run(config, record)
    assert not (tmp_path / "repos").exists() or not any((tmp_path / "repos").iterdir())
    assert "generation" not in RunRecord.load(tmp_path / "run").data.get("metrics", {})
    assert [p.name for p in (tmp_path / "run" / "generation").iterdir()] == [".translation.partial"]
    assert remove_partials(tmp_path / "run") and not any((tmp_path / "run" / "generation").iterdir())

"""The generation step: translation and text generation served through Triton, transformers generate vs
CTranslate2, greedy outputs checked token for token, then a load test of both."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go
from pydantic import ConfigDict, Field, field_validator

from workbench.core.config import Count, RunConfig, StepSettings, found_here
from workbench.core.data import load_corpus
from workbench.core.errors import StepSkipped
from workbench.core.metrics import Metrics
from workbench.core.progress import track
from workbench.core.record import RunRecord, StepEntry
from workbench.measure.load import asyncio_level
from workbench.measure.tables import ServedLevel
from workbench.models.footprint import WEIGHT_MULTIPLE, StepMemory
from workbench.report import figures
from workbench.report.page import Parts, Section
from workbench.runners.timing import timed
from workbench.serving.backend import generation_core as core
from workbench.serving.client import AsyncTritonClient, TritonClient, text_array
from workbench.serving.generation import (
    GEN_TASKS,
    Conversion,
    GenTask,
    GreedyComparison,
    compare_greedy,
    convert_ct2,
    load_ct2,
    load_hf,
    materialize,
    max_input_tokens,
    prepared_inputs,
)
from workbench.serving.generation_repository import ENGINES, GenerationPlan, generation_models
from workbench.serving.plan import repository_root
from workbench.serving.repository import check_replaceable, model_name_for, write_models
from workbench.serving.server import TritonServer
from workbench.serving.settings import TritonSettings
from workbench.steps import StepSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase as Tokenizer
    from tritonclient.grpc import model_config_pb2 as mc

STEP = "generation"
Models = dict[str, tuple["mc.ModelConfig", dict[str, Path]]]  # a repository's models, as generation_models gives them
REQUEST_TEXTS = 4  # texts per request when checking served answers
# What the step peaks at over its models' weights: Triton with a Python-backend stub per model, HF and CTranslate2 in
# the step's kernel (tiny:marian and tiny:gpt2, measured: 1.34 GiB).
GENERATION_BYTES = 3 * 2**29


class GenerationSettings(StepSettings):
    """The generation step: a seq2seq (translation) and a decoder-only model, HF generate vs CTranslate2."""

    translation_model: str | None = Field(default="tiny:marian", description="HF id, local folder, or tiny:marian")
    text_generation_model: str | None = Field(default="tiny:gpt2", description="HF id, local folder, or tiny:gpt2")
    _models_here = field_validator("translation_model", "text_generation_model")(staticmethod(found_here))
    target_language: str | None = Field(default=None, description="for multilingual models, e.g. >>fra<< or fra_Latn")
    max_new_tokens: int = Field(default=32, ge=1)
    max_new_tokens_limit: int = Field(default=256, ge=1)
    max_input_tokens: int | None = Field(default=None, ge=1, description="default: the model's limit")
    ct2_compute_type: str = "float32"
    texts: int = Field(default=32, ge=1, description="corpus texts for the HF vs CTranslate2 comparison")
    max_batch_size: int = Field(default=16, ge=1)
    concurrency: list[Count] = Field(default=[1, 4, 16], min_length=1)
    requests_per_level: int = Field(default=24, ge=4)
    seconds_per_level: float = Field(default=10.0, gt=0)


class GenerationLevel(ServedLevel):
    """A load level of one-text generation requests, with generated tokens/s and words/s."""

    tokens_per_s: float
    words_per_s: float


class ServedIdentity(Metrics):
    """An engine served through Triton: its sequences identical to transformers' in process."""

    identical_to_hf_in_process: int
    sequences: int


class GenerationTask(Metrics):
    """One generation model end to end (run.json `metrics.generation.<task>`)."""

    model: str
    kind: str
    name: str
    target_language: str | None = None
    conversion: Conversion | None = None
    compute_type: str | None = None
    max_new_tokens: int | None = None
    in_process: GreedyComparison
    served: dict[str, ServedIdentity] = Field(default_factory=dict)
    load: dict[str, dict[str, GenerationLevel]] = Field(default_factory=dict)  # engine -> concurrency -> level
    ready_seconds: float | None = None
    ct2_over_hf_tokens_per_s: float | None = None
    seconds: float | None = None


class GenerationMetrics(Metrics):
    """One table per task, keyed by the task's name ("translation", "text-generation")."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    translation: GenerationTask | None = None
    text_generation: GenerationTask | None = Field(default=None, alias="text-generation")

    def tasks(self) -> dict[str, GenerationTask]:
        return {name: task for name, task in (("translation", self.translation),
                                              ("text-generation", self.text_generation)) if task}


def short_texts(tokenizer: Tokenizer, count: int, limit: int) -> list[str]:
    """The first `count` corpus texts that fit in `limit` tokens (and 64, to keep decoding cheap)."""
    cap = min(limit, 64)
    return [t for t in load_corpus() if len(tokenizer(t)["input_ids"]) < cap][:count]


def request_arrays(texts: list[str], language: str | None, max_new_tokens: int) -> dict[str, np.ndarray]:
    arrays = {"TEXT": text_array(texts), "MAX_NEW_TOKENS": np.full((len(texts), 1), max_new_tokens, np.int32)}
    if language:
        arrays["TARGET_LANG"] = text_array([language] * len(texts))
    return arrays


def served_ids(server: TritonServer, model: str, texts: list[str], language: str | None,
               max_new_tokens: int) -> list[list[int]]:
    ids: list[list[int]] = []
    with TritonClient(server.grpc_url) as client:
        for start in range(0, len(texts), REQUEST_TEXTS):
            out = client.infer(model, request_arrays(texts[start:start + REQUEST_TEXTS], language, max_new_tokens))
            ids += core.unpack(out["OUTPUT_IDS"], out["OUTPUT_LENGTHS"])
    return ids


def load_test(config: RunConfig, server: TritonServer, model: str, texts: list[str],
              language: str | None) -> dict[str, GenerationLevel]:
    """Generated tokens/s, words/s and latency per concurrency, one text per request."""
    gen = GenerationSettings.of(config)
    results = {}
    for concurrency in track(gen.concurrency, f"generation load, {model}", "concurrency levels",
                             note=lambda c: f"concurrency {c}"):
        counted = {"tokens": 0, "words": 0}

        async def send(client: AsyncTritonClient, index: int) -> None:
            out = await client.infer(model, request_arrays([texts[index % len(texts)]], language,
                                                           gen.max_new_tokens))
            counted["tokens"] += int(out["OUTPUT_LENGTHS"].sum())
            counted["words"] += sum(len(t.decode("utf-8").split()) for t in out["OUTPUT_TEXT"].ravel())

        level = asyncio_level(server.grpc_url, "grpc", send, concurrency, gen.requests_per_level,
                              gen.seconds_per_level, after_warmup=lambda c=counted: c.update(tokens=0, words=0))
        results[str(concurrency)] = GenerationLevel.model_validate({
            **level.recorded(), "tokens_per_s": counted["tokens"] / level.seconds,
            "words_per_s": counted["words"] / level.seconds})
    return results


@dataclass(frozen=True)
class Served:
    """A task's models, served from its work folder (a `.partial` name until the step ends, so that a step killed
    midway leaves nothing a resumed run keeps), and the repository they publish as."""

    task: str
    models: Models
    repository: Path
    work: Path

    def settle(self, record: RunRecord, overwrite: bool) -> None:
        """Publish the repository, move the work folder to `generation/<task>`, and record its repository there."""
        write_models(self.models, self.repository, overwrite=overwrite, about={"name": self.repository.name})
        final = self.work.with_name(self.task)
        shutil.rmtree(final, ignore_errors=True)
        self.work.rename(final)
        record.add_artifact(f"generation.{self.task}.repository", final / "model_repository" / self.repository.name,
                            kind="triton-repository")


def run_task(task: GenTask, name: str, config: RunConfig, record: RunRecord,
             served: list[Served]) -> GenerationTask:
    """One generation model end to end; what it served goes into `served`, for the step to settle at its end."""
    gen = GenerationSettings.of(config)
    language = gen.target_language if task.kind == "seq2seq" else None  # a target language is for translation
    work = record.run_dir / "generation" / f".{task.name}.partial"
    shutil.rmtree(work, ignore_errors=True)
    record.phase(f"loading {name} with transformers, for {task.name}")
    folder = materialize(name, work / "hf", config.trust_remote_code)
    model, tokenizer = load_hf(task, folder, config.threads)
    record.phase(f"converting {name} to CTranslate2 ({gen.ct2_compute_type}), for {task.name}")
    conversion = convert_ct2(folder, work / "ct2")
    engine = load_ct2(task, work / "ct2", gen.ct2_compute_type, config.threads)
    limit = max_input_tokens(model, tokenizer, gen.max_input_tokens)
    texts = short_texts(tokenizer, gen.texts, limit)
    sequences = prepared_inputs(tokenizer, texts, language, limit)
    record.phase(f"comparing greedy outputs of transformers and CTranslate2 on {len(texts)} texts, in process")
    compared, reference = compare_greedy(task, model, engine, tokenizer, sequences, gen.max_new_tokens, language)
    plan = GenerationPlan(name=model_name_for(f"{Path(name).name}_{task.name}"), kind=task.kind, hf_dir=folder,
                          ct2_dir=work / "ct2", max_input_tokens=limit, max_new_tokens=gen.max_new_tokens,
                          max_new_tokens_limit=gen.max_new_tokens_limit, max_batch_size=gen.max_batch_size,
                          compute_type=gen.ct2_compute_type, threads=config.threads or 0)
    models = generation_models(plan)
    repository = write_models(models, work / "model_repository" / plan.name, overwrite=True, about={"name": plan.name})
    shared = repository_root(TritonSettings.of(config).repository_dir) / plan.name
    check_replaceable(shared, TritonSettings.of(config).overwrite)  # refused now, published once every task is served
    served.append(Served(task.name, models, shared, work))
    result = GenerationTask(model=name, kind=task.kind, target_language=language, name=plan.name,
                            conversion=conversion, compute_type=gen.ct2_compute_type,
                            max_new_tokens=gen.max_new_tokens, in_process=compared,
                            served={}, load={})
    record.phase(f"starting tritonserver with both {task.name} engines (their models load before it answers)")
    with TritonServer(repository, work / "server") as server:
        result.ready_seconds = server.timings["ready_seconds"]
        for engine_name in ENGINES:
            ensemble = f"{plan.name}_{engine_name}_text"
            record.phase(f"checking {engine_name}'s served answers to {len(texts)} texts, then its load")
            got = served_ids(server, ensemble, texts, language, gen.max_new_tokens)
            result.served[engine_name] = ServedIdentity(
                identical_to_hf_in_process=sum(a == b for a, b in zip(got, reference)), sequences=len(reference))
            result.load[engine_name] = load_test(config, server, ensemble, texts, language)
    top = str(max(gen.concurrency))
    result.ct2_over_hf_tokens_per_s = (result.load["ct2"][top].tokens_per_s
                                       / max(result.load["hf"][top].tokens_per_s, 1e-9))
    return result


def run(config: RunConfig, record: RunRecord) -> StepEntry:
    """Each configured generation model (translation, text generation) end to end; results in metrics.generation."""
    with record.step(STEP):
        results: dict[str, GenerationTask] = {}
        served: list[Served] = []
        for task in GEN_TASKS.values():
            name = getattr(GenerationSettings.of(config), task.setting)
            if name:
                result, seconds = timed(lambda task=task, name=name: run_task(task, name, config, record, served))
                result.seconds = round(seconds, 1)
                results[task.name] = result
        for each in served:  # only now: a step stopped midway publishes nothing and records no task
            each.settle(record, TritonSettings.of(config).overwrite)
            record.set_metric(f"{STEP}.{each.task}", results[each.task].recorded())
        if not results:
            raise StepSkipped("no generation model is configured", "set -p generation.translation_model=<id> "
                              "and/or -p generation.text_generation_model=<id>")
    return record.step_entry(STEP)


def lines(record: RunRecord) -> list[str]:
    """The verdict line per task: greedy HF against CTranslate2, and CTranslate2's served speed over HF's."""
    found = []
    recorded = record.results_as(STEP, GenerationMetrics)
    for task, outcome in (recorded.tasks() if recorded else {}).items():
        same, speed = outcome.in_process, outcome.ct2_over_hf_tokens_per_s
        found.append(f"{task} ({outcome.model}): greedy HF = CTranslate2 on {same.identical}/{same.sequences} "
                     f"texts; CTranslate2 {'n/a' if speed is None else f'{speed:.4g}'}x HF tokens/s served")
    return found or ["no generation model configured"]


def generation_table(tasks: dict[str, GenerationTask]) -> go.Figure:
    """HF generate vs CTranslate2 per task and concurrency: tokens/s, words/s, p50/p99, and token identity."""
    rows = []
    for task, result in tasks.items():
        same = result.in_process
        for engine, levels in result.load.items():
            served = result.served[engine]
            rows += [[task, engine, concurrency, f"{level.tokens_per_s:.0f}", f"{level.words_per_s:.0f}",
                      f"{level.p50:.1f}", f"{level.p99:.1f}",
                      f"{served.identical_to_hf_in_process}/{served.sequences} served, "
                      f"{same.identical}/{same.sequences} in process"] for concurrency, level in levels.items()]
    header = ["task", "engine", "concurrency", "tokens/s", "words/s", "p50 ms", "p99 ms", "greedy ids = HF"]
    return figures.table("Generation served through Triton: transformers vs CTranslate2", header, rows)


def generation_figures(tasks: dict[str, GenerationTask]) -> list[go.Figure]:
    """Generated tokens/s against concurrency per task, both engines, and the table."""
    figure = go.Figure()
    for task, result in tasks.items():
        for engine, levels in result.load.items():
            figure.add_scatter(name=f"{task} {engine}", x=[int(c) for c in levels], mode="lines+markers",
                               y=[v.tokens_per_s for v in levels.values()])
    figure.update_layout(title="Generated tokens per second", yaxis_title="throughput (generated tokens/s)",
                         yaxis_type="log", yaxis_dtick="D2")  # 1, 2 and 5 of each decade labelled, not every digit
    figures.concurrency_axis(figure, [levels for result in tasks.values() for levels in result.load.values()])
    return [figure, generation_table(tasks)]


def section(generation: GenerationMetrics) -> Parts:
    """The report's generation figures, one set per task."""
    tasks = generation.tasks()
    if not tasks:
        return []
    return [("Translation and text generation", "transformers generate against CTranslate2, both served through "
             "Triton's Python backend; greedy decoding, one text per request.", generation_figures(tasks))]


def memory_need(config: RunConfig) -> StepMemory:
    """Triton with its generation models, HF and CTranslate2 at once: GENERATION_BYTES + 3 x the local models'
    weights (tiny:<arch> builds and hub ids: not counted)."""
    from workbench.models.loading import resolve_source, weight_bytes

    gen = GenerationSettings.of(config)
    models = [m for m in (gen.translation_model, gen.text_generation_model)
              if m and not m.startswith("tiny:")]
    weights = sum(weight_bytes(resolve_source(m)) or 0 for m in models)
    return StepMemory(STEP, GENERATION_BYTES + WEIGHT_MULTIPLE * weights,
                      f"Triton serving its models, HF and CTranslate2: {GENERATION_BYTES / 2**30:g} GB"
                      + (f" + {WEIGHT_MULTIPLE} x their {weights / 2**20:.3g} MB of weights" if weights else ""))


SPEC = StepSpec(
    STEP, 6, "translation and text generation on Triton: HF vs CTranslate2", run, lines,
    sections=(Section("Translation and text generation", section),),
    needs=("ports", "repository"), machine=("tritonserver", "ctranslate2"), owns=("generation",), writes=0.15,
    metrics=GenerationMetrics, after="triton", settings=GenerationSettings, memory=memory_need,
    lighter="one generation model at a time (-p generation.text_generation_model=null, then "
            "-p generation.translation_model=null), a lower generation.max_batch_size")

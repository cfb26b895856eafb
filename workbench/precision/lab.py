"""The parity lab: PyTorch's outputs on a fixed set of real-text batches, and any runner compared against them."""
from __future__ import annotations

import copy
import time
from collections.abc import Collection
from functools import partial
from pathlib import Path

import numpy as np

from workbench.core.atomic import atomic_path
from workbench.core.config import Tolerance
from workbench.core.data import load_corpus
from workbench.core.progress import track
from workbench.core.results import Verdict, WorstText
from workbench.models.batches import (
    Batch,
    Cell,
    Feed,
    Grouping,
    corner_batches,
    corpus_batches,
    grouped_batches,
    long_texts,
    token_lengths,
    within,
)
from workbench.models.loading import LoadedModel
from workbench.models.text import Text, encode, shown
from workbench.precision.cache import ReferenceCache, cache_key, default_folder
from workbench.precision.compare import OutputParity, check_inputs, tolerance_for, verdict
from workbench.precision.ranking import by_query, lab_pairs, query_groups
from workbench.precision.settings import LabSettings
from workbench.precision.tables import LibraryCheck, ReferenceCut
from workbench.runners import Runner
from workbench.runners.library import LibraryRunner, library_runner
from workbench.runners.onnxruntime import device_for
from workbench.tasks.registry import SENTENCE_EMBEDDING, OutputSpec

WORST_TEXTS = 10
LONGEST = 4096  # tokens: models taking more get no text past their limit (one would cost minutes)


class ParityLab:
    """The reference outputs on a fixed set of real-text batches, and comparisons of any runner against them.

    `texts` are tokenized as the model's users get them (after its default prompt, if it declares one, whose first
    `prompt_tokens` tokens pooling leaves out where the model says so), or (query, document) pairs; the reference
    is the workbench's PyTorch module unless another runner is given (the model's own library). `beyond`: the texts
    longer than the run's sequence.max, in batches of their own. `regrouped`: how many of the last batches hold the
    corpus again in other groups (`grouped_batches`), which only variants whose outputs depend on a text's batch-mates
    are judged on (`for_variant`)."""

    def __init__(self, settings: LabSettings, loaded: LoadedModel, texts: tuple[Text, ...], batches: list[Batch],
                 corners: int, reference: Runner | None = None, beyond: tuple[int, ...] = (),
                 prompt_tokens: int = 0, regrouped: int = 0) -> None:
        self.settings = settings
        self.loaded = loaded
        self.texts = texts
        self.groups = query_groups(texts)
        self.beyond, self.prompt_tokens, self.regrouped = beyond, prompt_tokens, regrouped
        self.specs: tuple[OutputSpec, ...] = settings.specs
        self.batches = batches
        self.corners = batches[:corners]
        from workbench.runners.torch import TorchRunner, torch_device

        with reference or TorchRunner(loaded, self.specs, device=torch_device(device_for(settings.device))) as runner:
            start = time.perf_counter()
            folder = settings.cache_dir
            cache = ReferenceCache(Path(folder) if folder else default_folder())
            key = cache_key(runner.identity, batches) if runner.identity else None
            kept = cache.load(key, len(batches)) if key else None
            self.expected = kept or [runner.infer(b) for b in track(
                self.batches, f"reference outputs ({runner.name})", "batches", note=lambda b: b.name)]
            if key and kept is None:
                cache.save(key, self.expected)
            self.reference_seconds = time.perf_counter() - start
            self.reference_cached = kept is not None
        self.reference = runner  # closed: its name and input names describe `expected`

    @classmethod
    def build(cls, settings: LabSettings, loaded: LoadedModel, texts: tuple[Text, ...],
              regroup: Grouping | None = None) -> ParityLab:
        """The shape corners of the run's ranges (within the model's token budget, `LoadedModel.token_budget`), then
        every text once in batches of like length cut at the run's
        sequence.max; with `regroup` (the served model's grouping, `serving.plan.served_groups`), every text again in
        its groups, for the variants whose outputs depend on a text's batch-mates (dynamic int8): a reranker's pairs
        within their query's, as one request sends them, other texts across all, as requests are batched."""
        names, prompted, prompt = loaded.input_names, list(loaded.prompted(texts)), loaded.prompt_tokens()
        corners = corner_batches(loaded.tokenizer, names, prompted, settings.batch, loaded.sequence, settings.seed,
                                 prompt, loaded.token_budget(settings.batch)[0])
        sweep = corpus_batches(loaded.tokenizer, names, prompted, settings.batch.opt, loaded.sequence.max, prompt)
        requests = by_query(prompted) if loaded.task.name == "rerank" else None
        rows = max(map(len, requests)) if requests else settings.batch.max  # a request's pairs run together
        again = grouped_batches(loaded.tokenizer, names, prompted, loaded.sequence.max, regroup, rows, prompt,
                                requests) if regroup else []
        return cls(settings, loaded, tuple(prompted), corners + sweep + again, len(corners), regrouped=len(again))

    @classmethod
    def corpus_only(cls, settings: LabSettings, loaded: LoadedModel, texts: tuple[Text, ...],
                    reference: Runner | None = None, prompt_name: str | None = None,
                    cut: int | None = None) -> ParityLab:
        """Every text once, whole up to `cut` tokens (default: the run's sequence.max): what a served model, or the
        model's own library (`reference`, given the texts without the prompt it adds itself), sees; after the named
        prompt (None: the model's default). Texts longer than the run's sequence.max are batched apart (`beyond`)."""
        prompted = list(loaded.prompted(texts, prompt_name))
        lengths = token_lengths(loaded.tokenizer, prompted)
        beyond = [i for i, length in enumerate(lengths) if length > loaded.sequence.max]
        within = [i for i, length in enumerate(lengths) if length <= loaded.sequence.max]
        prompt = loaded.prompt_tokens(prompt_name)
        batch = partial(corpus_batches, loaded.tokenizer, loaded.input_names, prompted, settings.batch.opt,
                        cut or loaded.sequence.max, prompt)
        return cls(settings, loaded, tuple(prompted), batch(ids=within) + batch(ids=beyond), 0, reference,
                   tuple(beyond), prompt)

    def subset(self, text_ids: list[int], corners: bool = True) -> ParityLab:
        """The corner batches (unless `corners` is False) plus the corpus batches holding `text_ids`, with the
        reference outputs reused.

        Whole batches, not texts: dynamic int8 quantizes activations per batch, so a text's error depends on
        which texts share its batch.
        """
        wanted = set(text_ids)
        keep = [i for i, b in enumerate(self.batches)
                if (corners if i < len(self.corners) else wanted & set(b.text_ids))]
        return self._view(keep, corners)

    def for_variant(self, batch_dependent: bool) -> ParityLab:
        """The lab a variant is judged on: all of it where its outputs depend on a text's batch-mates (dynamic int8
        quantizes activations with one scale per batch, so each text's cosine and error count at the worse of its two
        groupings), else without the regrouped batches, which would repeat about the same outputs."""
        if batch_dependent or not self.regrouped:
            return self
        return self._view(list(range(len(self.batches) - self.regrouped)), True)

    def _view(self, keep: list[int], corners: bool) -> ParityLab:
        """This lab on the batches numbered `keep` (with the corner batches unless `corners` is False), the reference
        outputs reused."""
        view = copy.copy(self)
        view.batches = [self.batches[i] for i in keep]
        view.corners = self.corners if corners else []
        view.expected = [self.expected[i] for i in keep]
        view.regrouped = sum(i >= len(self.batches) - self.regrouped for i in keep)
        return view

    def within(self) -> ParityLab:
        """The texts the run's sequence.max holds whole."""
        beyond = set(self.beyond)
        return self.subset([i for i in range(len(self.texts)) if i not in beyond])

    def past_cut(self) -> ParityLab:
        """The texts longer than the run's sequence.max, given to the runner cut there while the reference outputs
        stay as computed (cut at the model's own limit): what a shorter cut changes in the pooled outputs (per-token
        outputs are left out)."""
        view = self.subset(list(self.beyond))
        view.batches = [Batch(b.name, b.text_ids, encode(
            self.loaded.tokenizer, [self.texts[i] for i in b.text_ids], self.loaded.input_names,
            max_length=self.loaded.sequence.max, prompt_tokens=self.prompt_tokens)) for b in view.batches]
        view.specs = tuple(s for s in self.specs if not s.per_token)
        return view

    def sample_feeds(self, batches: int = 4, rows: int = 2) -> list[Feed]:
        """The first `batches` corpus batches and `rows` texts of the last corner (the longest): what a measurement
        of every intermediate tensor runs (a repair's ordering), without holding a wide batch's at once."""
        longest = self.corners[-1].feed
        return [b.feed for b in self.sweep[:batches]] + [{name: value[:rows] for name, value in longest.items()}]

    @property
    def sweep(self) -> list[Batch]:
        """The corpus batches, every text once (the regrouped ones left out)."""
        return self.batches[len(self.corners):len(self.batches) - self.regrouped]

    @property
    def primary(self) -> OutputSpec:
        """The output users read: the sentence embedding, or a reranker's scores, when there is one."""
        return next((s for s in self.specs if s.kind in ("embedding", "scores")), self.specs[0])

    def collect(self, runner: Runner, precision: str, tolerances: dict[str, Tolerance] | None = None,
                gated: Collection[str] | None = None, progress: str | None = None) -> dict[str, OutputParity]:
        """Run every batch through `runner` and accumulate the comparison of each output it returns, against the
        task-aware default tolerances with `tolerances` (default: the run configuration's) on top; the outputs
        `gated` (default: those the deployment serves) decide the verdict. `progress`: a bar of that label counts
        the batches (none inside another bar)."""
        check_inputs(self.reference.input_names, runner.input_names, runner.name)
        overrides = self.settings.tolerances if tolerances is None else tolerances
        deciding = self.settings.gated if gated is None else gated
        outputs = {s.name: OutputParity(s, tolerance_for(s, precision, overrides), self.groups, s.name in deciding)
                   for s in self.specs if s.name in runner.output_names}
        pairs = list(zip(self.batches, self.expected))
        for batch, expected in track(pairs, progress, "batches", note=lambda p: p[0].name) if progress else pairs:
            got = runner.infer(batch)
            for name, parity in outputs.items():
                parity.add(batch.name, batch.text_ids, got[name], expected[name], batch.mask)
        return outputs

    def compare(self, runner: Runner, precision: str, tolerances: dict[str, Tolerance] | None = None,
                gated: Collection[str] | None = None, progress: str | None = None) -> Verdict:
        """`runner`'s verdict on every batch (`collect`), with its providers, the seconds it took and the texts it
        got most wrong on the primary output."""
        start = time.perf_counter()
        outputs = self.collect(runner, precision, tolerances, gated, progress)
        seconds = time.perf_counter() - start
        result = verdict({name: parity.summary() for name, parity in outputs.items()})
        return result.model_copy(update={"precision": precision, "providers": list(runner.providers),
                                         "seconds": round(seconds, 3),
                                         "worst_texts": self._worst_texts(outputs[self.primary.name])})

    def _worst_texts(self, parity: OutputParity) -> list[WorstText]:
        return [WorstText(text_id=i, text=shown(self.texts[i])[:160], metric=parity.per_text_metric,
                          error=parity.per_text_error(i), **parity.per_text[i]) for i in parity.hardest(WORST_TEXTS)]

    def latency_batch(self) -> Batch:
        """The corner batch at the configuration's optimal batch size and sequence length."""
        length = self.loaded.sequence.opt
        name = Cell(within(self.settings.batch.opt, length, self.loaded.token_budget(self.settings.batch)[0]),
                    length).key
        return next(b for b in self.corners if b.name == name)

    def save_polygraphy_data(self, folder: Path) -> tuple[Path, Path]:
        """The corner batches and PyTorch's outputs in Polygraphy's JSON formats (--load-inputs/--load-outputs)."""
        from polygraphy.comparator import IterationResult, RunResults
        from polygraphy.json import save_json

        inputs, reference = folder / "inputs.json", folder / "reference.json"
        corners = self.corners
        results = RunResults([(self.reference.name, [
            IterationResult(outputs=dict(out), runner_name=self.reference.name)
            for out in self.expected[: len(corners)]])])
        with atomic_path(inputs) as tmp:
            save_json([b.feed for b in corners], str(tmp))
        with atomic_path(reference) as tmp:
            save_json(results, str(tmp))
        return inputs, reference


def lab_texts(settings: LabSettings, loaded: LoadedModel) -> tuple[Text, ...]:
    """The run's corpus texts and, past them, texts joined from them to lengths the corpus may lack: between the
    run's sequence.max and the model's own limit (when the run cuts shorter) and past that limit, so every check
    sees texts both cuts apply to. A reranker's: pairs of them (`lab_pairs`), the long texts as one query's
    documents."""
    texts = load_corpus(settings.corpus, settings.corpus_max_texts)
    cut, limit = loaded.sequence.max, loaded.max_sequence
    targets = ([(cut + limit) // 2 + 1] if cut < limit else []) + ([limit + limit // 4] if limit <= LONGEST else [])
    longer = long_texts(loaded.tokenizer, texts, targets)
    if loaded.task.name == "rerank":
        return lab_pairs(texts) + tuple((texts[0], text) for text in longer)
    return texts + longer


def library_reference(settings: LabSettings, loaded: LoadedModel, texts: tuple[Text, ...],
                      prompt_name: str | None = None) -> LibraryRunner | None:
    """What the model's users run today on `texts` (raw: the library adds the prompt itself, `prompt_name` or the
    model's default), as the model ships (cut at its own limit); None where no library call returns the task's
    outputs."""
    names = tuple(spec.name for spec in settings.specs)
    return library_runner(loaded, texts, names, loaded.max_sequence, settings.trust_remote_code, prompt_name)


def library_check(settings: LabSettings, loaded: LoadedModel, texts: tuple[Text, ...]) -> LibraryCheck:
    """The workbench's PyTorch module against the model's own library as it ships, on every text whole up to the
    model's limit, at the default fp32 gate (the run's `tolerances` are for its variants): the module the graph is
    exported from must return what the model's users get today. Where the run cuts texts shorter than the model
    does, `cut` says what that changes on the texts longer than the run's cut (not gated: the verdict names it)."""
    reference = library_reference(settings, loaded, texts)
    if reference is None:
        return LibraryCheck(checked=False, library=f"transformers {loaded.task.auto_class}",
                            reference=f"transformers {loaded.task.auto_class}",
                            reason=f"{loaded.task.name}: the transformers pipeline returns each token's best label, "
                                   "not logits; the module is transformers' own model")
    call, library = reference.call, reference.library
    lab = ParityLab.corpus_only(settings, loaded, texts, reference, cut=loaded.max_sequence)
    from workbench.runners.torch import TorchRunner

    with TorchRunner(loaded, lab.specs) as module:
        result = lab.compare(module, "fp32", tolerances={}, gated=[s.name for s in lab.specs],
                             progress=f"the PyTorch module vs {library}").recorded()
        cut = cut_row(loaded, lab, module)
    check = LibraryCheck(checked=True, library=library, reference=call, texts=len(texts), **result, cut=cut,
                         reference_cached=lab.reference_cached)
    if any(spec.name == SENTENCE_EMBEDDING for spec in lab.specs):
        norms = np.concatenate([np.linalg.norm(e[SENTENCE_EMBEDDING], axis=-1) for e in lab.expected])
        check.norms = [float(norms.min()), float(norms.max())]
    return check


def cut_row(loaded: LoadedModel, lab: ParityLab, runner: Runner) -> ReferenceCut:
    """The run's cut against the model's own (run.json `cut`): both lengths, how many of the lab's texts are longer
    than the run's, and, where the run cuts shorter, `runner` on those texts cut at the run's length against the
    reference at the model's (what the shorter cut changes; never gated)."""
    row = ReferenceCut(deployment=loaded.sequence.max, library=loaded.max_sequence, texts_beyond=len(lab.beyond))
    if lab.beyond and loaded.sequence.max < loaded.max_sequence:
        row.beyond = lab.past_cut().compare(runner, "fp32", tolerances={})
    return row

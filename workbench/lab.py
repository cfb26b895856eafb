"""The parity lab: PyTorch's outputs on a fixed set of real-text batches, and any runner compared against them."""
from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

from workbench.atomic import atomic_path
from workbench.batches import Batch, corner_batches, corpus_batches
from workbench.compare import OutputParity, check_inputs, tolerance_for, verdict
from workbench.config import RunConfig
from workbench.models import LoadedModel
from workbench.runners import Runner
from workbench.runners.torch import TorchRunner
from workbench.tasks import OutputSpec

WORST_TEXTS = 10


class ParityLab:
    """The reference outputs on a fixed set of real-text batches, and comparisons of any runner against them."""

    def __init__(self, config: RunConfig, loaded: LoadedModel, texts: tuple[str, ...], batches: list[Batch],
                 corners: int) -> None:
        self.config = config
        self.loaded = loaded
        self.texts = texts
        self.specs: tuple[OutputSpec, ...] = loaded.task.outputs(config.pooling)
        self.batches = batches
        self.corners = batches[:corners]
        with TorchRunner(loaded, config.pooling) as reference:
            start = time.perf_counter()
            self.expected = [reference.infer(b) for b in self.batches]
            self.reference_seconds = time.perf_counter() - start
        self.reference = reference  # closed: its name and input names describe `expected`

    @classmethod
    def build(cls, config: RunConfig, loaded: LoadedModel, texts: tuple[str, ...]) -> ParityLab:
        """The shape corners of the configuration, then every text once in mixed-length batches."""
        names = loaded.input_names
        corners = corner_batches(loaded.tokenizer, names, list(texts), config.batch, config.sequence,
                                 loaded.max_sequence, config.seed)
        sweep = corpus_batches(loaded.tokenizer, names, list(texts), config.batch.opt, config.sequence,
                               loaded.max_sequence)
        return cls(config, loaded, texts, corners + sweep, len(corners))

    @classmethod
    def corpus_only(cls, config: RunConfig, loaded: LoadedModel, texts: tuple[str, ...]) -> ParityLab:
        """Every text once, whole (not cut to a corner's length): what a served model sees."""
        sweep = corpus_batches(loaded.tokenizer, loaded.input_names, list(texts), config.batch.opt, config.sequence,
                               loaded.max_sequence)
        return cls(config, loaded, texts, sweep, 0)

    def subset(self, text_ids: list[int]) -> ParityLab:
        """The corner batches plus the corpus batches holding `text_ids`, with the reference outputs reused.

        Whole batches, not texts: dynamic int8 quantizes activations per batch, so a text's error depends on
        which texts share its batch.
        """
        wanted = set(text_ids)
        keep = [i for i, b in enumerate(self.batches) if i < len(self.corners) or wanted & set(b.text_ids)]
        view = copy.copy(self)
        view.batches = [self.batches[i] for i in keep]
        view.expected = [self.expected[i] for i in keep]
        return view

    @property
    def sweep(self) -> list[Batch]:
        return self.batches[len(self.corners):]

    @property
    def primary(self) -> OutputSpec:
        """The output users read: the sentence embedding when there is one."""
        return next((s for s in self.specs if s.kind == "embedding"), self.specs[0])

    def collect(self, runner: Runner, precision: str) -> dict[str, OutputParity]:
        """Run every batch through `runner` and accumulate the comparison of each output it returns."""
        check_inputs(self.reference.input_names, runner.input_names, runner.name)
        outputs = {s.name: OutputParity(s, tolerance_for(s, precision, self.config.tolerances))
                   for s in self.specs if s.name in runner.output_names}
        for batch, expected in zip(self.batches, self.expected):
            got = runner.infer(batch)
            for name, parity in outputs.items():
                parity.add(batch.name, batch.text_ids, got[name], expected[name], batch.mask)
        return outputs

    def compare(self, runner: Runner, precision: str) -> dict[str, Any]:
        start = time.perf_counter()
        outputs = self.collect(runner, precision)
        seconds = time.perf_counter() - start
        summaries = {name: parity.summary() for name, parity in outputs.items()}
        return {**verdict(summaries), "precision": precision, "providers": list(runner.providers),
                "seconds": round(seconds, 3), "outputs": summaries,
                "worst_texts": self._worst_texts(outputs[self.primary.name])}

    def _worst_texts(self, parity: OutputParity) -> list[dict[str, Any]]:
        return [{"text_id": i, "text": self.texts[i][:160], "metric": parity.per_text_metric,
                 "error": parity.per_text_error(i), **parity.per_text[i]} for i in parity.hardest(WORST_TEXTS)]

    def latency_batch(self) -> Batch:
        """The corner batch at the configuration's optimal batch size and sequence length."""
        name = f"b{self.config.batch.opt}_s{self.config.sequence.opt}"
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

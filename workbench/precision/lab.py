"""The parity lab: PyTorch's outputs on a fixed set of real-text batches, and any runner compared against them."""
from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import numpy as np

from workbench.core.atomic import atomic_path
from workbench.core.batches import Batch, corner_batches, corpus_batches
from workbench.core.config import RunConfig, Tolerance
from workbench.core.tasks import SENTENCE_EMBEDDING, OutputSpec
from workbench.models.loading import LoadedModel
from workbench.precision.compare import OutputParity, check_inputs, tolerance_for, verdict
from workbench.runners import Runner
from workbench.runners.library import LibraryRunner, library_runner
from workbench.runners.onnxruntime import device_for
from workbench.runners.torch import TorchRunner, torch_device

WORST_TEXTS = 10


class ParityLab:
    """The reference outputs on a fixed set of real-text batches, and comparisons of any runner against them.

    `texts` are tokenized as the model's users get them (after its default prompt, if it declares one); the
    reference is the workbench's PyTorch module unless another runner is given (the model's own library)."""

    def __init__(self, config: RunConfig, loaded: LoadedModel, texts: tuple[str, ...], batches: list[Batch],
                 corners: int, reference: Runner | None = None) -> None:
        self.config = config
        self.loaded = loaded
        self.texts = texts
        self.specs: tuple[OutputSpec, ...] = config.output_specs
        self.batches = batches
        self.corners = batches[:corners]
        with reference or TorchRunner(loaded, self.specs, device=torch_device(device_for(config.device))) as runner:
            start = time.perf_counter()
            self.expected = [runner.infer(b) for b in self.batches]
            self.reference_seconds = time.perf_counter() - start
        self.reference = runner  # closed: its name and input names describe `expected`

    @classmethod
    def build(cls, config: RunConfig, loaded: LoadedModel, texts: tuple[str, ...]) -> ParityLab:
        """The shape corners of the configuration, then every text once in mixed-length batches."""
        names, prompted = loaded.input_names, list(loaded.prompted(texts))
        corners = corner_batches(loaded.tokenizer, names, prompted, config.batch, config.sequence,
                                 loaded.max_sequence, config.seed)
        sweep = corpus_batches(loaded.tokenizer, names, prompted, config.batch.opt, config.sequence,
                               loaded.max_sequence)
        return cls(config, loaded, tuple(prompted), corners + sweep, len(corners))

    @classmethod
    def corpus_only(cls, config: RunConfig, loaded: LoadedModel, texts: tuple[str, ...],
                    reference: Runner | None = None, prompt_name: str | None = None) -> ParityLab:
        """Every text once, whole (not cut to a corner's length): what a served model, or the model's own library
        (`reference`, given the texts without the prompt it adds itself), sees; after the named prompt (None: the
        model's default)."""
        prompted = list(loaded.prompted(texts, prompt_name))
        sweep = corpus_batches(loaded.tokenizer, loaded.input_names, prompted, config.batch.opt, config.sequence,
                               loaded.max_sequence)
        return cls(config, loaded, tuple(prompted), sweep, 0, reference)

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

    def collect(self, runner: Runner, precision: str, tolerances: dict[str, Tolerance] | None = None
                ) -> dict[str, OutputParity]:
        """Run every batch through `runner` and accumulate the comparison of each output it returns, against the
        task-aware default tolerances with `tolerances` (default: the run configuration's) on top."""
        check_inputs(self.reference.input_names, runner.input_names, runner.name)
        overrides = self.config.tolerances if tolerances is None else tolerances
        outputs = {s.name: OutputParity(s, tolerance_for(s, precision, overrides))
                   for s in self.specs if s.name in runner.output_names}
        for batch, expected in zip(self.batches, self.expected):
            got = runner.infer(batch)
            for name, parity in outputs.items():
                parity.add(batch.name, batch.text_ids, got[name], expected[name], batch.mask)
        return outputs

    def compare(self, runner: Runner, precision: str, tolerances: dict[str, Tolerance] | None = None
                ) -> dict[str, Any]:
        start = time.perf_counter()
        outputs = self.collect(runner, precision, tolerances)
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


def library_reference(config: RunConfig, loaded: LoadedModel, texts: tuple[str, ...],
                      prompt_name: str | None = None) -> LibraryRunner | None:
    """What the model's users run today on `texts` (raw: the library adds the prompt itself, `prompt_name` or the
    model's default), cut at the deployment's sequence limit; None where no library call returns the task's
    outputs."""
    names = tuple(spec.name for spec in config.output_specs)
    return library_runner(loaded, texts, names, min(config.sequence.max, loaded.max_sequence),
                          config.trust_remote_code, prompt_name)


def library_check(config: RunConfig, loaded: LoadedModel, texts: tuple[str, ...]) -> dict[str, Any]:
    """The workbench's PyTorch module against the model's own library on every text, whole, at the default fp32
    gate (the run's `tolerances` are for its variants): the module the graph is exported from must return what the
    model's users get today."""
    reference = library_reference(config, loaded, texts)
    if reference is None:
        return {"checked": False, "library": f"transformers {loaded.task.auto_class}",
                "reference": f"transformers {loaded.task.auto_class}",
                "reason": f"{loaded.task.name}: the transformers pipeline returns each token's best label, not "
                          "logits; the module is transformers' own model"}
    call, library = reference.call, reference.library
    lab = ParityLab.corpus_only(config, loaded, texts, reference)
    with TorchRunner(loaded, lab.specs) as module:
        result = lab.compare(module, "fp32", tolerances={})
    check = {"checked": True, "library": library, "reference": call, "texts": len(texts), **result}
    if any(spec.name == SENTENCE_EMBEDDING for spec in lab.specs):
        norms = np.concatenate([np.linalg.norm(e[SENTENCE_EMBEDDING], axis=-1) for e in lab.expected])
        check["norms"] = [float(norms.min()), float(norms.max())]
    return check

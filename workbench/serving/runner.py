"""A served Triton ensemble behind the runner interface: text (or a reranker's pairs) in, the task's outputs back."""
from __future__ import annotations

import numpy as np

from workbench.models.batches import Batch
from workbench.models.text import Text
from workbench.runners import Runner
from workbench.serving.backend.sparse_terms import dense_rows
from workbench.serving.client import TritonClient
from workbench.tasks.registry import SENTENCE_EMBEDDING, SPARSE_INDICES, SPARSE_VALUES


class ServedRunner(Runner):
    """The served ensemble behind the runner interface: sends each batch's texts (with request `parameters`, e.g. a
    prompt_name), trims per-token outputs to the batch's local width (servers may pad further, to a length bucket);
    for a sparse encoder (`vocabulary` terms), its sentence embedding is the one its served active terms make. The
    caller owns and closes `client`."""

    def __init__(self, client: TritonClient, model: str, texts: tuple[Text, ...], input_names: tuple[str, ...],
                 outputs: list[str], parameters: dict[str, str] | None = None, vocabulary: int = 0) -> None:
        self.client, self.model, self.texts, self.parameters = client, model, texts, parameters
        self.vocabulary = vocabulary
        self.input_names, self.output_names = input_names, tuple(outputs)
        self.name = f"served-{client.protocol}"
        self.providers = [f"triton-{client.protocol}"]

    def infer(self, batch: Batch) -> dict[str, np.ndarray]:
        # All outputs are requested: asking Triton 2.51 for a subset that another ensemble step consumes (logits ->
        # postprocess) makes the ensemble report a deadlock.
        texts = [self.texts[i] for i in batch.text_ids]
        if isinstance(texts[0], tuple):  # a reranker: the batch's pairs in one request
            got = self.client.rerank(self.model, [t[0] for t in texts], [t[1] for t in texts])
        else:
            got = self.client.infer_texts(self.model, texts, parameters=self.parameters)
        if self.vocabulary:  # what its clients index: the active terms, not the dense row
            got[SENTENCE_EMBEDDING] = dense_rows(got[SPARSE_INDICES], got[SPARSE_VALUES], self.vocabulary)
        width = batch.shape[1]
        return {k: got[k][:, :width] if got[k].ndim == 3 else got[k] for k in self.output_names}

"""The model's own library behind the runner interface: what its users run today, on the same texts. Embedding
models: `SentenceTransformer.encode()`; rerankers: `CrossEncoder.predict()`; sequence classifiers: the transformers
text-classification pipeline's raw logits and, where asked, the scores it gives with the model's own
`function_to_apply`. The workbench's PyTorch module is checked against these once, then used
for speed."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from workbench.models.batches import Batch
from workbench.models.sentence import cross_encoder, library_model, sparse_encoder
from workbench.models.text import Text
from workbench.runners import Runner, RunnerClosedError
from workbench.tasks.registry import LOGITS, SCORE, SCORES, SENTENCE_EMBEDDING, TOKEN_EMBEDDINGS, head_activation

if TYPE_CHECKING:
    from sentence_transformers import CrossEncoder, SentenceTransformer, SparseEncoder
    from transformers import Pipeline

    from workbench.models.loading import LoadedModel


class LibraryRunner(Runner):
    """A runner that is a library call users make: `library` names it in a line, `call` spells it out."""

    library: str
    call: str


class SentenceTransformerRunner(LibraryRunner):
    """`encode()` on each batch's texts (the model's default prompt applied by the library, as for its users):
    sentence embeddings, and token embeddings placed at each text's own positions of the batch."""

    def __init__(self, model: SentenceTransformer, statements: list[str], texts: tuple[str, ...],
                 input_names: tuple[str, ...], output_names: tuple[str, ...], library: str,
                 prompt_name: str | None = None) -> None:
        self.model: SentenceTransformer | None = model
        self.prompt_name = prompt_name
        named = f", prompt_name={prompt_name!r}" if prompt_name is not None else ""
        self.call, self.texts = "; ".join([*statements, f"model.encode(texts{named})"]), texts
        self.input_names, self.output_names = input_names, output_names
        self.name, self.providers, self.library = "sentence-transformers", ["torch-cpu"], library

    def infer(self, batch: Batch) -> dict[str, np.ndarray]:
        if self.model is None:
            raise RunnerClosedError(f"{self.name}: the runner is closed")
        texts = [self.texts[i] for i in batch.text_ids]
        rows = self.model.encode(texts, prompt_name=self.prompt_name, output_value=None, batch_size=len(texts),
                                 convert_to_numpy=False)
        result = {}
        if SENTENCE_EMBEDDING in self.output_names:
            result[SENTENCE_EMBEDDING] = np.stack([r[SENTENCE_EMBEDDING].float().cpu().numpy() for r in rows])
        if TOKEN_EMBEDDINGS in self.output_names:
            tokens = np.zeros((len(rows), batch.shape[1], rows[0][TOKEN_EMBEDDINGS].shape[-1]), dtype=np.float32)
            for row, out, mask in zip(rows, tokens, batch.feed["attention_mask"]):
                # each text's real tokens, wherever the library padded them, at their places in the batch
                real = row[TOKEN_EMBEDDINGS][row["attention_mask"].bool()].float().cpu().numpy()
                places = np.flatnonzero(mask)[:len(real)]
                out[places] = real[:len(places)]
            result[TOKEN_EMBEDDINGS] = tokens
        return result

    def close(self) -> None:
        self.model = None


class SparseEncoderRunner(LibraryRunner):
    """`SparseEncoder.encode()` on each batch's texts (the named prompt, else the model's default), each text's
    vocabulary-wide weights as a dense row: what parity compares term by term."""

    def __init__(self, model: SparseEncoder, statements: list[str], texts: tuple[str, ...],
                 input_names: tuple[str, ...], prompt_name: str | None = None) -> None:
        self.model: SparseEncoder | None = model
        self.prompt_name = prompt_name
        named = f", prompt_name={prompt_name!r}" if prompt_name is not None else ""
        self.call, self.texts = "; ".join([*statements, f"model.encode(texts{named})"]), texts
        self.input_names, self.output_names = input_names, (SENTENCE_EMBEDDING,)
        self.name, self.providers, self.library = "sentence-transformers", ["torch-cpu"], "SparseEncoder.encode()"

    def infer(self, batch: Batch) -> dict[str, np.ndarray]:
        if self.model is None:
            raise RunnerClosedError(f"{self.name}: the runner is closed")
        rows = self.model.encode([self.texts[i] for i in batch.text_ids], prompt_name=self.prompt_name,
                                 batch_size=len(batch.text_ids), convert_to_sparse_tensor=False)
        return {SENTENCE_EMBEDDING: rows.float().cpu().numpy()}

    def close(self) -> None:
        self.model = None


class ClassificationPipelineRunner(LibraryRunner):
    """`pipeline("text-classification", top_k=None, function_to_apply="none")`: every label's raw logit per text;
    with SCORE among `output_names`, the scores the pipeline's own postprocess gives those logits with the model's
    `function_to_apply` (top_k=None), as the served head returns them: the best label's after a softmax (`activation`),
    else every label's."""

    def __init__(self, pipe: Pipeline, call: str, texts: tuple[str, ...], input_names: tuple[str, ...],
                 max_length: int, output_names: tuple[str, ...], activation: str) -> None:
        self.pipe: Pipeline | None = pipe
        self.call, self.texts, self.max_length, self.activation = call, texts, max_length, activation
        self.label_ids = {label: int(i) for i, label in pipe.model.config.id2label.items()}
        self.input_names, self.output_names = input_names, output_names
        self.name, self.providers = "transformers-pipeline", ["torch-cpu"]
        self.library = "the text-classification pipeline"

    def infer(self, batch: Batch) -> dict[str, np.ndarray]:
        if self.pipe is None:
            raise RunnerClosedError(f"{self.name}: the runner is closed")
        answers = self.pipe([self.texts[i] for i in batch.text_ids], truncation=True, max_length=self.max_length)
        logits = self.by_label(answers)
        if SCORE not in self.output_names:
            return {LOGITS: logits}
        import torch

        scores = self.by_label([self.pipe.postprocess({LOGITS: torch.from_numpy(row[None])}, top_k=None)
                                for row in logits])  # its default function_to_apply on each text's logits
        return {LOGITS: logits, SCORE: scores.max(axis=-1, keepdims=True) if self.activation == "softmax" else scores}

    def by_label(self, answers: list[list[dict[str, float | str]]]) -> np.ndarray:
        """The pipeline's answers (per text, each label with its score) as one row per text, in label id order."""
        rows = np.zeros((len(answers), len(self.label_ids)), dtype=np.float32)
        for row, labels in zip(rows, answers):
            for answer in labels:
                row[self.label_ids[str(answer["label"])]] = answer["score"]
        return rows

    def close(self) -> None:
        self.pipe = None


class CrossEncoderRunner(LibraryRunner):
    """`predict()` on each batch's (query, document) pairs with the identity as activation: the logits, and the
    scores its own activation makes of them, as predict() applies it; one row per pair, one column per label."""

    def __init__(self, model: CrossEncoder, call: str, texts: tuple[Text, ...], input_names: tuple[str, ...]) -> None:
        self.model: CrossEncoder | None = model
        self.call, self.texts, self.input_names, self.output_names = call, texts, input_names, (LOGITS, SCORES)
        self.name, self.providers, self.library = "cross-encoder", ["torch-cpu"], "CrossEncoder.predict()"

    def infer(self, batch: Batch) -> dict[str, np.ndarray]:
        import torch

        if self.model is None:
            raise RunnerClosedError(f"{self.name}: the runner is closed")
        pairs = [self.texts[i] for i in batch.text_ids]
        logits = self.model.predict(pairs, activation_fn=torch.nn.Identity(), batch_size=len(pairs),
                                    show_progress_bar=False, convert_to_tensor=True).float().reshape(len(pairs), -1)
        with torch.inference_mode():  # the activation predict() applies after them, once
            scores = self.model.activation_fn(logits)
        return {LOGITS: logits.cpu().numpy(), SCORES: scores.cpu().numpy()}

    def close(self) -> None:
        self.model = None


def library_runner(loaded: LoadedModel, texts: tuple[Text, ...], output_names: tuple[str, ...], max_length: int,
                   trust_remote_code: bool = False, prompt_name: str | None = None) -> LibraryRunner | None:
    """The library runner for the loaded model's task as the model ships, truncating at `max_length` tokens (the
    model's own limit: a statement in the call where the library would take more than the model can), with the
    named sentence-transformers prompt (None: the model's default); None for token classification: its pipeline
    returns each token's best label, not logits, so transformers' own model is the reference there."""
    if loaded.pipeline is not None and loaded.pipeline.kind == "SparseEncoder":
        encoder, statements = sparse_encoder(loaded.pipeline, trust_remote_code)
        if encoder.max_seq_length != max_length:
            encoder.max_seq_length = max_length
            statements.append(f"model.max_seq_length = {max_length}")
        sparse = SparseEncoderRunner(encoder, statements, texts, loaded.input_names, prompt_name)
        sparse.identity = _identity(loaded, sparse.call, "sentence_transformers", (SENTENCE_EMBEDDING,))
        return sparse
    if loaded.pipeline is not None:
        model, statements = library_model(loaded.pipeline, loaded.pooling, loaded.hidden_size, trust_remote_code)
        if model.max_seq_length != max_length:
            model.max_seq_length = max_length
            statements.append(f"model.max_seq_length = {max_length}")
        cut = loaded.pipeline.truncate_dim
        library = "SentenceTransformer.encode()" + (f" with {loaded.pooling} pooling (pooling_override)"
                                                    if loaded.pooling_overridden else "") + (
            f" with truncate_dim={cut}" if cut and loaded.pooling != "none" else "")
        runner = SentenceTransformerRunner(model, statements, texts, loaded.input_names, output_names, library,
                                           prompt_name)
        runner.identity = _identity(loaded, runner.call, "sentence_transformers", output_names)
        return runner
    if loaded.task.name == "rerank":
        location = loaded.source.location
        call = f"CrossEncoder({location!r}, max_length={max_length}).predict(pairs)"
        encoder = CrossEncoderRunner(cross_encoder(location, max_length, trust_remote_code), call, texts,
                                     loaded.input_names)
        encoder.identity = _identity(loaded, call, "sentence_transformers", (LOGITS, SCORES))
        return encoder
    if loaded.task.name == "sequence-classification":
        from transformers import pipeline

        location = loaded.source.location
        pipe = pipeline("text-classification", model=location, top_k=None, function_to_apply="none", device="cpu",
                        trust_remote_code=trust_remote_code)
        activation = head_activation(loaded.hf_config.problem_type, loaded.hf_config.num_labels)
        call = f"pipeline('text-classification', model={location!r}, top_k=None, function_to_apply='none')" + (
            f"; scores: its postprocess(top_k=None) with the model's function_to_apply ({activation})"
            if SCORE in output_names else "")
        runner = ClassificationPipelineRunner(pipe, call, texts, loaded.input_names, max_length, output_names,
                                              activation)
        runner.identity = _identity(loaded, f"{call}; max_length {max_length}", "transformers", output_names)
        return runner
    return None


def _identity(loaded: LoadedModel, call: str, library: str, outputs: tuple[str, ...]) -> str | None:
    """The loaded model's identity, the library call and its version, and the outputs: what decides the answers."""
    from importlib.metadata import version

    model = loaded.identity()
    return f"{model}; {call}; {library} {version(library.replace('_', '-'))}; {','.join(outputs)}" if model else None

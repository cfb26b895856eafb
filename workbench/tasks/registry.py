"""Task registry: what each task's exported graph takes and returns."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BATCH, SEQUENCE = "batch", "sequence"
INPUT_NAMES: tuple[str, ...] = ("input_ids", "attention_mask", "token_type_ids")
# The attention mask less each text's prompt tokens: what pooling averages over when the model's sentence-transformers
# pipeline pools without the prompt (include_prompt: false); a graph input only for such models.
POOLING_MASK = "pooling_mask"
TOKEN_EMBEDDINGS, SENTENCE_EMBEDDING = "token_embeddings", "sentence_embedding"
LOGITS, SCORES = "logits", "scores"
# A sparse embedding as served: each text's active vocabulary ids and their weights (serving/backend/sparse_terms.py)
SPARSE_INDICES, SPARSE_VALUES = "sparse_indices", "sparse_values"


@dataclass(frozen=True)
class OutputSpec:
    """One graph output: its name, dynamic axes and how parity should compare it."""

    name: str
    axes: tuple[str, ...]
    kind: str  # "hidden" | "embedding" | "logits" | "token_logits" | "scores"

    @property
    def dynamic_axes(self) -> dict[int, str]:
        return {i: axis for i, axis in enumerate(self.axes) if axis in (BATCH, SEQUENCE)}

    @property
    def per_token(self) -> bool:
        return SEQUENCE in self.axes


@dataclass(frozen=True)
class Task(ABC):
    """A task: the transformers auto class to load and the outputs the graph exposes."""

    name: str
    auto_class: str
    mapping: str  # the transformers table (model_type -> class name) behind auto_class
    description: str

    def architectures(self) -> dict[str, str]:
        """Every model_type transformers can load with `auto_class`, to its model class name."""
        from transformers.models.auto import modeling_auto

        return getattr(modeling_auto, self.mapping)

    @abstractmethod
    def outputs(self, pooled: bool = True, token_embeddings: bool = True) -> tuple[OutputSpec, ...]:
        """The graph outputs, in order (feature extraction: token states unless `token_embeddings` is off, then the
        sentence embedding when `pooled`)."""

    @abstractmethod
    def forward(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor],
                head: torch.nn.Module | None) -> dict[str, torch.Tensor]:
        """Run the loaded model (and, for embeddings, the sentence-transformers `head` after it): every output."""


class FeatureExtraction(Task):
    """Sentence-transformers' names: `token_embeddings` from the transformer, `sentence_embedding` from its head
    (pooling, then any Dense and Normalize modules), exactly what `SentenceTransformer.encode()` returns."""

    def outputs(self, pooled: bool = True, token_embeddings: bool = True) -> tuple[OutputSpec, ...]:
        specs = (OutputSpec(TOKEN_EMBEDDINGS, (BATCH, SEQUENCE, "hidden"), "hidden"),) if token_embeddings else ()
        return specs + ((OutputSpec(SENTENCE_EMBEDDING, (BATCH, "embedding"), "embedding"),) if pooled else ())

    def forward(self, model, inputs, head):
        pooled_over = inputs.get(POOLING_MASK, inputs["attention_mask"])
        hidden = model(**{name: value for name, value in inputs.items() if name != POOLING_MASK}).last_hidden_state
        outputs = {TOKEN_EMBEDDINGS: hidden}
        if head is not None:
            features = head({TOKEN_EMBEDDINGS: hidden, "attention_mask": pooled_over})
            outputs[SENTENCE_EMBEDDING] = features[SENTENCE_EMBEDDING]
        return outputs


class SequenceClassification(Task):
    def outputs(self, pooled: bool = True, token_embeddings: bool = True) -> tuple[OutputSpec, ...]:
        return (OutputSpec("logits", (BATCH, "labels"), "logits"),)

    def forward(self, model, inputs, head):
        return {"logits": model(**inputs).logits}


class Rerank(Task):
    """A cross-encoder: one (query, document) pair per row; the classifier's `logits` and the `scores`
    `CrossEncoder.predict()` returns, its activation (`head`) applied inside the graph."""

    def outputs(self, pooled: bool = True, token_embeddings: bool = True) -> tuple[OutputSpec, ...]:
        return OutputSpec(LOGITS, (BATCH, "labels"), "logits"), OutputSpec(SCORES, (BATCH, "labels"), "scores")

    def forward(self, model, inputs, head):
        logits = model(**inputs).logits
        return {LOGITS: logits, SCORES: head(logits) if head is not None else logits}


class TokenClassification(Task):
    def outputs(self, pooled: bool = True, token_embeddings: bool = True) -> tuple[OutputSpec, ...]:
        return (OutputSpec("logits", (BATCH, SEQUENCE, "labels"), "token_logits"),)

    def forward(self, model, inputs, head):
        return {"logits": model(**inputs).logits}


def served_outputs(outputs: tuple[OutputSpec, ...], chosen: list[str] | None) -> tuple[OutputSpec, ...]:
    """What a deployment returns of `outputs`: the names `chosen` (triton.outputs), else the sentence embedding alone
    where there is one (token states are batch x sequence x hidden floats per request), else every output. Parity
    gates a variant on these; the others are measured and shown."""
    if chosen is None:
        embeddings = tuple(o for o in outputs if o.kind == "embedding")
        return embeddings or outputs
    return tuple(o for o in outputs if o.name in chosen)


class SparseEmbedding(Task):
    """A sentence-transformers SparseEncoder (SPLADE): the masked language model's logits per token, pooled by the
    model's own modules (SpladePooling: log(1 + relu) then max or sum over the tokens) into one weight per vocabulary
    term: `sentence_embedding` as `SparseEncoder.encode()` returns it, dense, mostly zeros; the deployment serves
    its active terms."""

    def outputs(self, pooled: bool = True, token_embeddings: bool = True) -> tuple[OutputSpec, ...]:
        return (OutputSpec(SENTENCE_EMBEDDING, (BATCH, "vocabulary"), "sparse"),)

    def forward(self, model, inputs, head):
        logits = model(**inputs).logits
        return {SENTENCE_EMBEDDING: head({TOKEN_EMBEDDINGS: logits, "attention_mask": inputs["attention_mask"]}
                                         )[SENTENCE_EMBEDDING]}


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        FeatureExtraction("feature-extraction", "AutoModel", "MODEL_MAPPING_NAMES",
                          "token states and a pooled sentence embedding"),
        SequenceClassification("sequence-classification", "AutoModelForSequenceClassification",
                               "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "one label per text"),
        Rerank("rerank", "AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
               "a cross-encoder's scores for (query, document) pairs"),
        TokenClassification("token-classification", "AutoModelForTokenClassification",
                            "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "one label per token"),
        SparseEmbedding("sparse-embedding", "AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
                        "a sparse encoder's (SPLADE) weight per vocabulary term"),
    )
}

SCORE = "score"  # a classifier's served score: its head's activation applied to the logits (serving/backend/labels.py)


def head_activation(problem_type: str | None, num_labels: int) -> str:
    """What transformers' text-classification pipeline applies to a sequence classifier's logits unless told
    (`function_to_apply`): none for regression, sigmoid for multi-label or a single label, else softmax."""
    if problem_type == "regression":
        return "none"
    if problem_type == "multi_label_classification" or num_labels == 1:
        return "sigmoid"
    return "softmax"


def score_output(activation: str) -> OutputSpec:
    """A sequence classifier's served `score` as parity compares it: the best label's probability after a softmax,
    else every label's score."""
    return OutputSpec(SCORE, (BATCH, "best" if activation == "softmax" else "labels"), "scores")


# The tasks whose graph runs a sentence-transformers pipeline after the transformer (its modules.json, read first).
PIPELINE_TASKS = ("feature-extraction", "sparse-embedding")

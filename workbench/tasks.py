"""Task registry: what each task's exported graph takes and returns."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

BATCH, SEQUENCE = "batch", "sequence"
INPUT_NAMES: tuple[str, ...] = ("input_ids", "attention_mask", "token_type_ids")


@dataclass(frozen=True)
class OutputSpec:
    """One graph output: its name, dynamic axes and how parity should compare it."""

    name: str
    axes: tuple[str, ...]
    kind: str  # "hidden" | "embedding" | "logits" | "token_logits"

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
    def outputs(self, pooling: str) -> tuple[OutputSpec, ...]:
        """The graph outputs, in order."""

    @abstractmethod
    def forward(self, model: Any, inputs: dict[str, torch.Tensor], pooling: str) -> tuple[torch.Tensor, ...]:
        """Run the loaded model and return the outputs in the order of `outputs`."""


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """Sentence embedding from token states: mean over real tokens, or the first token."""
    if pooling == "cls":
        return hidden[:, 0]
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


class FeatureExtraction(Task):
    def outputs(self, pooling: str) -> tuple[OutputSpec, ...]:
        hidden = OutputSpec("last_hidden_state", (BATCH, SEQUENCE, "hidden"), "hidden")
        if pooling == "none":
            return (hidden,)
        return hidden, OutputSpec("sentence_embedding", (BATCH, "hidden"), "embedding")

    def forward(self, model, inputs, pooling):
        hidden = model(**inputs).last_hidden_state
        if pooling == "none":
            return (hidden,)
        return hidden, pool(hidden, inputs["attention_mask"], pooling)


class SequenceClassification(Task):
    def outputs(self, pooling: str) -> tuple[OutputSpec, ...]:
        return (OutputSpec("logits", (BATCH, "labels"), "logits"),)

    def forward(self, model, inputs, pooling):
        return (model(**inputs).logits,)


class TokenClassification(Task):
    def outputs(self, pooling: str) -> tuple[OutputSpec, ...]:
        return (OutputSpec("logits", (BATCH, SEQUENCE, "labels"), "token_logits"),)

    def forward(self, model, inputs, pooling):
        return (model(**inputs).logits,)


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        FeatureExtraction("feature-extraction", "AutoModel", "MODEL_MAPPING_NAMES",
                          "token states and a pooled sentence embedding"),
        SequenceClassification("sequence-classification", "AutoModelForSequenceClassification",
                               "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "one label per text"),
        TokenClassification("token-classification", "AutoModelForTokenClassification",
                            "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "one label per token"),
    )
}

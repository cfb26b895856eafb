"""Torch modules the workbench puts after the library's own, as encode() applies them."""
from __future__ import annotations

import torch


class Truncate(torch.nn.Module):
    """encode(truncate_dim=d): the sentence embedding's first `dim` values, not renormalized (as the library cuts)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**features, "sentence_embedding": features["sentence_embedding"][..., :self.dim]}


class KeepTop(torch.nn.Module):
    """A sparse encoder's encode(max_active_dims=k): the `k` largest weights of each row kept, the others zero."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from sentence_transformers.util import select_max_active_dims  # the library's own cut, torch ops alone

        return {**features, "sentence_embedding": select_max_active_dims(features["sentence_embedding"], self.k)}


class FeaturesToEmbedding(torch.nn.Module):
    """A head (features dict in and out) taking token embeddings and the attention mask positionally and returning
    the sentence embedding, as torch.onnx traces a module."""

    def __init__(self, head: torch.nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, token_embeddings: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head({"token_embeddings": token_embeddings, "attention_mask": attention_mask})["sentence_embedding"]

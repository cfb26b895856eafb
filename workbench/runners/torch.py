"""The PyTorch reference: the loaded model behind the same positional signature as the exported graph."""
from __future__ import annotations

import numpy as np
import torch

from workbench.batches import Batch
from workbench.models import LoadedModel
from workbench.runners import Runner, RunnerClosedError
from workbench.tasks import OutputSpec


class GraphModule(torch.nn.Module):
    """Takes the graph inputs positionally and returns `outputs` in order: the transformer, then (embeddings) the
    model's sentence-transformers head."""

    def __init__(self, loaded: LoadedModel, outputs: tuple[OutputSpec, ...]) -> None:
        super().__init__()
        self.model = loaded.model
        self.head = loaded.head
        self.task = loaded.task
        self.output_names = tuple(o.name for o in outputs)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            inputs["token_type_ids"] = token_type_ids
        results = self.task.forward(self.model, inputs, self.head)
        return tuple(results[name] for name in self.output_names)


class TorchRunner(Runner):
    """PyTorch eager in fp32, no grad: the module the ONNX graph is exported from, checked against the model's own
    library (reference.py), then the reference every variant is compared with; `close()` drops the module."""

    def __init__(self, loaded: LoadedModel, outputs: tuple[OutputSpec, ...], name: str = "pytorch") -> None:
        self.name = name
        self.module: GraphModule | None = GraphModule(loaded, outputs).eval()
        self.input_names = loaded.input_names
        self.output_names = self.module.output_names
        self.providers = ["torch-cpu"]

    def infer(self, batch: Batch) -> dict[str, np.ndarray]:
        if self.module is None:
            raise RunnerClosedError(f"{self.name}: the PyTorch runner is closed")
        with torch.inference_mode():
            outputs = self.module(*(torch.from_numpy(batch.feed[name]) for name in self.input_names))
        return {name: out.numpy() for name, out in zip(self.output_names, outputs)}

    def close(self) -> None:
        self.module = None

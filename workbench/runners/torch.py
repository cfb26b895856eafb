"""The PyTorch reference: the loaded model behind the same positional signature as the exported graph."""
from __future__ import annotations

import numpy as np
import torch

from workbench.batches import Batch
from workbench.models import LoadedModel
from workbench.runners import Runner, RunnerClosedError


class GraphModule(torch.nn.Module):
    """Takes the graph inputs positionally and returns the task's outputs in order."""

    def __init__(self, loaded: LoadedModel, pooling: str) -> None:
        super().__init__()
        self.model = loaded.model
        self.task = loaded.task
        self.pooling = pooling

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            inputs["token_type_ids"] = token_type_ids
        return self.task.forward(self.model, inputs, self.pooling)


class TorchRunner(Runner):
    """PyTorch eager in fp32, no grad: the reference every variant is compared with; `close()` drops the module."""

    def __init__(self, loaded: LoadedModel, pooling: str, name: str = "pytorch") -> None:
        self.name = name
        self.module: GraphModule | None = GraphModule(loaded, pooling).eval()
        self.input_names = loaded.input_names
        self.output_names = tuple(o.name for o in loaded.task.outputs(pooling))
        self.providers = ["torch-cpu"]

    def infer(self, batch: Batch) -> dict[str, np.ndarray]:
        if self.module is None:
            raise RunnerClosedError(f"{self.name}: the PyTorch runner is closed")
        with torch.inference_mode():
            outputs = self.module(*(torch.from_numpy(batch.feed[name]) for name in self.input_names))
        return {name: out.numpy() for name, out in zip(self.output_names, outputs)}

    def close(self) -> None:
        self.module = None

"""The PyTorch reference: the loaded model behind the same positional signature as the exported graph."""
from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import torch

from workbench.models.batches import Batch
from workbench.models.loading import LoadedModel
from workbench.runners import IO, Device, Runner, RunnerClosedError
from workbench.tasks.registry import OutputSpec


def torch_device(device: Device) -> Device:
    """Where PyTorch runs for a run on `device`: there when PyTorch has it (a CPU build of torch has no CUDA)."""
    return "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"


class GraphModule(torch.nn.Module):
    """Takes the graph inputs positionally and returns `outputs` in order: the transformer, then (embeddings) the
    model's sentence-transformers head."""

    def __init__(self, loaded: LoadedModel, outputs: tuple[OutputSpec, ...]) -> None:
        super().__init__()
        self.model = loaded.model
        self.head = loaded.head
        self.task = loaded.task
        self.input_names = loaded.input_names
        self.output_names = tuple(o.name for o in outputs)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The graph inputs in `input_names` order (input_ids, attention_mask, then those the model takes)."""
        results = self.task.forward(self.model, dict(zip(self.input_names, inputs)), self.head)
        return tuple(results[name] for name in self.output_names)


class TorchRunner(Runner):
    """PyTorch in fp32, no grad: the module the ONNX graph is exported from, checked against the model's own library
    (lab.library_check), then the reference every variant is compared with; `close()` drops the module. It runs
    sdpa attention where the architecture has it (`LoadedModel.reference_attention`), as the library does.

    On `device` cuda it runs there with TF32 off (fp32 means fp32); `half` runs a copy in fp16, `compiled` a copy
    through torch.compile. `io` device: the batch's inputs are copied to the device once (`timed`), outputs stay."""

    def __init__(self, loaded: LoadedModel, outputs: tuple[OutputSpec, ...], name: str = "pytorch",
                 device: Device = "cpu", half: bool = False, compiled: bool = False, io: IO = "host") -> None:
        self.name, self.device, self.io = name, device, io
        self.precision = "fp16" if half else "fp32"
        self.engine = f"{'torch.compile' if compiled else 'PyTorch eager'} {self.precision}"
        self.attention = loaded.reference_attention()
        module = GraphModule(loaded, outputs).eval()
        if device != "cpu" or half or compiled:  # a copy: the loaded model stays as it was for other runners
            module = copy.deepcopy(module)
        if device == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            module = module.to("cuda")
        if half:
            module = module.half()
        self.module: torch.nn.Module | None = torch.compile(module) if compiled else module
        self.input_names = loaded.input_names
        self.output_names = tuple(o.name for o in outputs)
        self.providers = [f"torch-{device}"]
        model = loaded.identity()
        self.identity = (f"{model}; {self.engine}, {self.attention} attention, on {device}; "
                         f"{','.join(self.output_names)}") if model else None

    def _run(self, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if self.module is None:
            raise RunnerClosedError(f"{self.name}: the PyTorch runner is closed")
        with torch.inference_mode():
            return self.module(*inputs)

    def _inputs(self, batch: Batch) -> list[torch.Tensor]:
        return [torch.from_numpy(batch.feed[name]).to(self.device) for name in self.input_names]

    def infer(self, batch: Batch) -> dict[str, np.ndarray]:
        outputs = self._run(self._inputs(batch))
        return {name: out.float().cpu().numpy() for name, out in zip(self.output_names, outputs)}

    def timed(self, batch: Batch) -> Callable[[], object]:
        if self.io == "host":
            return super().timed(batch)
        inputs = self._inputs(batch)

        def call() -> object:
            outputs = self._run(inputs)
            if self.device == "cuda":
                torch.cuda.synchronize()
            return outputs
        return call

    def close(self) -> None:
        self.module = None

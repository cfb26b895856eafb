"""The pipeline's steps in run order. One word names each step everywhere: `--steps <step>`, the module
`workbench/steps/<step>.py`, the notebook `notebooks/NN_<step>.ipynb` (NN: its place in the run order) and the
run.json keys `steps.<step>` and `metrics.<step>`."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepInfo:
    name: str
    number: int
    summary: str

    @property
    def notebook(self) -> str:
        return f"{self.number:02d}_{self.name}.ipynb"


# TensorRT runs after parity so its fp16 engine can pin the layers the fp16 repair found; bench measures what
# triton deployed; the report renders everything the run recorded.
STEPS: tuple[StepInfo, ...] = tuple(StepInfo(name, number, summary) for number, (name, summary) in enumerate((
    ("export", "PyTorch -> ONNX with dynamic batch and sequence axes"),
    ("optimize", "ONNX Runtime fusions, fp16, int8, symbolic shapes"),
    ("parity", "every variant vs PyTorch on real text; fp16/int8 precision repair"),
    ("tensorrt", "shape profiles from token lengths; TensorRT engines (GPU), cached and checked"),
    ("triton", "Triton model repository; a real server; served parity and batching"),
    ("generation", "translation and text generation on Triton: HF vs CTranslate2"),
    ("bench", "in-process latency grid and served load sweeps, batching search, tokenization placement"),
    ("report", "render run.json into one self-contained report.html"),
), start=1))
STEP_NAMES: tuple[str, ...] = tuple(step.name for step in STEPS)


def step_info(name: str) -> StepInfo:
    for step in STEPS:
        if step.name == name:
            return step
    raise KeyError(name)

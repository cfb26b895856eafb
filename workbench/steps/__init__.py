"""Pipeline steps: one module and one notebook per step, under the same name."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepInfo:
    name: str
    notebook: str
    summary: str


# Pipeline order. TensorRT runs after parity so its fp16 engine can pin the layers the fp16 repair found; the report
# comes last so it shows everything, generation included.
STEPS: tuple[StepInfo, ...] = (
    StepInfo("export", "01_export.ipynb", "PyTorch -> ONNX with dynamic batch and sequence axes"),
    StepInfo("optimize", "02_optimize.ipynb", "ONNX Runtime fusions, fp16, int8, symbolic shapes"),
    StepInfo("parity", "04_parity.ipynb", "every variant vs PyTorch on real text; fp16/int8 precision repair"),
    StepInfo("tensorrt", "03_tensorrt.ipynb", "shape profiles from token lengths; TensorRT engines (GPU), cached"),
    StepInfo("triton", "05_triton.ipynb", "Triton model repository; a real server; served parity and batching"),
    StepInfo("generation", "07_generation.ipynb", "translation and text generation on Triton: HF vs CTranslate2"),
    StepInfo("report", "06_report.ipynb", "latency grid and served load sweeps; one self-contained report.html"),
)
STEP_NAMES: tuple[str, ...] = tuple(step.name for step in STEPS)


def step_info(name: str) -> StepInfo:
    for step in STEPS:
        if step.name == name:
            return step
    raise KeyError(name)

"""The bench step's settings (`-p bench.<setting>`): what the in-process and served benchmarks measure, and their
bounds (rounds, requests and seconds)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from workbench.core.config import StepSettings


class BenchSettings(StepSettings):
    """The bench step: in-process and served benchmarks (bounded: rounds, requests and seconds)."""

    batches: list[int] = [1, 8]
    sequences: list[int] = [16, 128]
    rounds: int = Field(default=20, ge=3)
    warmup: int = Field(default=3, ge=0)
    seconds_per_cell: float = Field(default=60.0, gt=0)
    long_texts: bool = Field(default=True, description=(
        "a batch-1 cell at 2048 tokens and one at sequence.max, where they are longer than the grid's longest"))
    tune_sessions: bool = Field(default=True, description="measure ONNX Runtime session settings per variant first")
    torch_compile: bool = Field(default=False, description=(
        "a torch.compile row beside PyTorch eager (compiles for minutes), checked on the parity lab like a variant"))
    served: bool = True
    concurrency: list[int] = [1, 4, 16]
    requests_per_level: int = Field(default=160, ge=8)
    seconds_per_level: float = Field(default=20.0, gt=0)
    load_tool: Literal["auto", "perf_analyzer", "asyncio"] = "auto"
    p99_limit_ms: float = Field(default=500.0, gt=0)
    search_queue_delays_us: list[int] = [0, 4000]
    search_instances: list[int] = [1, 2]


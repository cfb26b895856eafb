"""The bench step's settings (`-p bench.<setting>`): what the in-process and served benchmarks measure, and their
bounds (rounds, requests and seconds)."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from workbench.core.config import Count, StepSettings


class BenchSettings(StepSettings):
    """The bench step: in-process and served benchmarks (bounded: rounds, requests and seconds)."""

    batches: list[Count] = Field(default=[1, 8], min_length=1)
    sequences: list[Count] = Field(default=[16, 128], min_length=1)
    rounds: int = Field(default=20, ge=3)
    warmup: int = Field(default=3, ge=0)
    seconds_per_cell: float = Field(default=60.0, gt=0)
    long_texts: bool = Field(default=True, description=(
        "a batch-1 cell at 2048 tokens and one at sequence.max, where they are longer than the grid's longest"))
    tune_sessions: bool = Field(default=True, description="measure ONNX Runtime session settings per variant first")
    torch_compile: bool = Field(default=False, description=(
        "a torch.compile row beside PyTorch eager (compiles for minutes), checked on the parity lab like a variant"))
    served: bool = True
    concurrency: list[Count] = Field(default=[1, 4, 16], min_length=1)
    requests_per_level: int = Field(default=160, ge=8)
    seconds_per_level: float = Field(default=20.0, gt=0)
    load_tool: Literal["auto", "perf_analyzer", "asyncio"] = "auto"
    p99_limit_ms: float = Field(default=500.0, gt=0)
    search_queue_delays_us: list[Annotated[int, Field(ge=0)]] = Field(default=[0, 4000], min_length=1)
    search_instances: list[Count] = Field(default=[1, 2], min_length=1)


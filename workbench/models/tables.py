"""What the export step records of the model it loaded: where it came from and the sentence-transformers pipeline
its graph runs (`metrics.export.source`, `metrics.export.sentence_pipeline`)."""
from __future__ import annotations

from pydantic import Field

from workbench.core.metrics import Metrics


class PipelineSummary(Metrics):
    """The sentence-transformers pipeline the exported graph runs, as run.json records it
    (`models.sentence.SentencePipeline.describe`)."""

    declared: bool = True  # from modules.json (False: what SentenceTransformer builds for a plain encoder)
    source: str = ""
    steps: list[str] = Field(default_factory=list)
    pooling: str | None = None
    declared_pooling: str | None = None
    normalize: bool | None = None
    dense_layers: int = 0
    max_seq_length: int | None = None
    prompts: dict[str, str] = Field(default_factory=dict)
    include_prompt: bool = True
    do_lower_case: bool = False
    default_prompt_name: str | None = None
    similarity: str = "cosine"
    truncate_dim: int | None = None  # the embedding's first values the graph returns (encode(truncate_dim=...))
    max_active_dims: int | None = None  # a sparse encoder's heaviest terms kept (encode(max_active_dims=...))
    override: str | None = None  # the pooling_override, said in words


class ModelOrigin(Metrics):
    """Where the exported model came from (`models.loading.ModelSource`)."""

    kind: str
    location: str

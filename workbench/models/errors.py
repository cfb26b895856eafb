"""Typed errors of loading a model: its folder, weights, tokenizer, architecture and pooling."""
from __future__ import annotations

from workbench.core.errors import ConfigError, WorkbenchError


class ModelNotFoundError(WorkbenchError):
    """The model path or id cannot be found."""


class ZippedModelError(ModelNotFoundError):
    """The model path holds the model as a zip (as some pip packages ship one) instead of a model folder."""


class TokenizerNotFoundError(WorkbenchError):
    """The model has no loadable tokenizer."""


class UnsupportedModelError(WorkbenchError):
    """The architecture or task is not supported."""


class ModelLoadError(WorkbenchError):
    """The model's files are there but cannot be read (truncated or corrupt weights)."""


class PoolingMismatchError(ConfigError):
    """`pooling` contradicts what the model's sentence-transformers files declare."""

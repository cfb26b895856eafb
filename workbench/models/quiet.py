"""Silence the warnings known to be harmless for what the workbench does; everything else still shows."""
from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

# ONNX Runtime's quantizer suggests its pre-processing (shape inference and graph optimization) on every call: the
# optimize step quantizes graphs it has already optimized and shape-inferred.
HARMLESS_LOG_MESSAGES = ("Please consider to run pre-processing before quantization",
                         "Please consider pre-processing before quantization")


class _DropHarmless(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(HARMLESS_LOG_MESSAGES)


class _DropTooLong(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Token indices sequence length is longer than")


def quiet_known_warnings() -> None:
    """Apply the process-wide filters once (notebook kernels call this through `notebook.start`)."""
    root = logging.getLogger()
    if not any(isinstance(f, _DropHarmless) for f in root.filters):
        root.addFilter(_DropHarmless())
    logging.getLogger("onnxruntime").setLevel(logging.ERROR)
    # ONNX Runtime's transformer fusions run without their symbolic shape inference here (graphs.variants: it copies
    # the whole graph); its layer-norm fusion says so on every call, under its module's bare name.
    logging.getLogger("fusion_skiplayernorm").setLevel(logging.ERROR)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # "Loading weights" bars of a fraction of a second
    # Marian's tokenizer suggests sacremoses for punctuation normalisation the translation models here do not use;
    # token counts over a model's limit are about texts the workbench cuts to it (generation.max_input_tokens).
    warnings.filterwarnings("ignore", message="Recommended: pip install sacremoses")
    transformers_logging.get_logger("transformers.tokenization_utils_base").addFilter(_DropTooLong())


@contextmanager
def quiet_tracer() -> Iterator[None]:
    """The legacy exporter's tracer warnings about Python values frozen into the graph.

    They name shape arithmetic in the model's mask code; a graph that froze a shape would fail the parity step,
    which runs every batch size and length of the run configuration on real text.
    """
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", message="Exporting aten::index operator of advanced indexing")
        yield

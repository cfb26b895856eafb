"""The settings the notebooks' parameters cell sets by names of their own (`sequence_max = 128`), typed and
commented; advice in the Lab names them."""
from __future__ import annotations

from dataclasses import dataclass

from workbench.tasks.choice import AUTO
from workbench.tasks.registry import TASKS


@dataclass(frozen=True)
class Parameter:
    """One notebook parameter: its name, the run-configuration setting it sets, its type in words and a help line."""

    name: str
    setting: str
    type_name: str
    help: str


PARAMETERS = (
    Parameter("model", "model", "str", "HF model id or local folder; the default is embedded in a pip package"),
    Parameter("task", "task", "str", f"{AUTO} (the head a folder's config.json names, else feature-extraction), "
              + ", ".join(TASKS)),
    Parameter("pooling", "pooling", "str", "feature-extraction: auto (the model's sentence-transformers files, else "
              "mean), mean, cls, max, lasttoken, ... or none"),
    Parameter("precisions", "precisions", "list or auto", "ONNX variants to build and check: a list of fp32, fp16, "
              "bf16, int8; auto: fp32, and fp16/bf16/int8 where the deployment's target serves them faster"),
    Parameter("batch_min", "batch.min", "int", "batch sizes served: smallest"),
    Parameter("batch_opt", "batch.opt", "int", "most frequent"),
    Parameter("batch_max", "batch.max", "int", "largest"),
    Parameter("sequence_min", "sequence.min", "int", "tokens per text: fewest"),
    Parameter("sequence_opt", "sequence.opt", "int or auto", "most frequent; auto: the smaller of 128 and max"),
    Parameter("sequence_max", "sequence.max", "int or auto", "most; auto: the model's own limit (where its library "
              "cuts texts)"),
    Parameter("corpus", "corpus", "str", "UTF-8 text file, one text per line; None: the shipped corpus"),
    Parameter("device", "device", "str", "auto, cpu or cuda"),
    Parameter("threads", "threads", "int", "intra-op threads for PyTorch and ONNX Runtime; None: all cores"),
)


def parameter_of(setting: str) -> str | None:
    """The notebook parameter that sets `setting` (`sequence.max` -> `sequence_max`), if one does."""
    return next((p.name for p in PARAMETERS if p.setting == setting), None)

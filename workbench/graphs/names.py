"""The names of the model variants a run builds, spelled once: the optimize step builds them, the parity step checks
and repairs them, the serving plan orders them, run.json keys its artifacts and verdicts by them."""
from __future__ import annotations

from enum import Enum


class VariantName(str, Enum):
    """A variant's name; it prints as its value (as enum.StrEnum would on Python 3.11+; the package runs on 3.10)."""

    ORIGINAL = "original"  # the exported graph as it is
    FP32 = "fp32"  # ONNX Runtime's fusions
    FP16 = "fp16"
    INT8 = "int8"  # ONNX Runtime's dynamic int8
    FP16_REPAIRED = "fp16_repaired"  # a repair's: nodes kept in fp32 until it passes parity
    INT8_REPAIRED = "int8_repaired"
    OPENVINO = "openvino"  # the exported graph run by OpenVINO in fp32
    OPENVINO_BF16 = "openvino_bf16"  # the same in bf16
    OPENVINO_INT8 = "openvino_int8"  # NNCF's int8 run by OpenVINO
    OPENVINO_INT8_REPAIRED = "openvino_int8_repaired"
    TRT_FP32 = "trt_fp32"  # TensorRT engines
    TRT_FP16 = "trt_fp16"

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @property
    def repaired(self) -> VariantName:
        """The variant a repair of this one writes (`int8` -> `int8_repaired`)."""
        return VariantName(f"{self.value}_repaired")

    @property
    def openvino(self) -> bool:
        """Whether OpenVINO runs it."""
        return self.value.startswith("openvino")

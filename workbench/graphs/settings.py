"""The optimize step's settings (`-p optimize.<setting>`): the fused graph's form and rules, the OpenVINO variants,
what the fp16 and int8 variants keep in float."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from workbench.core.config import Settings, StepSettings


class Fp16Settings(Settings):
    """What the fp16 variant keeps in fp32."""

    op_block_list: list[str] = Field(default_factory=list, description="op types kept in fp32")
    node_block_list: list[str] = Field(default_factory=list, description="node names kept in fp32")


class Int8Settings(Settings):
    """ONNX Runtime's dynamic quantization of the int8 variant."""

    per_channel: bool = True
    nodes_to_exclude: list[str] = Field(default_factory=list, description="node names left in float")



class OptimizeSettings(StepSettings):
    """The optimize step: the fused graph's form and rules, the OpenVINO variants, the fp16 and int8 variants."""

    graph_form: Literal["auto", "fused", "separate"] = Field(default="auto", description=(
        "layer norms of the fused graph: SkipLayerNormalization (fused), Add + LayerNormalization (separate), or "
        "whichever runs faster here (auto)"))
    borrowed_rules: Literal["auto", "always", "never"] = Field(default="auto", description=(
        "for an encoder family ONNX Runtime's optimizer has no fusion rules for (MPNet, ALBERT, DeBERTa-v2, ...): "
        "BERT's rules and attention with its position bias fused, kept when its outputs match the basic graph's and "
        "it runs clearly faster here (auto), whenever they match (always), or not tried (never)"))
    openvino: Literal["auto", "always", "never"] = Field(default="auto", description=(
        "a CPU deployment's fp32 graph run by OpenVINO instead of ONNX Runtime (the [openvino] extra): kept as the "
        "`openvino` variant when its outputs match the fp32 graph's and it runs clearly faster here (auto), "
        "whenever they match (always), or not tried (never); NNCF's int8 run by OpenVINO likewise, raced against the "
        "fastest graph kept before it"))
    fp16: Fp16Settings = Fp16Settings()
    int8: Int8Settings = Int8Settings()


"""One record per encoder family the workbench knows (transformers' `model_type`): the fusion rules ONNX Runtime's
transformer optimizer has for it (else the rules borrowed), whether its position ids start after the padding index,
and how a tiny random-weight one is built (`models.tiny.build_encoder`: tests and benchmarks). A family not listed
is exported and optimized at ONNX Runtime's basic level, with the borrowed rules tried (`optimize.borrowed_rules`).

Adding a family is one `Family(...)` line here (docs/contributing.md)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# The rules tried on an encoder family ONNX Runtime's optimizer has none for (MPNet, ALBERT, DeBERTa-v2, ...), as
# Optimum maps such families.
BORROWED_RULES = "bert"
TinyTokenizer = Literal["wordpiece", "bytelevel", "mpnet", "unigram", "t5"]


@dataclass(frozen=True)
class TinyShape:
    """The sizes of a tiny model (`build_encoder`'s arguments) and the settings every family's config shares
    (vocabulary size, padding id, labels, initializer range)."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    positions: int
    common: dict[str, int | float]


@dataclass(frozen=True)
class Family:
    """What the workbench knows of one encoder family."""

    model_type: str
    fusion_rules: str | None = None  # ONNX Runtime's optimizer model type with rules for it (None: BORROWED_RULES)
    position_offset: bool = False  # its position ids start after the padding index (RoBERTa's layout)
    tiny_config: Callable[[TinyShape], PretrainedConfig] | None = None  # None: no tiny one is built
    tiny_tokenizer: TinyTokenizer = "wordpiece"
    tiny_initializer_range: float = 0.02  # transformers' default; DeBERTa-v2's logits hardly differ per text at it

    def tiny_positions(self, tokens: int) -> int:
        """The position table of a tiny one that takes `tokens` tokens (its tokenizer pads with id 1: an offset
        family's positions start at 2)."""
        return tokens + 2 if self.position_offset else tokens


def _standard(config: str) -> Callable[[TinyShape], PretrainedConfig]:
    """A family whose config takes transformers' standard size names (BERT, RoBERTa, XLM-R, MPNet: MPNet's relative
    position buckets in attention and RoBERTa's positions after the padding index come with the class)."""
    def build(shape: TinyShape) -> PretrainedConfig:
        import transformers

        return getattr(transformers, config)(hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                                             num_attention_heads=shape.heads, intermediate_size=shape.intermediate,
                                             max_position_embeddings=shape.positions, **shape.common)
    return build


def _albert(shape: TinyShape) -> PretrainedConfig:
    """ALBERT's factorized embeddings (at most 128 wide) and one set of layer weights shared by every layer."""
    from transformers import AlbertConfig

    return AlbertConfig(embedding_size=min(128, shape.hidden), hidden_size=shape.hidden,
                        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                        intermediate_size=shape.intermediate, max_position_embeddings=shape.positions, **shape.common)


def _electra(shape: TinyShape) -> PretrainedConfig:
    from transformers import ElectraConfig

    return ElectraConfig(embedding_size=shape.hidden, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, intermediate_size=shape.intermediate,
                         max_position_embeddings=shape.positions, **shape.common)


def _distilbert(shape: TinyShape) -> PretrainedConfig:
    from transformers import DistilBertConfig

    return DistilBertConfig(dim=shape.hidden, n_layers=shape.layers, n_heads=shape.heads,
                            hidden_dim=shape.intermediate, max_position_embeddings=shape.positions, **shape.common)


def _deberta_v2(shape: TinyShape) -> PretrainedConfig:
    """DeBERTa-v3's layout: disentangled relative attention (log buckets), no absolute positions or segments."""
    from transformers import DebertaV2Config

    return DebertaV2Config(hidden_size=shape.hidden, num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                           intermediate_size=shape.intermediate, max_position_embeddings=shape.positions,
                           relative_attention=True, position_buckets=32, pos_att_type=["p2c", "c2p"],
                           position_biased_input=False, norm_rel_ebd="layer_norm", share_att_key=True,
                           type_vocab_size=0, **shape.common)


def _t5(shape: TinyShape) -> PretrainedConfig:
    """T5's encoder (sentence-T5, GTR): relative position buckets in attention, RMS layer norms, gated-free ReLU
    feed-forward; its library embeds with T5EncoderModel, the decoder never loads."""
    from transformers import T5Config

    common = {key: value for key, value in shape.common.items() if key != "num_labels"}
    return T5Config(d_model=shape.hidden, num_layers=shape.layers, num_heads=shape.heads,
                    d_kv=shape.hidden // shape.heads, d_ff=shape.intermediate, eos_token_id=1,
                    decoder_start_token_id=0, **common)


FAMILIES = {family.model_type: family for family in (
    Family("bert", fusion_rules="bert", tiny_config=_standard("BertConfig")),
    Family("roberta", fusion_rules="bert", position_offset=True, tiny_config=_standard("RobertaConfig"),
           tiny_tokenizer="bytelevel"),
    Family("xlm-roberta", fusion_rules="bert", position_offset=True, tiny_config=_standard("XLMRobertaConfig"),
           tiny_tokenizer="bytelevel"),
    Family("camembert", fusion_rules="bert", position_offset=True),
    Family("distilbert", fusion_rules="bert", tiny_config=_distilbert),
    Family("electra", fusion_rules="bert", tiny_config=_electra),
    Family("albert", tiny_config=_albert),
    Family("deberta-v2", tiny_config=_deberta_v2, tiny_tokenizer="unigram", tiny_initializer_range=0.2),
    Family("mpnet", position_offset=True, tiny_config=_standard("MPNetConfig"), tiny_tokenizer="mpnet"),
    Family("t5", tiny_config=_t5, tiny_tokenizer="t5", tiny_initializer_range=1.0),
)}


def family(model_type: str) -> Family:
    """The record of `model_type` (one with no fusion rules, no offset and no tiny builder where it is not known)."""
    return FAMILIES.get(model_type) or Family(model_type)


def with_fusion_rules() -> list[str]:
    """The families ONNX Runtime's transformer optimizer has rules for."""
    return [name for name, known in FAMILIES.items() if known.fusion_rules]

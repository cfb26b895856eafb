"""Tiny random-weight models built from transformers configs, with tokenizers trained on the shipped corpus."""
from __future__ import annotations

from pathlib import Path

from workbench.data import load_corpus

MAX_POSITIONS = 128


def wordpiece_tokenizer(vocab_size: int = 600):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(load_corpus(), trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tok.decoder = decoders.WordPiece()
    return BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                             sep_token="[SEP]", mask_token="[MASK]", model_max_length=MAX_POSITIONS)


def bytelevel_tokenizer(vocab_size: int = 600):
    from tokenizers import ByteLevelBPETokenizer, processors
    from transformers import RobertaTokenizerFast

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(load_corpus(), vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")),
                                                      ("<s>", tok.token_to_id("<s>")))
    return RobertaTokenizerFast(tokenizer_object=tok._tokenizer, bos_token="<s>", eos_token="</s>",
                                unk_token="<unk>", pad_token="<pad>", mask_token="<mask>", cls_token="<s>",
                                sep_token="</s>", model_max_length=MAX_POSITIONS - 2)


def build_encoder(dest: Path, family: str = "bert", task: str = "feature-extraction", layers: int = 2,
                  hidden: int = 32, heads: int = 4, seed: int = 0) -> Path:
    """Save a tiny `family` model for `task` (random weights, fixed seed) and its tokenizer into `dest`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    tokenizer = bytelevel_tokenizer() if family == "roberta" else wordpiece_tokenizer()
    common = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id, "num_labels": 3}
    configs = {
        "bert": lambda: transformers.BertConfig(hidden_size=hidden, num_hidden_layers=layers,
                                                num_attention_heads=heads, intermediate_size=hidden * 2,
                                                max_position_embeddings=MAX_POSITIONS, **common),
        "roberta": lambda: transformers.RobertaConfig(hidden_size=hidden, num_hidden_layers=layers,
                                                      num_attention_heads=heads, intermediate_size=hidden * 2,
                                                      max_position_embeddings=MAX_POSITIONS + 2, **common),
        "distilbert": lambda: transformers.DistilBertConfig(dim=hidden, n_layers=layers, n_heads=heads,
                                                            hidden_dim=hidden * 2,
                                                            max_position_embeddings=MAX_POSITIONS, **common),
    }
    auto = {"feature-extraction": transformers.AutoModel,
            "sequence-classification": transformers.AutoModelForSequenceClassification,
            "token-classification": transformers.AutoModelForTokenClassification}[task]
    model = auto.from_config(configs[family]())
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return Path(dest)


def make_fp16_overflow(dest: Path, source: Path) -> Path:
    """Copy a tiny BERT and scale one feed-forward block so its activations pass fp16's 65504 limit.

    In fp32 the following LayerNorm brings the values back to normal; in fp16 they become inf, then NaN.
    """
    import torch
    import transformers

    model = transformers.AutoModel.from_pretrained(source)
    with torch.no_grad():
        layer = model.encoder.layer[0]
        layer.intermediate.dense.weight.mul_(2000.0)
        layer.output.dense.weight.mul_(2000.0)
    model.save_pretrained(dest)
    transformers.AutoTokenizer.from_pretrained(source).save_pretrained(dest)
    return Path(dest)

"""Tiny random-weight models built from transformers configs, with tokenizers trained on the shipped corpus.

They make every step runnable without a model hub (tests, and the generation demo): their outputs are meaningless,
their shapes, dtypes and code paths are those of the real architectures. `tiny:<name>` in a model setting builds one.
"""
from __future__ import annotations

import json
from pathlib import Path

from workbench.core.data import load_corpus
from workbench.models.families import FAMILIES, TinyShape
from workbench.models.families import family as family_record
from workbench.models.sentence import encoder_class

MAX_POSITIONS = 128


def trained_wordpiece(specials: list[str], vocab_size: int = 600, lowercase: bool = True):
    """A WordPiece `tokenizers.Tokenizer` trained on the shipped corpus, `specials` first, lowercasing unless told."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(load_corpus(), trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials))
    return tok


def wordpiece_tokenizer(vocab_size: int = 600, lowercase: bool = True, positions: int = MAX_POSITIONS):
    from tokenizers import decoders, processors
    from transformers import BertTokenizerFast

    tok = trained_wordpiece(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], vocab_size, lowercase)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tok.decoder = decoders.WordPiece()
    return BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                             sep_token="[SEP]", mask_token="[MASK]", model_max_length=positions,
                             do_lower_case=lowercase)


def mpnet_tokenizer(vocab_size: int = 600):
    """MPNet's own tokenizer (WordPiece, `<s> A </s>`, no token_type_ids) over a vocabulary trained here."""
    from transformers import MPNetTokenizer

    vocab = trained_wordpiece(["<s>", "<pad>", "</s>", "[UNK]", "<mask>"], vocab_size).get_vocab()
    return MPNetTokenizer(vocab=vocab, model_max_length=MAX_POSITIONS)


def unigram_tokenizer(vocab_size: int = 600):
    """DeBERTa-v2's own tokenizer (sentencepiece-style Unigram, `[CLS] A [SEP]`) over pieces trained here."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import DebertaV2Tokenizer

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(load_corpus(), trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                                   unk_token="[UNK]", show_progress=False))
    pieces = [tuple(piece) for piece in json.loads(tok.to_str())["model"]["vocab"]]
    return DebertaV2Tokenizer(vocab=pieces, model_max_length=MAX_POSITIONS)


def t5_tokenizer(vocab_size: int = 600):
    """T5's own tokenizer (sentencepiece-style Unigram, `A </s>`, padding id 0) over pieces trained here."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import T5Tokenizer

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(load_corpus(), trainers.UnigramTrainer(vocab_size=vocab_size, unk_token="<unk>",
                                                                   special_tokens=["<pad>", "</s>", "<unk>"],
                                                                   show_progress=False))
    pieces = [tuple(piece) for piece in json.loads(tok.to_str())["model"]["vocab"]]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=MAX_POSITIONS)


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


def tiny_families() -> list[str]:
    """The encoder families `build_encoder` builds."""
    return [name for name, known in FAMILIES.items() if known.tiny_config]


def build_encoder(dest: Path, family: str = "bert", task: str = "feature-extraction", layers: int = 2,
                  hidden: int = 32, heads: int = 4, seed: int = 0, initializer_range: float | None = None,
                  positions: int = MAX_POSITIONS, lowercase: bool = True, intermediate: int | None = None,
                  labels: int = 3) -> Path:
    """Save a tiny `family` model for `task` (random weights, fixed seed, std `initializer_range`, by default the
    family's) and its tokenizer into `dest`; it takes `positions` tokens and a WordPiece tokenizer lowercases unless
    told. The feed-forward width is
    `intermediate` (default twice `hidden`; base-size models have four times); classifiers have `labels` labels.
    The family's record (`models.families`) gives its config and which tokenizer trained here it gets (XLM-R a
    byte-level BPE, ALBERT and ELECTRA a WordPiece: their layers are what the timing sees)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    inner = intermediate or hidden * 2
    known = family_record(family)
    if known.tiny_config is None:
        raise ValueError(f"no tiny {family!r} model is built here: {', '.join(tiny_families())} are")
    tokenizer = {"bytelevel": bytelevel_tokenizer, "mpnet": mpnet_tokenizer, "unigram": unigram_tokenizer,
                 "t5": t5_tokenizer}.get(
        known.tiny_tokenizer, lambda: wordpiece_tokenizer(lowercase=lowercase, positions=positions))()
    common = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id, "num_labels": labels,
              "initializer_range": initializer_range or known.tiny_initializer_range}
    shape = TinyShape(hidden, layers, heads, inner, known.tiny_positions(positions), common)
    auto = {"feature-extraction": transformers.AutoModel,
            "sequence-classification": transformers.AutoModelForSequenceClassification,
            "token-classification": transformers.AutoModelForTokenClassification,
            "fill-mask": transformers.AutoModelForMaskedLM}[task]
    hf_config = known.tiny_config(shape)
    encoder = task == "feature-extraction" and encoder_class(hf_config)  # T5: the encoder its library loads
    model = encoder(hf_config) if encoder else auto.from_config(hf_config)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return Path(dest)


def build_cross_encoder(dest: Path, labels: int = 1, family: str = "bert", seed: int = 0,
                        initializer_range: float = 0.2, **shape: int) -> Path:
    """A `family` sequence classifier (tiny, unless `shape` gives build_encoder's layers, hidden, heads,
    intermediate, positions) with `labels` labels saved by sentence-transformers' CrossEncoder into `dest` (its
    files and activation: Sigmoid for one label, none for more, as predict() defaults). Wide random weights (std
    0.2) by default: at transformers' 0.02 every pair of a tiny one scores 0.4990 +- 3e-5, and a query's two best
    documents lie a few float32 steps apart, so any change in summation order reorders them; a deep one wants 0.02
    (at 0.2 its activations grow layer by layer until fp32 graphs and PyTorch part)."""
    import tempfile

    from sentence_transformers import CrossEncoder

    with tempfile.TemporaryDirectory() as scratch:
        classifier = build_encoder(Path(scratch), family, "sequence-classification", seed=seed, labels=labels,
                                   initializer_range=initializer_range, **shape)
        CrossEncoder(str(classifier), device="cpu").save(str(dest))
    return Path(dest)


def build_sentence_encoder(dest: Path, pooling: str | tuple[str, ...] = "cls", dense: int | None = 16,
                           normalize: bool = False, prompts: dict[str, str] | None = None,
                           default_prompt_name: str | None = None,
                           similarity: str = "dot", seed: int = 0, positions: int = MAX_POSITIONS,
                           max_seq_length: int | None = None, include_prompt: bool = True,
                           do_lower_case: bool = False) -> Path:
    """A tiny BERT (`positions` positions) saved as a sentence-transformers model by the library's own classes:
    Transformer (cutting at `max_seq_length`) -> Pooling in `pooling` (without the prompt's tokens unless
    `include_prompt`) -> an optional Dense layer (tanh, `dense` outputs) -> optional Normalize, with prompts and a
    similarity function in config_sentence_transformers.json. `do_lower_case`: the folder as older releases of the
    library wrote it, the lowercasing in sentence_bert_config.json over a tokenizer that keeps case. Wide random
    weights (std 0.2): with transformers' 0.02 every text, prompted or not, gets nearly the same embedding."""
    import tempfile

    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    with tempfile.TemporaryDirectory() as tmp:
        base = build_encoder(Path(tmp) / "encoder", seed=seed, initializer_range=0.2, positions=positions,
                             lowercase=not do_lower_case)
        torch.manual_seed(seed)
        transformer = Transformer(str(base), max_seq_length=max_seq_length)
        width = transformer.get_embedding_dimension()
        modules = [transformer, Pooling(width, pooling, include_prompt=include_prompt)]
        if dense:
            modules.append(Dense(modules[1].get_embedding_dimension(), dense))
        if normalize:
            modules.append(Normalize())
        model = SentenceTransformer(modules=modules, device="cpu", prompts=prompts,
                                    default_prompt_name=default_prompt_name, similarity_fn_name=similarity)
        model.save(str(dest))
        if do_lower_case:
            settings = {"max_seq_length": transformer.max_seq_length, "do_lower_case": True}
            (Path(dest) / "sentence_bert_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return Path(dest)


def build_sentence_t5(dest: Path, dense: int = 24, seed: int = 0, truncate_dim: int | None = None) -> Path:
    """A tiny sentence-T5 (as sentence-t5 and GTR ship): T5's encoder (T5EncoderModel) -> mean Pooling -> Dense
    without bias or activation (`dense` outputs) -> Normalize, saved by the library's own classes, cut at
    `truncate_dim` where given (Matryoshka)."""
    import tempfile

    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    with tempfile.TemporaryDirectory() as tmp:
        base = build_encoder(Path(tmp) / "encoder", "t5", seed=seed)
        torch.manual_seed(seed)
        transformer = Transformer(str(base))
        width = transformer.get_embedding_dimension()
        modules = [transformer, Pooling(width, "mean"),
                   Dense(width, dense, bias=False, activation_function=torch.nn.Identity()), Normalize()]
        SentenceTransformer(modules=modules, device="cpu", truncate_dim=truncate_dim).save(str(dest))
    return Path(dest)


def build_sparse_encoder(dest: Path, pooling: str = "max", offset: float = -3.0, seed: int = 0,
                         prompts: dict[str, str] | None = None, max_active_dims: int | None = None) -> Path:
    """A tiny SPLADE saved by sentence-transformers' SparseEncoder: a BERT masked language model (Transformer,
    fill-mask) -> SpladePooling (`pooling` max or sum of log(1 + relu(logits)) over the tokens), with `prompts` and
    `max_active_dims` in its config. Random weights make every logit about as likely positive as negative; the
    vocabulary bias is moved by `offset` so a text keeps 10 to 50 of its 600 terms
    active, as a trained SPLADE keeps tens of its 30,000."""
    import tempfile

    import torch
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    with tempfile.TemporaryDirectory() as tmp:
        base = build_encoder(Path(tmp) / "mlm", "bert", "fill-mask", seed=seed, initializer_range=0.2)
        transformer = Transformer(str(base), transformer_task="fill-mask")
        with torch.no_grad():
            transformer.auto_model.get_output_embeddings().bias.add_(offset)
        model = SparseEncoder(modules=[transformer, SpladePooling(pooling)], device="cpu", prompts=prompts,
                              max_active_dims=max_active_dims)
        model.save(str(dest))
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


MARIAN_LANGUAGES = (">>fra<<", ">>deu<<")  # Marian's multilingual convention: the target language leads the source


def build_marian(dest: Path, vocab_size: int = 200, seed: int = 0) -> Path:
    """A tiny MarianMT with one sentencepiece model per side and a shared vocab.json (CTranslate2-convertible).

    The vocab holds `</s>` first, `<unk>` second, the pieces and the language tokens, and `<pad>` last: CTranslate2's
    converter drops the last row (so padding must never be generated, as `bad_words_ids` says). Larger init_std and
    untied embeddings keep greedy outputs varied.
    """
    import tempfile

    import sentencepiece
    import torch
    import transformers

    torch.manual_seed(seed)
    dest = Path(dest)
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "corpus.txt"
        text.write_text("\n".join(load_corpus()), encoding="utf-8")
        pieces: list[str] = []
        for side in ("source", "target"):
            sentencepiece.SentencePieceTrainer.train(
                input=str(text), model_prefix=f"{tmp}/{side}", vocab_size=vocab_size, model_type="unigram",
                hard_vocab_limit=False, character_coverage=1.0, unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1,
                minloglevel=2, seed_sentencepiece_size=10000)
            processor = sentencepiece.SentencePieceProcessor(model_file=f"{tmp}/{side}.model")
            pieces += [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
        ordered = ["</s>", "<unk>", *dict.fromkeys(p for p in pieces if p not in ("<unk>", "</s>", "<pad>")),
                   *MARIAN_LANGUAGES, "<pad>"]
        vocab = Path(tmp) / "vocab.json"
        vocab.write_text(json.dumps({piece: i for i, piece in enumerate(ordered)}), encoding="utf-8")
        tokenizer = transformers.MarianTokenizer(f"{tmp}/source.model", f"{tmp}/target.model", str(vocab),
                                                 model_max_length=MAX_POSITIONS)
        tokenizer.save_pretrained(dest)
    pad = tokenizer.pad_token_id
    config = transformers.MarianConfig(
        vocab_size=len(ordered), d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=MAX_POSITIONS,
        pad_token_id=pad, eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=pad, init_std=0.05,
        tie_word_embeddings=False)
    model = transformers.MarianMTModel(config)
    model.generation_config.bad_words_ids = [[pad]]  # as in published Marian checkpoints: never generate padding
    model.save_pretrained(dest)
    return dest


def build_gpt2(dest: Path, vocab_size: int = 300, seed: int = 0) -> Path:
    """A tiny GPT-2 with a byte-level BPE tokenizer (end-of-text doubles as padding, on the left)."""
    import torch
    import transformers
    from tokenizers import ByteLevelBPETokenizer

    torch.manual_seed(seed)
    trained = ByteLevelBPETokenizer()
    trained.train_from_iterator(load_corpus(), vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                show_progress=False)
    tokenizer = transformers.GPT2TokenizerFast(tokenizer_object=trained._tokenizer, bos_token="<|endoftext|>",
                                               eos_token="<|endoftext|>", unk_token="<|endoftext|>",
                                               pad_token="<|endoftext|>", padding_side="left",
                                               model_max_length=MAX_POSITIONS)
    tokenizer.save_pretrained(dest)
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_positions=MAX_POSITIONS, n_embd=64, n_layer=2,
                                     n_head=4, initializer_range=0.2, bos_token_id=tokenizer.eos_token_id,
                                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    transformers.GPT2LMHeadModel(config).save_pretrained(dest)
    return Path(dest)


# Decoder families users embed with (last-token pooling over a causal LM's last hidden states): rotary positions.
DECODER_CONFIGS = {"llama": "LlamaConfig", "qwen3": "Qwen3Config"}


def build_decoder_embedder(dest: Path, family: str = "llama", padding_side: str = "left", vocab_size: int = 400,
                           prompts: dict[str, str] | None = None, seed: int = 0) -> Path:
    """A tiny decoder (`family`, DECODER_CONFIGS; 2 layers, 4 query heads sharing 2 key/value heads) saved as a
    sentence-transformers embedder by the library's own classes: Transformer -> last-token Pooling -> Normalize,
    with a byte-level tokenizer padding on `padding_side` (end-of-text doubles as padding) and `prompts`
    (default: an instruction before queries, none before documents, as instruction-tuned embedders ship)."""
    import tempfile

    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from tokenizers import ByteLevelBPETokenizer

    torch.manual_seed(seed)
    trained = ByteLevelBPETokenizer()
    trained.train_from_iterator(load_corpus(), vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                show_progress=False)
    end = "<|endoftext|>"
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=trained._tokenizer, bos_token=end,
                                                     eos_token=end, unk_token=end, pad_token=end,
                                                     padding_side=padding_side, model_max_length=MAX_POSITIONS)
    config = getattr(transformers, DECODER_CONFIGS[family])(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=MAX_POSITIONS, initializer_range=0.2,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.pad_token_id)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        transformers.AutoModel.from_config(config).save_pretrained(tmp)
        transformer = Transformer(tmp)
        modules = [transformer, Pooling(transformer.get_embedding_dimension(), "lasttoken"), Normalize()]
        prompts = {"query": "Instruct: find the passage that answers the question\nQuery: ", "document": ""} \
            if prompts is None else prompts
        SentenceTransformer(modules=modules, device="cpu", prompts=prompts).save(str(dest))
    return Path(dest)


TINY = {"tiny:marian": build_marian, "tiny:gpt2": build_gpt2}


def build_gemma_embedder(dest: Path, sliding_window: int = 16, truncate_dim: int | None = None,
                         vocab_size: int = 400, seed: int = 0) -> Path:
    """A tiny EmbeddingGemma: a Gemma 3 text model with bidirectional attention (use_bidirectional_attention; a
    sliding layer of `sliding_window` tokens, then a full one), saved by sentence-transformers' own classes as the
    real one ships: Transformer -> mean Pooling -> Dense (64 -> 256) -> Dense (256 -> 64), both without bias or
    activation -> Normalize, with its query and document prompts and `truncate_dim` where given (Matryoshka).
    A byte-level tokenizer trained here frames each text as `<bos> text <eos>`."""
    import tempfile

    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from tokenizers import ByteLevelBPETokenizer, processors

    torch.manual_seed(seed)
    trained = ByteLevelBPETokenizer()
    trained.train_from_iterator(load_corpus(), vocab_size=vocab_size, special_tokens=["<pad>", "<eos>", "<bos>"],
                                show_progress=False)
    trained.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", 2), ("<eos>", 1)])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=trained._tokenizer, bos_token="<bos>",
                                                     eos_token="<eos>", unk_token="<pad>", pad_token="<pad>",
                                                     padding_side="right", model_max_length=MAX_POSITIONS)
    config = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=MAX_POSITIONS,
        sliding_window=sliding_window, layer_types=["sliding_attention", "full_attention"],
        use_bidirectional_attention=True, initializer_range=0.2, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        transformers.Gemma3TextModel(config).save_pretrained(tmp)
        transformer = Transformer(tmp)
        width = transformer.get_embedding_dimension()
        modules = [transformer, Pooling(width, "mean"),
                   Dense(width, 4 * width, bias=False, activation_function=torch.nn.Identity()),
                   Dense(4 * width, width, bias=False, activation_function=torch.nn.Identity()), Normalize()]
        prompts = {"query": "task: search result | query: ", "document": "title: none | text: "}
        SentenceTransformer(modules=modules, device="cpu", prompts=prompts, truncate_dim=truncate_dim).save(str(dest))
    return Path(dest)


# The model's own module, as a user writes one: a sentence-transformers Module in a .py file of the model's folder.
SCALE_MODULE = '''import torch
from sentence_transformers.base.modules import Module


class Scale(Module):
    config_keys = ["factor"]

    def __init__(self, factor: float = 2.0):
        super().__init__()
        self.factor = factor

    def forward(self, features, **kwargs):
        features["sentence_embedding"] = {product}
        return features

    def save(self, output_path, *args, **kwargs):
        self.save_config(output_path)
'''
# Traceable: a torch operation; not: a detour through numpy, which runs in encode() and which no trace can follow.
SCALED = {True: 'features["sentence_embedding"] * self.factor',
          False: 'torch.from_numpy(features["sentence_embedding"].numpy() * self.factor)'}


def with_custom_module(source: Path, dest: Path, factor: float = 3.0, traceable: bool = True) -> Path:
    """A copy of the sentence-transformers folder `source` at `dest` with the model's own module appended to its
    modules.json: `scale_module.Scale` (in scale_module.py beside it) multiplying the sentence embedding by `factor`,
    through torch (`traceable`) or numpy."""
    import shutil

    shutil.copytree(source, dest)
    dest = Path(dest)
    (dest / "scale_module.py").write_text(SCALE_MODULE.format(product=SCALED[traceable]), encoding="utf-8")
    modules = json.loads((dest / "modules.json").read_text(encoding="utf-8"))
    modules.append({"idx": len(modules), "name": str(len(modules)), "path": "9_Scale", "type": "scale_module.Scale"})
    (dest / "modules.json").write_text(json.dumps(modules), encoding="utf-8")
    (dest / "9_Scale").mkdir()
    (dest / "9_Scale" / "config.json").write_text(json.dumps({"factor": factor}), encoding="utf-8")
    return dest

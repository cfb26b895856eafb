"""Greedy generation with transformers or CTranslate2 on token ids, shared by the workbench (in process) and the
Triton Python models (copied beside their model.py): one implementation, so served and in-process answers agree.

Conventions: `kind` is "seq2seq" (encoder-decoder, sources right-padded) or "decoder" (prompts left-padded).
A multilingual model names its target language either by a source prefix token (Marian: ">>fra<<") or by a target
prefix token (NLLB, M2M100, mBART: forced as the first generated token).
"""
import re

import numpy as np

SOURCE_PREFIX, TARGET_PREFIX = "source-prefix", "target-prefix"
_LANGUAGE_TOKEN = re.compile(r"^(>>[^<>]+<<|__[a-z]{2,3}__|[a-z]{3}_[A-Z][a-z]{3}|[a-z]{2}_[A-Z]{2})$")


class InputError(ValueError):
    """A request the model cannot serve; the message names the field and the fix."""


def language_style(tokenizer):
    """(style, codes): how this tokenizer names target languages, and the codes it knows (empty if monolingual)."""
    vocab = tokenizer.get_vocab()
    source = sorted(t for t in vocab if t.startswith(">>") and t.endswith("<<"))
    if source:
        return SOURCE_PREFIX, source
    specials = getattr(tokenizer, "additional_special_tokens", None) or []
    target = sorted(t for t in specials if _LANGUAGE_TOKEN.match(t))
    return (TARGET_PREFIX, target) if target else (None, [])


def check_language(style, codes, language):
    if not language:
        if style == TARGET_PREFIX:
            raise InputError(f"this model is multilingual: send TARGET_LANG, one of {', '.join(codes[:20])}"
                             f"{' ...' if len(codes) > 20 else ''}")
        return
    if style is None:
        raise InputError(f"TARGET_LANG {language!r} given, but this model is not multilingual: send an empty one")
    if language not in codes:
        raise InputError(f"unknown target language {language!r}: use one of {', '.join(codes[:20])}"
                         f"{' ...' if len(codes) > 20 else ''}")


def encode(tokenizer, texts, style, language, max_input_tokens):
    """Token ids per text (with the source prefix when the model uses one); empty or too long texts are refused."""
    ids = []
    for index, text in enumerate(texts):
        if not text.strip():
            raise InputError(f"TEXT[{index}] is empty: send at least one non-space character")
        tokens = tokenizer(text, add_special_tokens=True)["input_ids"]
        if style == SOURCE_PREFIX and language:
            tokens = [tokenizer.convert_tokens_to_ids(language), *tokens]
        if len(tokens) > max_input_tokens:
            raise InputError(f"TEXT[{index}] has {len(tokens)} tokens; this model takes at most {max_input_tokens}: "
                             "shorten or split it")
        ids.append(tokens)
    return ids


def check_max_new_tokens(value, limit):
    if not 1 <= value <= limit:
        raise InputError(f"MAX_NEW_TOKENS {value} is out of range: use 1 to {limit}")


def _pad(sequences, pad_id, left):
    width = max(len(s) for s in sequences)
    ids = np.full((len(sequences), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(sequences), width), dtype=np.int64)
    for row, seq in enumerate(sequences):
        span = slice(width - len(seq), width) if left else slice(0, len(seq))
        ids[row, span], mask[row, span] = seq, 1
    return ids, mask


def _until_eos(ids, eos_id):
    """Tokens up to and including the first EOS (what follows is padding of finished rows)."""
    out = []
    for token in map(int, ids):
        out.append(token)
        if token == eos_id:
            break
    return out


def hf_generate(model, tokenizer, kind, sequences, max_new_tokens, style=None, language=None):
    """Greedy transformers generate on a padded batch; returns the generated ids per sequence (up to EOS)."""
    import torch

    pad_id = tokenizer.pad_token_id
    ids, mask = _pad(sequences, pad_id, left=kind == "decoder")
    options = {"num_beams": 1, "do_sample": False, "max_new_tokens": max_new_tokens, "pad_token_id": pad_id}
    if kind == "seq2seq":
        options["forced_eos_token_id"] = None
        if style == TARGET_PREFIX:
            options["forced_bos_token_id"] = tokenizer.convert_tokens_to_ids(language)
    with torch.inference_mode():
        output = model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                                **options).numpy()
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    start = ids.shape[1] if kind == "decoder" else 1  # the prompt, or the decoder start token
    return [_until_eos(row[start:], eos) for row in output]


def ct2_generate(engine, tokenizer, kind, sequences, max_new_tokens, style=None, language=None):
    """Greedy CTranslate2 decoding (Translator or Generator) returning generated ids per sequence (up to EOS)."""
    tokens = [tokenizer.convert_ids_to_tokens(seq) for seq in sequences]
    if kind == "seq2seq":
        prefix = [[language]] * len(tokens) if style == TARGET_PREFIX else None
        results = engine.translate_batch(tokens, beam_size=1, max_decoding_length=max_new_tokens,
                                         min_decoding_length=0, return_end_token=True, target_prefix=prefix)
        hypotheses = [r.hypotheses[0] for r in results]
    else:
        results = engine.generate_batch(tokens, beam_size=1, max_length=max_new_tokens, return_end_token=True,
                                        include_prompt_in_result=False)
        hypotheses = [r.sequences[0] for r in results]
    return [tokenizer.convert_tokens_to_ids(h) for h in hypotheses]


def pack(sequences, pad_id):
    """[n, longest] int64 ids (padded with pad_id) and [n, 1] lengths."""
    ids, _ = _pad([s or [pad_id] for s in sequences], pad_id, left=False)
    lengths = np.array([[len(s)] for s in sequences], dtype=np.int64)
    return ids, lengths


def unpack(ids, lengths):
    return [list(map(int, row[:int(n)])) for row, n in zip(ids, np.asarray(lengths).reshape(-1))]

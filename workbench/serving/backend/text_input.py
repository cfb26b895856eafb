"""Decode a Triton BYTES tensor of texts, refusing invalid UTF-8 and empty texts with messages that name the text;
put the model's sentence-transformers prompt before them; tokenize them (with the pooling mask of models that pool
without the prompt). Copied beside the Python models that take text."""
import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

FIELDS = {"input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"}
CHARS_PER_TOKEN = 8  # the first guess of the characters the kept tokens of a long text span; doubled until it holds
FEW = 4  # texts `lengths` encodes one at a time
POOLING_MASK = "pooling_mask"  # the attention mask less the prompt's tokens (workbench.tasks.registry.POOLING_MASK)


class Limits:
    """What one input of a request may hold: `texts` texts (the count's setting named in the refusal) of `chars`
    characters each; None: unbounded."""

    def __init__(self, texts=None, chars=None, setting="triton.max_texts"):
        self.texts, self.chars, self.setting = texts, chars, setting

    @classmethod
    def of(cls, params):
        """The limits of a model's config parameters `max_texts` and `max_text_chars`."""
        return cls(int(params.get("max_texts", "0")) or None, int(params.get("max_text_chars", "0")) or None)


class RequestBudget:
    """The work one request may ask for, in tokens as the model runs them (each text cut at max_length): past
    `max_request_tokens` it is refused (INVALID_ARG, naming the setting), before it holds the instance any longer."""

    def __init__(self, params):
        self.limit = int(params.get("max_request_tokens", "0"))

    def refusal(self, tokens):
        """Why a request of `tokens` tokens is refused (None: it is not)."""
        if self.limit and tokens > self.limit:
            return (f"this request holds {tokens} tokens (each text counted up to the model's limit, as it runs); "
                    f"this deployment runs at most {self.limit} in one request (triton.max_request_tokens): send "
                    "fewer texts per request (Triton batches requests together), or redeploy with a larger "
                    "-p triton.max_request_tokens")
        return None


def decode(values, name="TEXT", limits=None):
    """The texts of a BYTES tensor; ValueError naming the text, or the limit and its setting, when one is not
    valid UTF-8, is empty (whitespace alone is a text), or is longer than `limits.chars`, or when there are more
    than `limits.texts`."""
    values = values.reshape(-1)
    limits = limits or Limits()
    if limits.texts and values.size > limits.texts:
        raise ValueError(f"{values.size} texts in {name}; this deployment takes at most {limits.texts} in one "
                         f"request ({limits.setting}): send them in smaller requests, or redeploy with a larger "
                         f"-p {limits.setting}")
    texts = []
    for index, value in enumerate(values):
        raw = value if isinstance(value, bytes) else str(value).encode("utf-8")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{name}[{index}] is not valid UTF-8 ({exc.reason} at byte {exc.start}): "
                             "send UTF-8 encoded text") from None
        if not text:  # whitespace alone is a text: encode() embeds it
            raise ValueError(f"{name}[{index}] is empty: send at least one character")
        if limits.chars and len(text) > limits.chars:
            raise ValueError(f"{name}[{index}] has {len(text)} characters; this deployment takes at most "
                             f"{limits.chars} in one text (triton.max_text_chars): send the part the model reads "
                             "(it truncates to its token limit), or redeploy with a larger -p triton.max_text_chars")
        texts.append(text)
    return texts


class Prompts:
    """The model's named prompts (model config parameters `prompts`, `default_prompt_name`), as encode() takes
    them: a request's `prompt` parameter is the text itself, else its `prompt_name` picks one (an empty name: none),
    else the default one applies."""

    def __init__(self, params):
        self.prompts = json.loads(params.get("prompts", "{}"))
        self.default = params.get("default_prompt_name", "")

    def apply(self, texts, parameters):
        """`texts` after the prompt the request's parameters (JSON text, as Triton passes them) ask for, and that
        prompt."""
        asked = json.loads(parameters or "{}")
        if "prompt" in asked:
            prefix = str(asked["prompt"])
        else:
            name = asked.get("prompt_name", self.default)
            if name and name not in self.prompts:
                known = ", ".join(sorted(self.prompts)) or "none"
                raise ValueError(f"unknown prompt_name {name!r}: this model's prompts are {known}")
            prefix = self.prompts.get(name, "") if name else ""
        return [prefix + text for text in texts], prefix


def pooling_mask(attention_mask, prompt_tokens):
    """The attention mask (int64 [1, length]) less its first `prompt_tokens` positions: what a model pooling
    without the prompt (include_prompt: false) pools over."""
    mask = attention_mask.copy()
    mask[:, :prompt_tokens] = 0
    return mask


class TextEncoder:
    """The model's tokenizer, truncating to `max_length`: the `tokenizers` backend the repository writer saved as
    `encoder.json` (the transformers tokenizer's own backend, padding off, its truncation side), called directly,
    so the model's process needs neither transformers nor the torch it imports (about 240 MiB a process) and
    skips the wrapper's 50 us a call; else, for a tokenizer without a backend, the transformers wrapper on
    `tokenizer/`."""

    def __init__(self, folder, max_length, names):
        self.max_length, self.names = max_length, list(names)
        self.fields = [name for name in self.names if name != POOLING_MASK]
        encoder = Path(folder) / "encoder.json"
        self.backend = Tokenizer.from_file(str(encoder)) if encoder.is_file() else None
        if self.backend is None:
            from transformers import AutoTokenizer

            self.wrapper = AutoTokenizer.from_pretrained(str(Path(folder) / "tokenizer"))
            self.special = set(self.wrapper.all_special_ids)
        else:
            self.special = {i for i, token in self.backend.get_added_tokens_decoder().items() if token.special}
        self.prompt_lengths = {"": 0}

    def prompt_tokens(self, prompt):
        """The prompt's tokens as sentence-transformers counts them: tokenized alone, less a trailing special one."""
        if prompt not in self.prompt_lengths:
            ids = (self.backend.encode(prompt).ids if self.backend is not None else
                   self.wrapper(prompt, truncation=True, max_length=self.max_length)["input_ids"])
            self.prompt_lengths[prompt] = len(ids) - (1 if ids and ids[-1] in self.special else 0)
        return self.prompt_lengths[prompt]

    def kept(self, text):
        """`text` (or each side of a pair) cut to a prefix that gives the same tokens, so a text far past the model's
        limit costs no more to tokenize than the part the model reads: the shortest of max_length x CHARS_PER_TOKEN
        characters (doubled) whose tokens already pass max_length and end before a whitespace inside the prefix (the
        words before it tokenize as in the whole text). A text of one unbroken word, or a tokenizer that keeps a
        text's end, is left whole."""
        if isinstance(text, tuple):
            return tuple(self.kept(side) for side in text)
        truncation = self.backend.truncation
        size = self.max_length * CHARS_PER_TOKEN
        while truncation and truncation.get("direction", "right") == "right" and size < len(text):
            encoding = self.backend.encode(text[:size])
            end = max((stop for _, stop in encoding.offsets), default=0)
            if encoding.overflowing and any(char.isspace() for char in text[end:size]):
                return text[:size]
            size *= 2
        return text

    def lengths(self, texts):
        """Each text's (or pair's) token count as the model runs it (cut at max_length), without its tensors; a few
        texts one at a time (the batch call's thread pool costs more than it saves for them)."""
        if self.backend is None:
            return [part["input_ids"].shape[1] for part in self.encode(texts)[0]]
        kept = [self.kept(text) for text in texts]
        encodings = [self.backend.encode(*([t] if isinstance(t, str) else t)) for t in kept] if len(kept) <= FEW \
            else self.backend.encode_batch(kept)
        return [len(e.ids) for e in encodings]

    def encode(self, texts, prompts=None):
        """Per text, or per (query, document) pair (truncated longest first), {input name: int64 [1, length]} (a
        pooling mask without the first tokens of the text's prompt in `prompts`, where the model takes one); and per
        text, whether it was truncated."""
        if self.backend is None:
            split = [list(part) for part in zip(*texts)] if texts and isinstance(texts[0], tuple) else [texts]
            encoded = self.wrapper(*split, truncation=True, max_length=self.max_length)
            rows = [{name: encoded[name][i] for name in self.fields} for i in range(len(texts))]
            flags = [len(ids) > self.max_length for ids in self.wrapper(*split)["input_ids"]]
        else:
            encodings = self.backend.encode_batch([self.kept(text) for text in texts])
            rows = [{name: getattr(e, FIELDS[name]) for name in self.fields} for e in encodings]
            flags = [bool(e.overflowing) for e in encodings]
        parts = [{name: np.asarray([row[name]], dtype=np.int64) for name in self.fields} for row in rows]
        if POOLING_MASK in self.names:
            for part, prompt in zip(parts, prompts or [""] * len(parts)):
                part[POOLING_MASK] = pooling_mask(part["attention_mask"], self.prompt_tokens(prompt))
        return parts, flags

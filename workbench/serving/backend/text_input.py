"""Decode a Triton BYTES tensor of texts, refusing invalid UTF-8 and empty texts with messages that name the text;
put the model's sentence-transformers prompt before them; tokenize them. Copied beside the Python models that take
text."""
import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

FIELDS = {"input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"}


def decode(values):
    texts = []
    for index, value in enumerate(values.reshape(-1)):
        raw = value if isinstance(value, bytes) else str(value).encode("utf-8")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"TEXT[{index}] is not valid UTF-8 ({exc.reason} at byte {exc.start}): "
                             "send UTF-8 encoded text") from None
        if not text.strip():
            raise ValueError(f"TEXT[{index}] is empty: send at least one non-space character")
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
        """`texts` after the prompt the request's parameters (JSON text, as Triton passes them) ask for."""
        asked = json.loads(parameters or "{}")
        if "prompt" in asked:
            return [str(asked["prompt"]) + text for text in texts]
        name = asked.get("prompt_name", self.default)
        if name and name not in self.prompts:
            known = ", ".join(sorted(self.prompts)) or "none"
            raise ValueError(f"unknown prompt_name {name!r}: this model's prompts are {known}")
        prefix = self.prompts.get(name, "") if name else ""
        return [prefix + text for text in texts]


class TextEncoder:
    """The model's tokenizer, truncating to `max_length`: the `tokenizers` backend the repository writer saved as
    `encoder.json` (the transformers tokenizer's own backend, padding off, its truncation side), called directly,
    so the model's process needs neither transformers nor the torch it imports (about 240 MiB a process) and
    skips the wrapper's 50 us a call; else, for a tokenizer without a backend, the transformers wrapper on
    `tokenizer/`."""

    def __init__(self, folder, max_length, names):
        self.max_length, self.names = max_length, list(names)
        encoder = Path(folder) / "encoder.json"
        self.backend = Tokenizer.from_file(str(encoder)) if encoder.is_file() else None
        if self.backend is None:
            from transformers import AutoTokenizer

            self.wrapper = AutoTokenizer.from_pretrained(str(Path(folder) / "tokenizer"))

    def encode(self, texts):
        """Per text, {input name: int64 [1, length]}; and per text, whether it was truncated."""
        if self.backend is None:
            encoded = self.wrapper(texts, truncation=True, max_length=self.max_length)
            rows = [{name: encoded[name][i] for name in self.names} for i in range(len(texts))]
            flags = [len(self.wrapper(text)["input_ids"]) > self.max_length for text in texts]
        else:
            encodings = self.backend.encode_batch(texts)
            rows = [{name: getattr(e, FIELDS[name]) for name in self.names} for e in encodings]
            flags = [bool(e.overflowing) for e in encodings]
        return [{name: np.asarray([row[name]], dtype=np.int64) for name in self.names} for row in rows], flags

"""Decode a Triton BYTES tensor of texts, refusing invalid UTF-8 and empty texts with messages that name the text;
put the model's sentence-transformers prompt before them; tokenize them. Copied beside the Python models that take
text."""
import json

import numpy as np
from tokenizers import Tokenizer
from transformers import AutoTokenizer

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
    """The model's tokenizer, truncating to `max_length`: its `tokenizers` backend called directly where it has one
    (a fast tokenizer; the transformers wrapper costs about 50 us a call on top), else the wrapper itself."""

    def __init__(self, folder, max_length, names):
        self.wrapper = AutoTokenizer.from_pretrained(str(folder))
        self.max_length, self.names = max_length, list(names)
        backend = getattr(self.wrapper, "backend_tokenizer", None)
        self.backend = Tokenizer.from_str(backend.to_str()) if backend is not None else None  # our own copy
        if self.backend is not None:
            self.backend.no_padding()
            self.backend.enable_truncation(max_length, direction=self.wrapper.truncation_side)

    def encode(self, texts):
        """Per text, {input name: int64 [1, length]}; and per text, whether it was truncated."""
        if self.backend is None:
            encoded = self.wrapper(texts, truncation=True, max_length=self.max_length)
            rows = [{name: encoded[name][i] for name in self.names} for i in range(len(texts))]
            flags = [bool(e.overflowing) for e in encoded.encodings] if encoded.encodings else [
                len(self.wrapper(text)["input_ids"]) > self.max_length for text in texts]
        else:
            encodings = self.backend.encode_batch(texts)
            rows = [{name: getattr(e, FIELDS[name]) for name in self.names} for e in encodings]
            flags = [bool(e.overflowing) for e in encodings]
        return [{name: np.asarray([row[name]], dtype=np.int64) for name in self.names} for row in rows], flags

"""Decode a Triton BYTES tensor of texts, refusing invalid UTF-8 and empty texts with messages that name the text;
put the model's sentence-transformers prompt before them. Copied beside the Python models that take text."""
import json


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

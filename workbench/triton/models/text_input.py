"""Decode a Triton BYTES tensor of texts, refusing invalid UTF-8 and empty texts with messages that name the text.
Copied beside the Python models that take text."""


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

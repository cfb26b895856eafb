"""What a model reads: a text, or a (query, document) pair a cross-encoder reads together, tokenized as its
library tokenizes it and encoded as the graph's inputs."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from workbench.tasks.registry import POOLING_MASK

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase as Tokenizer

# One input: a text, or a (query, document) pair a cross-encoder reads together.
Text = str | tuple[str, str]


def tokenize(tokenizer: Tokenizer, texts: Sequence[Text], **options: Any) -> Any:
    """The tokenizer's encoding of `texts`; pairs go in as its text and text_pair (truncated longest first, as
    CrossEncoder.predict() tokenizes them)."""
    if texts and isinstance(texts[0], tuple):
        return tokenizer([text[0] for text in texts], [text[1] for text in texts], **options)
    return tokenizer(list(texts), **options)


def shown(text: Text) -> str:
    """A text as a line of a report: a pair's query and document on either side of ' || '."""
    return text if isinstance(text, str) else f"{text[0]} || {text[1]}"


def encode(tokenizer: Tokenizer, texts: Sequence[Text], input_names: tuple[str, ...], max_length: int | None = None,
           pad_to: int | None = None, prompt_tokens: int = 0) -> dict[str, np.ndarray]:
    """Right-padded int64 arrays for `input_names`; `pad_to` pads every row to that length. A pooling mask (graph
    input of models pooling without the prompt) is the attention mask less each row's first `prompt_tokens`."""
    limit = pad_to or max_length
    enc = tokenize(tokenizer, texts, padding="max_length" if pad_to else True, truncation=limit is not None,
                   max_length=limit, return_tensors="np")
    feed = {name: np.ascontiguousarray(enc[name], dtype=np.int64) for name in input_names if name != POOLING_MASK}
    if POOLING_MASK in input_names:
        feed[POOLING_MASK] = feed["attention_mask"].copy()
        feed[POOLING_MASK][:, :prompt_tokens] = 0
    return {name: feed[name] for name in input_names}

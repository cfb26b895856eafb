"""Classification logits to label names and scores, the head applied as transformers' text-classification pipeline
applies it (`function_to_apply`): softmax, sigmoid (multi-label) or none (regression). Copied beside the Python
models that label."""
import numpy as np

THRESHOLD = 0.5  # a sigmoid head gives every label whose score is above it


def label_and_score(logits, labels, activation):
    """BYTES labels and float32 scores. softmax: the best label and its probability, [batch, 1] for one label per
    text or [batch, tokens] per token; sigmoid and none: every label's score, [batch, labels], and beside it the
    label's name where it is given (sigmoid: its score above THRESHOLD; none: always), "" where not."""
    logits = logits.astype(np.float64)
    if activation != "softmax":
        return every_label(logits, labels, activation)
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probabilities = shifted / shifted.sum(axis=-1, keepdims=True)
    label = labels[probabilities.argmax(axis=-1)].astype(object)
    score = probabilities.max(axis=-1).astype(np.float32)
    if logits.ndim == 2:  # one label per text: [batch, 1]
        label, score = label[:, None], score[:, None]
    return utf8(label), score


def every_label(logits, labels, activation):
    """Every label's score (sigmoid, or the raw logit for none) and the names of the labels given, in label order."""
    if activation == "sigmoid":
        with np.errstate(over="ignore"):  # exp(-x) of a very negative logit: inf, its score 0
            scores = 1.0 / (1.0 + np.exp(-logits))
        given = scores > THRESHOLD
    else:
        scores, given = logits, np.ones(logits.shape, dtype=bool)
    return utf8(np.where(given, labels, "").astype(object)), scores.astype(np.float32)


def utf8(names):
    """Label names as Triton's BYTES elements."""
    return np.vectorize(lambda s: s.encode("utf-8"), otypes=[object])(names)


def label_names(id2label):
    """The label names in id order, from the model config's id2label (JSON keys are strings)."""
    return np.array([id2label[str(i)] for i in range(len(id2label))], dtype=object)

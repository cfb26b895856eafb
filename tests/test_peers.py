"""benchmarks/peers.py: its table, its refusal when the peer is not installed (the load path itself is tested on a
real server in test_triton.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from workbench.measure.load import LevelResult
from workbench.measure.peers import PeerNotInstalledError, PeerRow, accuracy, find_infinity, lead, table

ROOT = Path(__file__).resolve().parents[1]


def level(concurrency: int, throughput: float, p50: float, p99: float) -> LevelResult:
    return LevelResult(concurrency, 1000, 0, 1000 / throughput, throughput, p50, p50, p99, p99, p50)


def test_the_table_gives_medians_the_range_over_repeats_and_accuracy():
    ours = PeerRow("workbench Triton int8_repaired", "int8_repaired",
                   {1: [level(1, 210, 3.8, 15), level(1, 230, 3.6, 14), level(1, 216, 3.7, 16)]},
                   {"min_cosine": 0.9913, "mean_cosine": 0.9987, "same_neighbour": 308, "texts": 320}, 560 * 2**20)
    theirs = PeerRow("infinity-emb int8", "int8", {1: [level(1, 96, 9.7, 20), level(1, 90, 9.9, 22),
                                                       level(1, 100, 9.5, 21)]})
    text = table([ours, theirs], [1, 4])
    lines = text.splitlines()
    assert lines[0] == ("| server | precision | c=1 | c=4 | min / mean cosine | same neighbour | RSS MiB |")
    assert lines[2] == ("| workbench Triton int8_repaired | int8_repaired | 216 (210-230) / 3.7 / 15 | - | "
                        "0.9913 / 0.9987 | 308 of 320 | 560 |")
    assert lines[3] == "| infinity-emb int8 | int8 | 96 (90-100) / 9.7 / 21 | - | - | - | - |"
    assert lead(ours, theirs, [1, 4]) == pytest.approx({1: 216 / 96})


def test_accuracy_counts_texts_that_keep_their_nearest_neighbour():
    rng = np.random.default_rng(0)
    want = rng.normal(size=(40, 8))
    same = accuracy(want * 3.0, want)  # a scale changes no direction
    assert same["min_cosine"] == pytest.approx(1.0) and same["same_neighbour"] == 40
    noisy = accuracy(want + rng.normal(scale=0.5, size=want.shape), want)
    assert noisy["min_cosine"] < 0.99 and noisy["same_neighbour"] < 40


def test_a_missing_peer_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(PeerNotInstalledError, match="infinity-emb is not installed") as refused:
        find_infinity(tmp_path / "none")
    assert "--install" in refused.value.fix
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--peer-venv",
                           str(tmp_path / "none"), "--run", str(run)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2
    assert "PeerNotInstalledError" in done.stderr and "python benchmarks/peers.py --install" in done.stderr
    assert not run.exists() and not (ROOT / "outputs" / "peers").exists()


@pytest.mark.parametrize(("arguments", "message"), [(["--levels", "a"], "is not a list of whole numbers"),
                                                    (["--repeats", "0"], "--repeats must be positive")])
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, arguments, message):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--run", str(tmp_path / "run"),
                           *arguments], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2 and "ConfigError" in done.stderr and message in done.stderr
    assert list(tmp_path.iterdir()) == []

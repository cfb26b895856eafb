"""benchmarks/peers.py: its table, its refusal when the peer is not installed (the load path itself is tested on a
real server in test_triton.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from peerlib.peers import (
    PeerBuildError,
    PeerNotInstalledError,
    PeerRow,
    accuracy,
    build_optimum,
    find_infinity,
    lead,
    require_built,
    table,
)

from workbench.measure.tables import ServedLevel

ROOT = Path(__file__).resolve().parents[1]


def level(concurrency: int, throughput: float, p50: float, p99: float) -> ServedLevel:
    return ServedLevel(concurrency=concurrency, requests=1000, errors=0, seconds=1000 / throughput,
                       throughput=throughput, p50=p50, p90=p50, p95=p99, p99=p99, mean=p50)


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


def test_a_graph_optimum_fails_on_is_a_row_that_says_why(tmp_path, monkeypatch):
    """Optimum's O2 export crashes on some families (ELECTRA-base, in ONNX Runtime's optimizer): that variant and the
    int8 built from it say why, the others are built, and the status is kept for the next run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("peer_optimum", ROOT / "benchmarks" / "peer_optimum.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def export(model_dir, dest, options, task):
        dest.mkdir(parents=True)
        if options:
            raise RuntimeError("optimum-cli export onnx --optimize O2 failed (exit 1): INVALID_PROTOBUF")
        (dest / "model.onnx").write_bytes(b"graph")

    monkeypatch.setattr(script, "export", export)
    work = tmp_path / "optimum"
    script.main("model", str(work), "avx2", "plain", "fp32", "int8")
    status = build_optimum(Path(sys.executable), tmp_path / "not-run.py", "model", work, "avx2",
                           ["plain", "fp32", "int8"])
    assert status == {"plain": {"path": str(work / "plain" / "model.onnx")},
                      "fp32": {"problem": "RuntimeError: optimum-cli export onnx --optimize O2 failed (exit 1): "
                                          "INVALID_PROTOBUF"},
                      "int8": {"problem": "needs Optimum's O2 graph, not built: RuntimeError: optimum-cli export onnx "
                                          "--optimize O2 failed (exit 1): INVALID_PROTOBUF"}}
    assert sorted(p.name for p in work.iterdir()) == ["plain", "status.json"], "no half-built folder"
    with pytest.raises(PeerBuildError, match=r"Optimum could not build fp32 \(RuntimeError: .*\), int8"):
        require_built(status, work / "build.log")
    with pytest.raises(PeerNotInstalledError, match="Optimum's build script failed"):
        build_optimum(Path(sys.executable), tmp_path / "not-run.py", "model", work, "avx2", ["O3"])


def test_a_peer_environment_given_relative_is_found_from_any_folder(tmp_path, monkeypatch):
    command = tmp_path / "peer" / "bin" / "infinity_emb"
    command.parent.mkdir(parents=True)
    command.write_text("")
    monkeypatch.chdir(tmp_path)
    assert find_infinity(Path("peer")) == command  # the servers start in their own folders

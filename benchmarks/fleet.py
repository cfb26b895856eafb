"""What a cell costs on a Ray cluster over the same run on this machine without Ray, measured side by side here.

    .venv/bin/python benchmarks/fleet.py [--rounds N] [--out DIR] [--models tiny|minilm]

Two models (tiny BERT and tiny RoBERTa built here, or the embedded MiniLM twice with two sequence limits) with the
settings below: each round runs them as `workbench run` here (what a local sweep runs per run) and as one sweep on
a one-node local cluster (`workbench node start --kind`, one cell at a time, so no cell shares the cores with
another), alternating which goes first. Per cell: the local wall seconds, the cluster's (from placing the cell to
its folder checked and in place) and the run's own seconds on the node; printed as the cluster's overhead per cell
(target <= 10%), never asserted. Writes DIR/fleet.json; exits 0.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from workbench.core.config import DEFAULT_MODEL
from workbench.core.machine import cpu_model
from workbench.fleet.local import LocalCluster
from workbench.interrupt import script_exit
from workbench.models.tiny import build_encoder
from workbench.runners.timing import others_busy

SETTINGS = {"steps": ["export", "optimize", "parity", "bench"], "precisions": ["fp32"], "parity": {"repair": False},
            "corpus_max_texts": 32, "optimize": {"openvino": "never"},
            "bench": {"served": False, "batches": [1], "sequences": [16], "rounds": 3, "warmup": 0,
                      "tune_sessions": False, "long_texts": False, "seconds_per_cell": 5}}
KIND = "avx2"  # what the one node is told: the cells run on this CPU whatever it is called


def models(which: str, folder: Path) -> dict[str, tuple[str, dict[str, object]]]:
    if which == "minilm":
        return {"minilm-128": (DEFAULT_MODEL, {"sequence": {"max": 128}}),
                "minilm-256": (DEFAULT_MODEL, {"sequence": {"max": 256}})}
    return {"bert": (str(build_encoder(folder / "bert", "bert")), {}),
            "roberta": (str(build_encoder(folder / "roberta", "roberta")), {})}


def local_round(runs: dict[str, tuple[str, dict[str, object]]], root: Path) -> dict[str, float]:
    """Each run as `workbench run` in a child process, timed from start to exit."""
    seconds = {}
    for name, (model, own) in runs.items():
        config = root / f"{name}.yaml"
        config.write_text(yaml.safe_dump({**SETTINGS, **own, "model": model}))
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "workbench", "run", "--config", str(config), "--output-dir",
                        str(root / name), "--quiet"], check=True, capture_output=True)
        seconds[name] = time.perf_counter() - started
    return seconds


def cluster_round(runs: dict[str, tuple[str, dict[str, object]]], root: Path,
                  address: str) -> dict[str, dict[str, float]]:
    """The same runs as one sweep on the cluster: each cell's seconds on the driver and on the node."""
    spec = {"output_root": "runs", "settings": SETTINGS, "ray": {"kinds": [KIND]},
            "runs": [{"name": name, "model": model, "settings": own} for name, (model, own) in runs.items()]}
    path = root / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    subprocess.run([sys.executable, "-m", "workbench", "sweep", str(path), "--ray", address], check=True,
                   capture_output=True)
    cells = json.loads((root / "runs" / "sweep.json").read_text())["cells"]
    return {c["run"]: {"cell": c["seconds"], "run": c["run_seconds"]} for c in cells}


def measure(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    runs = models(args.models, work)
    busy = others_busy()
    print(f"host: {cpu_model()}; other processes busy: {busy:.1f} cores; {len(runs)} runs x {args.rounds} rounds")
    local: dict[str, list[float]] = {name: [] for name in runs}
    cell: dict[str, list[float]] = {name: [] for name in runs}
    on_node: dict[str, list[float]] = {name: [] for name in runs}
    with LocalCluster([KIND], cpus=2) as cluster:
        for number in range(args.rounds):
            order = ("local", "cluster") if number % 2 == 0 else ("cluster", "local")
            for way in order:
                root = work / f"round{number}-{way}"
                root.mkdir()
                if way == "local":
                    for name, seconds in local_round(runs, root).items():
                        local[name].append(seconds)
                else:
                    for name, timed in cluster_round(runs, root, cluster.address).items():
                        cell[name].append(timed["cell"])
                        on_node[name].append(timed["run"])
            print(f"round {number + 1}: " + "; ".join(
                f"{name} local {local[name][-1]:.1f} s, cell {cell[name][-1]:.1f} s (run {on_node[name][-1]:.1f} s)"
                for name in runs), flush=True)
    results = {}
    for name in runs:
        here, there, alone = (statistics.median(v) for v in (local[name], cell[name], on_node[name]))
        results[name] = {"local_s": local[name], "cell_s": cell[name], "run_on_node_s": on_node[name],
                         "overhead": there / here - 1, "transfer_s": there - alone}
        mark = "PASS" if there / here - 1 <= 0.10 else "MISS"
        print(f"{name}: median local {here:.1f} s, on the cluster {there:.1f} s per cell ({there / here - 1:+.1%}; "
              f"{mark} target +10%), of which placing and bringing the folder back {there - alone:.1f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    written = args.out / "fleet.json"
    written.write_text(json.dumps({"host": cpu_model(), "others_busy": busy, "results": results}, indent=1))
    print(f"written: {written}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", choices=("tiny", "minilm"), default="tiny")
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmarks/fleet"))
    args = parser.parse_args()
    return script_exit(lambda: measure(args), "fleet.json not written; the cluster was stopped")


if __name__ == "__main__":
    sys.exit(main())

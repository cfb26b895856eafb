"""A fleet on a real Ray cluster of this machine: nodes told their host kind (`workbench node start --kind`), a
sweep of two tiny models on two kinds, each cell placed on its kind's node and brought back whole, the fleet table;
a node killed by PID mid-cell (its cell moves to another node of its kind, then, with none left, fails naming it);
Ctrl-C of the driver; a kind no node offers. The kinds themselves from faked CPU flags; the run folder's transfer;
the KubeRay manifests against KubeRay's CRD schemas."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from workbench.core.errors import ConfigError, OutputDirError
from workbench.core.record import RunRecord
from workbench.core.results import CpuFeatures
from workbench.fleet.errors import ClusterError, TransferError
from workbench.fleet.kuberay import manifests
from workbench.fleet.local import LocalCluster
from workbench.fleet.node import plan_start
from workbench.fleet.transfer import install, pack
from workbench.models.tiny import build_encoder
from workbench.report.compare import compare, write_compare
from workbench.serving.hostkinds import KINDS, host_kind, kind_of, node_resources
from workbench.sweep import load_sweep

from .test_deploy import validate

pytestmark = pytest.mark.slow
QUICK = {"steps": ["export", "optimize", "parity", "bench"], "precisions": ["fp32"], "parity": {"repair": False},
         "corpus_max_texts": 32, "optimize": {"openvino": "never"},
         "bench": {"served": False, "batches": [1], "sequences": [16], "rounds": 3, "warmup": 0,
                   "tune_sessions": False, "long_texts": False, "seconds_per_cell": 5}}
ZEN4 = ["avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16"]
SAPPHIRE_RAPIDS = [*ZEN4, "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16"]


def test_a_host_kind_comes_from_the_flags_the_record_holds():
    """Faked flags of each kind of host seen so far: the kind, and what the node advertises to Ray."""
    def kind(flags: list[str], gpu: str | None = None) -> str:
        return kind_of(CpuFeatures(flags=flags), gpu).name

    assert kind(SAPPHIRE_RAPIDS) == "amx"
    assert kind(ZEN4) == "avx512_bf16"
    assert kind(["avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"]) == "avx512_vnni"
    assert kind(["avx2", "fma", "avx_vnni"]) == "avx_vnni"
    assert kind(["avx2", "fma"]) == "avx2"
    assert kind(["avx2"], "NVIDIA H200") == "gpu"
    with pytest.raises(ConfigError, match="--kind"):
        kind(["sse4_2"])
    assert node_resources(host_kind("amx"), CpuFeatures(flags=SAPPHIRE_RAPIDS)) == {
        "host-kind:amx": 1.0, "cpu:avx512_vnni": 1.0, "cpu:avx_vnni": 1.0, "cpu:avx512_bf16": 1.0,
        "cpu:avx512_fp16": 1.0, "cpu:amx_int8": 1.0, "cpu:amx_bf16": 1.0}
    start = plan_start("127.0.0.1:6379", kind="amx", num_cpus=1)
    assert start.told and start.argv[1:3] == ["start", "--block"]
    advertised = json.loads(next(a for a in start.argv if a.startswith("--resources=")).split("=", 1)[1])
    assert advertised["host-kind:amx"] == 1.0 and "--address=127.0.0.1:6379" in start.argv
    with pytest.raises(ConfigError, match="not a host kind"):
        host_kind("zen4")
    # each kind's pods stay off the nodes of the kinds above it
    avx2 = host_kind("avx2").affinity()["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    absent = {e["key"] for e in avx2["nodeSelectorTerms"][0]["matchExpressions"]}
    assert absent == {kind.label for kind in KINDS[:-1]}


def test_a_run_folder_arrives_whole_or_not_at_all(tmp_path):
    run = tmp_path / "node" / "cell"
    (run / "onnx").mkdir(parents=True)
    (run / "run.json").write_text('{"a": 1}')
    (run / "onnx" / "model.onnx").write_bytes(bytes(range(256)) * 100)
    packed = pack(run)
    landed = install(packed, tmp_path / "root" / "cell")
    assert (landed / "onnx" / "model.onnx").read_bytes() == (run / "onnx" / "model.onnx").read_bytes()
    assert sorted(packed.files) == ["onnx/model.onnx", "run.json"]
    with pytest.raises(OutputDirError, match="exists"):
        install(packed, landed)
    damaged = bytearray(packed.data)
    damaged[len(damaged) // 2] ^= 1
    with pytest.raises(TransferError, match="damaged"):
        install(type(packed)(bytes(damaged), packed.files, packed.sha256), tmp_path / "root" / "other")
    lying = type(packed)(packed.data, {**packed.files, "run.json": "0" * 64}, packed.sha256)
    with pytest.raises(TransferError, match="run.json differs"):
        install(lying, tmp_path / "root" / "other")
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == ["cell"], "nothing partial, nothing staged"


def _sweep_file(folder: Path, models: dict[str, Path], kinds: list[str], **ray: object) -> Path:
    spec = {"output_root": "runs", "settings": QUICK,
            "runs": [{"name": name, "model": str(path)} for name, path in models.items()],
            "ray": {"kinds": kinds, **ray},
            "kubernetes": {"image": "registry.example/workbench:1", "claim": "runs"}}
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_a_misspelt_kind_or_key_names_the_file_and_what_it_takes(tmp_path):
    path = _sweep_file(tmp_path, {"tiny": tmp_path}, ["amxx", "avx2"], adress="127.0.0.1:6379")
    with pytest.raises(ConfigError) as refused:
        load_sweep(path)
    assert str(path) in refused.value.problem
    assert "ray.kinds: 'amxx' is not a host kind (did you mean 'amx'?)" in refused.value.problem
    assert "ray.adress: unknown key (its section takes address, kinds, retries)" in refused.value.problem


def test_the_kuberay_manifests_pass_kuberay_s_crd_schemas(tmp_path):
    sweep = load_sweep(_sweep_file(tmp_path, {"tiny": tmp_path}, ["amx", "avx2", "gpu"]))
    documents = manifests(sweep)
    assert [validate(d) for d in documents] == ["1.37", "ray.io/v1", "ray.io/v1"]
    _, cluster, job = documents
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert groups["amx"]["resources"] == {"host-kind:amx": "1"}
    assert groups["amx"]["template"]["spec"]["nodeSelector"] == {"feature.node.kubernetes.io/cpu-cpuid.AMXINT8": "true"}
    limits = {name: g["template"]["spec"]["containers"][0]["resources"]["limits"] for name, g in groups.items()}
    assert "nvidia.com/gpu" in limits["gpu"] and "nvidia.com/gpu" not in limits["amx"]
    assert cluster["spec"]["rayVersion"] == "2.60.0"
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert job["spec"]["entrypoint"] == "workbench sweep /sweep/sweep.yaml --ray auto --output-root /runs"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fleet-models")
    return {"bert": build_encoder(root / "bert", "bert"), "roberta": build_encoder(root / "roberta", "roberta")}


@pytest.fixture(scope="module")
def cluster():
    """A head told it is an AVX2 host and a node told it is an AMX one, one CPU each; every process stopped after."""
    with LocalCluster(["avx2", "amx"]) as running:
        pids = [p.pid for node in running.nodes for p in psutil.Process(node.pid).children(recursive=True)]
        yield running
    time.sleep(1)
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def _workbench(*args: str) -> list[str]:
    return [sys.executable, "-m", "workbench", *args]


def _cell_processes(cluster: LocalCluster) -> list[str]:
    """Processes a cell started on this machine's nodes that are still there (runs, kernels, servers)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        line = " ".join(process.info["cmdline"] or [])
        if str(cluster.folder) in line and ("workbench-cell-" in line or "kernel" in line):
            found.append(line)
    return found


def test_a_sweep_of_two_models_on_two_host_kinds(cluster, models, tmp_path):
    """Each cell placed on the node of its kind, its folder back whole, run.json naming the node; the fleet table
    per kind and model; the sweep again keeps every finished cell."""
    path = _sweep_file(tmp_path, models, ["avx2", "amx"])
    done = subprocess.run(_workbench("sweep", str(path), "--ray", cluster.address), capture_output=True, text=True,
                          timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ids = {"avx2": cluster.node_id(0), "amx": cluster.node_id(1)}
    for model in models:
        for kind, node_id in ids.items():
            record = RunRecord.load(tmp_path / "runs" / f"{model}-{kind.replace('_', '-')}")
            node = record.environment.node
            assert node is not None and (node.kind, node.id, node.told) == (kind, node_id, True)
            assert record.environment.cpu_features is not None and record.environment.cpu_features.flags
            assert record.config.output_dir == str(record.run_dir)
    cells = json.loads((tmp_path / "runs" / "sweep.json").read_text())["cells"]
    assert [(c["name"], c["status"], c["attempts"]) for c in cells] == [
        ("bert-avx2", "done", 1), ("bert-amx", "done", 1), ("roberta-avx2", "done", 1), ("roberta-amx", "done", 1)]
    assert all(c["seconds"] >= c["run_seconds"] > 0 for c in cells)
    assert not list((tmp_path / "runs").glob(".incoming-*"))
    compared = compare(sorted((tmp_path / "runs").glob("*/")))
    assert {(row.kind, Path(row.model).name) for row in compared.fleet} == {
        (kind, model) for kind in ids for model in models}
    for row in compared.fleet:
        assert row.variant == "fp32" and row.speedup and row.speedup > 0 and row.margin is not None, row
    page = write_compare(compared, tmp_path / "compare")["html"].read_text()
    assert "The fleet" in page and "host kind amx (told)" in page
    again = subprocess.run(_workbench("sweep", str(path), "--ray", cluster.address), capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0 and again.stdout.count(": done (") == 4, again.stdout


def test_a_kind_no_node_offers_is_reported_at_once(cluster, models, tmp_path):
    path = _sweep_file(tmp_path, {"bert": models["bert"]}, ["avx512_vnni"])
    done = subprocess.run(_workbench("sweep", str(path), "--ray", cluster.address), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1
    assert "bert-avx512-vnni: failed: no live node of the cluster offers host kind 'avx512_vnni' (offered: amx, avx2)" \
        in done.stdout
    assert not (tmp_path / "runs" / "bert-avx512-vnni").exists()


def test_an_unreachable_cluster_is_a_typed_error(models, tmp_path):
    path = _sweep_file(tmp_path, {"bert": models["bert"]}, ["avx2"])
    done = subprocess.run(_workbench("sweep", str(path), "--ray", "127.0.0.1:9"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and ClusterError.__name__ in done.stderr and "cannot reach" in done.stderr


def _until(process: subprocess.Popen[str], pattern: str, seen: list[str]) -> re.Match[str]:
    """Read the sweep's lines until one matches `pattern`."""
    assert process.stdout is not None
    for line in process.stdout:
        seen.append(line)
        found = re.search(pattern, line)
        if found:
            return found
    raise AssertionError("".join(seen[-50:]))


def test_ctrl_c_of_the_driver_cancels_every_cell(cluster, models, tmp_path):
    path = _sweep_file(tmp_path, {"bert": models["bert"]}, ["avx2", "amx"])
    sweep = subprocess.Popen(_workbench("sweep", str(path), "--ray", cluster.address), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    _until(sweep, r"bert-amx: \[1/\d\] export", seen)  # both cells' runs are under way
    sweep.send_signal(signal.SIGINT)
    rest = sweep.communicate(timeout=300)[0]
    assert sweep.returncode == 130, "".join(seen[-20:]) + rest
    assert "were cancelled" in rest and f"--ray {cluster.address}`) runs what is left" in rest
    # the cell inside its export step was told to stop, and stopped, before the driver exited (the other may still
    # have been in its preflight, which stops without that line); neither left a process or a folder (below)
    assert re.search(r"bert-amx: stopped \(RunInterruptedError\).*SIGTERM", "".join(seen) + rest), rest
    assert not list(cluster.folder.glob("workbench-cell-*")), "the nodes' folders of the cells are gone"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["sweep.json"]
    cells = json.loads((tmp_path / "runs" / "sweep.json").read_text())["cells"]
    assert {c["status"] for c in cells} == {"failed"} and {c["error"] for c in cells} == {"interrupted"}
    deadline = time.monotonic() + 60
    while _cell_processes(cluster) and time.monotonic() < deadline:
        time.sleep(1)
    assert not _cell_processes(cluster)


def test_a_node_lost_mid_cell(models, tmp_path):
    """Two AMX nodes: the one measuring is killed (its raylet, by PID) and the cell is measured again on the other;
    then that one is killed too, and with no AMX node left the cell fails naming it. The AVX2 cell finishes."""
    with LocalCluster(["avx2", "amx", "amx"]) as running:
        path = _sweep_file(tmp_path, {"bert": models["bert"]}, ["amx", "avx2"], retries=2)
        sweep = subprocess.Popen(_workbench("sweep", str(path), "--ray", running.address), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        seen: list[str] = []
        first = _until(sweep, r"bert-amx: placed on node (\w+)", seen).group(1)
        _until(sweep, r"bert-amx: \[1/\d\] export", seen)
        index = next(i for i in (1, 2) if running.node_id(i).startswith(first))
        running.raylet(index).kill()
        second = _until(sweep, r"bert-amx: placed on node (\w+)", seen).group(1)
        assert second != first
        _until(sweep, r"bert-amx: \[1/\d\] export", seen)
        running.raylet(3 - index).kill()
        rest = sweep.communicate(timeout=900)[0]
        output = "".join(seen) + rest
        assert sweep.returncode == 1, output
        assert f"node {first} (" in output and f"node {second} (" in output
        assert f"bert-amx: failed: its node {first}" in output and "no other node offers host kind 'amx'" in output
        runs = tmp_path / "runs"
        assert sorted(p.name for p in runs.iterdir()) == ["bert-avx2", "sweep.json"], "nothing partial"
        cells = {c["name"]: c for c in json.loads((runs / "sweep.json").read_text())["cells"]}
        assert cells["bert-amx"]["attempts"] == 2 and len(cells["bert-amx"]["lost_nodes"]) == 2
        assert cells["bert-avx2"]["status"] == "done"
        deadline = time.monotonic() + 90
        while _cell_processes(running) and time.monotonic() < deadline:
            time.sleep(1)
        assert not _cell_processes(running), "the lost nodes' runs ended with their nodes"


def test_the_fleet_notebook_runs_a_sweep_on_the_cluster(cluster, models, tmp_path):
    """The notebook beside the steps: its cell shows each cell's lines, then the fleet table and its picks."""
    import nbformat
    import papermill

    from workbench.pipeline import NOTEBOOKS_DIR

    path = _sweep_file(tmp_path, {"bert": models["bert"]}, ["amx"])
    out = tmp_path / "fleet.ipynb"
    papermill.execute_notebook(str(NOTEBOOKS_DIR / "tools" / "fleet.ipynb"), str(out), kernel_name="python3",
                               parameters={"sweep_file": str(path), "ray_address": cluster.address},
                               progress_bar=False)
    cells = nbformat.read(out, as_version=4).cells
    printed = "".join(o.get("text", "") for c in cells if c.cell_type == "code" for o in c.outputs)
    assert "[1/1] bert-amx: placed on node" in printed and "bert-amx: [1/4] export" in printed
    assert "[1/1] bert-amx: finished in" in printed and "every cell finished" in printed
    assert "amx bert latency: bert-amx/fp32" in printed
    assert RunRecord.load(tmp_path / "runs" / "bert-amx").environment.node.kind == "amx"


def test_the_cluster_takes_only_drivers_with_its_token(cluster, models, tmp_path):
    """Ray listens on the host's address, not 127.0.0.1: a driver without the local cluster's token is refused."""
    import os

    path = _sweep_file(tmp_path, {"bert": models["bert"]}, ["avx2"])
    env = {name: value for name, value in os.environ.items() if not name.startswith("RAY_AUTH")}
    done = subprocess.run(_workbench("sweep", str(path), "--ray", cluster.address), capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 2 and "cannot connect to the Ray cluster" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "runs").exists()

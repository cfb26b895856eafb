"""The deploy step's files, checked as far as this machine can: the Kubernetes documents against the Kubernetes
schema, the ServiceMonitor and the InferenceService against their CRDs' published schemas (vendored in tests/data/crds
with their versions), strictly (a misspelled key or a wrong apiVersion fails); the Dockerfile parsed and its pins
compared with pyproject.toml; the autoscaler's metric and the adapter rule's counters against what a real
tritonserver exposes; the capacity against the bench numbers it was computed from."""
from __future__ import annotations

import contextlib
import copy
import gzip
import json
import math
import os
import re
import shlex
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import jsonschema
import kubernetes_validate
import psutil
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from workbench.core.record import RunRecord
from workbench.report.page import build_report
from workbench.serving.client import TritonClient
from workbench.serving.deploy import QUEUE_COUNTER, QUEUE_METRIC, SUCCESS_COUNTER, network_model
from workbench.serving.plan import deployed_plan
from workbench.serving.server import TritonServer, free_port
from workbench.serving.tables import TritonMetrics
from workbench.steps import deploy, specs, triton

from .test_triton import prepared

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
KUBERNETES = "1.37.0"  # the newest schemas kubernetes-validate (pinned in pyproject.toml) ships
CRDS = {  # kind -> the CRD schema file, from the projects' own CRD manifests at these versions
    "InferenceService": "kserve-0.20.0-inferenceservice-v1beta1.json.gz",
    "ServiceMonitor": "prometheus-operator-0.93.0-servicemonitor-v1.json.gz",
    "RayCluster": "kuberay-1.7.0-raycluster-v1.json.gz",
    "RayJob": "kuberay-1.7.0-rayjob-v1.json.gz",
}


def level(concurrency: int, throughput: float, p99: float) -> dict:
    """A served level as the bench step records it (metrics.bench.served.batching_on.text.<concurrency>)."""
    return {"concurrency": concurrency, "requests": 200, "errors": 0, "seconds": 200 / throughput,
            "throughput": throughput, "p50": p99 / 2, "p90": p99 * 0.8, "p95": p99 * 0.9, "p99": p99, "mean": p99 / 2}


LEVELS = {"1": level(1, 40.0, 30.0), "4": level(4, 90.0, 120.0),
          "8": level(8, 120.0, 900.0)}  # the last over the 500 ms p99 limit


def _strict(schema: object) -> object:
    """The schema as the API server's strict field validation applies it: no field the schema does not list, where
    it lists its fields and keeps no unknown ones."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    found = {key: _strict(value) for key, value in schema.items()}
    if schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        found["additionalProperties"] = False
    return found


def validate(document: dict) -> str:
    """What the API server would say first: the Kubernetes schema for built-in kinds, the CRD's for the others."""
    if document["kind"] not in CRDS:
        return kubernetes_validate.validate(document, KUBERNETES, strict=True)
    crd = json.loads(gzip.decompress((ROOT / "tests" / "data" / "crds" / CRDS[document["kind"]]).read_bytes()))
    expected = f"{crd['group']}/{crd['version']}"
    if document["apiVersion"] != expected:
        raise jsonschema.ValidationError(f"apiVersion {document['apiVersion']!r}: the CRD serves {expected!r}")
    jsonschema.validate(document, _strict(crd["openAPIV3Schema"]))
    return expected


@pytest.fixture(scope="module")
def deployed(tiny_models, tmp_path_factory) -> tuple[RunRecord, Path]:
    """Tiny BERT through the triton step (a real server checked it), a recorded served sweep, then the deploy step."""
    root = tmp_path_factory.mktemp("deploy")
    config, record = prepared(tiny_models["bert"], root / "run", root / "repos",
                              deploy={"target_rps": 500, "burst_factor": 3})
    assert triton.run(config, record).status == "ok"
    plan, _ = deployed_plan(record.current(TritonMetrics), record)
    served = {"batching_on": {"text": {c: {**level, "server": {network_model(plan): {"queue": 2.5}}}
                                       for c, level in LEVELS.items()}}}
    with record.step("bench"):
        record.set_metric("bench.served", served)
    assert deploy.run(config, record).status == "ok"
    return record, root


def _documents(record: RunRecord, name: str) -> list[dict]:
    return list(yaml.safe_load_all(record.artifact(f"deploy.{name}").read_text()))


def test_every_manifest_passes_its_schema_strictly(deployed):
    record, _ = deployed
    documents = _documents(record, "kubernetes") + _documents(record, "kserve")
    assert [d["kind"] for d in documents] == ["Deployment", "Service", "HorizontalPodAutoscaler", "ServiceMonitor",
                                              "InferenceService"]
    assert [validate(d) for d in documents] == ["1.37", "1.37", "1.37", "monitoring.coreos.com/v1",
                                                "serving.kserve.io/v1beta1"]
    text = record.artifact("deploy.kubernetes").read_text()
    assert "&id" not in text and "*id" not in text, "written out in full, as people write manifests"
    scraped = [(e["port"], e["path"]) for e in documents[3]["spec"]["endpoints"]]
    assert scraped == [("metrics", "/metrics"), ("api", "/metrics")], "Triton's metrics and the front's"


@pytest.mark.parametrize("kind", ["Deployment", "HorizontalPodAutoscaler", "ServiceMonitor", "InferenceService"])
def test_a_misspelled_key_or_a_wrong_api_version_fails(deployed, kind):
    record, _ = deployed
    document = next(d for d in _documents(record, "kubernetes") + _documents(record, "kserve") if d["kind"] == kind)
    misspelled = copy.deepcopy(document)
    misspelled["spec"]["minReplica" if "minReplicas" in document["spec"] else "replica"] = 2
    if kind == "InferenceService":
        misspelled = copy.deepcopy(document)
        misspelled["spec"]["predictor"]["model"]["storageURI"] = "s3://x"
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(misspelled)
    wrong = {**document, "apiVersion": document["apiVersion"].replace("v1", "v1alpha9").replace("v2", "v9")}
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError,
                        kubernetes_validate.SchemaNotFoundError)):
        validate(wrong)


def test_the_image_is_the_verified_repository_with_the_project_pins(deployed):
    record, _ = deployed
    config = record.config
    dockerfile = DockerfileParser(fileobj=record.artifact("deploy.dockerfile").open("rb"))
    assert dockerfile.baseimage == config.deploy.container_image
    steps = [(s["instruction"], s["value"]) for s in dockerfile.structure]
    assert ("COPY", ". /models") in steps and ("COPY", "--from=front . /opt/workbench/") in steps
    assert steps[-2:] == [("EXPOSE", "8000 8001 8002 8080"), ("CMD", '["bash", "/opt/workbench/start.sh"]')]
    installed = shlex.split(next(v for i, v in steps if i == "RUN" and "pip install" in v))
    pinned = [word.replace("[grpc]", "[all]") for word in installed if "==" in word]  # the front's client: gRPC
    declared = re.findall(r'"((?:transformers|tokenizers|onnxruntime-gpu|tritonclient|orjson|uvloop|'
                          r'prometheus-client)\b[^"]*==[^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert sorted(pinned) == sorted(declared), "the same pins, one place"
    assert len(pinned) == 7 and all(re.fullmatch(r"[\w\-\[\],]+==[\d.]+", p) for p in pinned)

    image = record.metric("deploy.image")
    digest = record.artifact_sha256("triton.repository")
    assert re.fullmatch(r"localhost:5000/bert:[0-9a-f]{12}", image) and digest
    assert image in record.artifact("deploy.docker").read_text()
    assert all(c["image"] == image for c in _documents(record, "kubernetes")[0]["spec"]["template"]["spec"]
               ["containers"])
    assert _documents(record, "kserve")[0]["spec"]["predictor"]["model"]["image"] == image
    readme = record.artifact("deploy.readme").read_text()
    assert f"docker build -t {image} -f deploy/Dockerfile --build-context front=deploy/front model_repository/bert" \
        in readme
    container = _documents(record, "kubernetes")[0]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "api", "containerPort": 8080} in container["ports"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "api"}
    assert "api" in [p["name"] for p in _documents(record, "kubernetes")[1]["spec"]["ports"]]


@pytest.mark.slow
def test_the_images_start_script_runs_triton_and_the_front_and_both_stop_on_sigterm(deployed, tmp_path):
    """deploy/front/start.sh as the image runs it (the front's copied file beside its spec), outside Docker: the
    wheel's tritonserver on PATH, the repository and ports given by the variables the script reads."""
    record, _ = deployed
    server = TritonServer(record.artifact("triton.repository"), tmp_path / "server")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "tritonserver").symlink_to(server.binary.executable)
    start = record.artifact("deploy.front_start")
    env = {**server._environment(), "MODELS": str(server.repository), "FRONT": str(start.parent),
           "HTTP_PORT": str(server.ports.http), "GRPC_PORT": str(server.ports.grpc),
           "METRICS_PORT": str(server.ports.metrics), "API_PORT": str(free_port()),
           "TRITON_ARGS": f"--backend-directory={server._backends()} --http-address=127.0.0.1 "
                          "--grpc-address=127.0.0.1 --metrics-address=127.0.0.1"}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    script = subprocess.Popen(["bash", str(start)], env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{env['API_PORT']}"
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline and script.poll() is None, "the front never became ready"
                time.sleep(0.3)
        body = json.dumps({"model": "bert", "input": ["a text", "another"]}).encode()
        request = urllib.request.Request(f"{url}/v1/embeddings", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        assert [d["index"] for d in answer["data"]] == [0, 1] and len(answer["data"][0]["embedding"]) > 0
        group = [p.pid for p in psutil.Process(script.pid).children(recursive=True)]
        script.send_signal(signal.SIGTERM)
        assert script.wait(timeout=60) == 128 + signal.SIGTERM, "the SIGTERM passed on, its status kept"
        deadline = time.monotonic() + 30
        while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in group):
            assert time.monotonic() < deadline, "tritonserver or the front outlived the script"
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(script.pid, signal.SIGKILL)


def test_replicas_and_targets_follow_the_recorded_bench(deployed):
    record, _ = deployed
    capacity, scaling = record.metric("deploy.capacity"), record.metric("deploy.scaling")
    best = LEVELS["4"]  # the highest throughput with p99 under the limit
    assert capacity["per_replica_rps"] == best["throughput"] and capacity["concurrency"] == 4
    assert scaling["min_replicas"] == math.ceil(500 / 90.0) == 6 and scaling["max_replicas"] == 18
    assert scaling["queue_target_us"] == 2500 and scaling["concurrency"] == 4
    deployment, _, autoscaler, _ = _documents(record, "kubernetes")
    assert deployment["spec"]["replicas"] == 6
    assert (autoscaler["spec"]["minReplicas"], autoscaler["spec"]["maxReplicas"]) == (6, 18)
    assert autoscaler["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "2500"
    predictor = _documents(record, "kserve")[0]["spec"]["predictor"]
    assert (predictor["minReplicas"], predictor["maxReplicas"], predictor["scaleTarget"]) == (6, 18, 4)
    page = build_report(record, record.run_dir / "report.html", specs()).read_text()
    assert "Triton at scale: capacity and autoscaling" in page and "Capacity on paper (one GPU per pod)" in page
    assert "500 req/s / 90.0 req/s per replica (concurrency 4, p99 120.0 ms <= 500 ms" in capacity["replicas_reason"]


def test_the_autoscaler_reads_counters_the_real_server_exposes(deployed):
    record, root = deployed
    plan, _ = deployed_plan(record.current(TritonMetrics), record)
    rule = yaml.safe_load(record.artifact("deploy.adapter").read_text())["rules"]["custom"][0]
    autoscaler = _documents(record, "kubernetes")[2]
    assert autoscaler["spec"]["metrics"][0]["pods"]["metric"]["name"] == rule["name"]["as"] == QUEUE_METRIC
    model = network_model(plan)
    assert re.findall(r"(nv_\w+)\{", rule["metricsQuery"]) == [QUEUE_COUNTER, SUCCESS_COUNTER]
    assert f'model="{model}"' in rule["seriesQuery"] and rule["seriesQuery"].startswith(QUEUE_COUNTER)
    with TritonServer(record.artifact("triton.repository"), root / "scrape") as server:
        with TritonClient(server.http_url, "http") as client:
            client.infer_texts(plan.name, ["a text to count"])
        wanted = {counter: re.compile(rf'^{counter}\{{[^}}]*model="{model}"[^}}]*\}} {value}', re.M)
                  for counter, value in ((QUEUE_COUNTER, "[0-9]"), (SUCCESS_COUNTER, "[1-9]"))}
        deadline = time.monotonic() + 120  # the server updates its counters on its own time: polled, bounded
        while True:
            with urllib.request.urlopen(f"http://{server.metrics_url}/metrics", timeout=30) as response:
                exposed = response.read().decode()
            missing = [counter for counter, pattern in wanted.items() if not pattern.search(exposed)]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert not missing, f"{missing} not counted within 120 s"


def test_a_sweep_cell_deploys_on_its_host_kind_and_the_fleet_file_spans_the_kinds(deployed, tmp_path):
    """The same verified run as two sweep cells (their nodes told amx and avx2): each deploy step writes its kind's
    Deployment and autoscaler, placed by node-feature-discovery's labels, no GPU asked; the fleet file holds both
    kinds' Deployments and one Service selecting them all; each document passes its schema strictly."""
    import shutil

    from workbench.fleet.deployments import write_fleet

    record, _ = deployed
    cells = []
    for kind in ("amx", "avx2"):
        cell = tmp_path / f"tiny-{kind}"
        shutil.copytree(record.run_dir, cell, symlinks=True)
        copied = RunRecord.load(cell)
        copied.data["environment"]["node"] = {"id": "f" * 56, "address": "10.0.0.7", "kind": kind, "told": True}
        copied.save()
        assert deploy.run(copied.config, copied).status == "ok"
        cells.append(cell)
    amx = {d["kind"]: d for d in _documents(RunRecord.load(cells[0]), "kubernetes")}
    pod = amx["Deployment"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"feature.node.kubernetes.io/cpu-cpuid.AMXINT8": "true"}
    assert "nvidia.com/gpu" not in pod["containers"][0]["resources"]["limits"]
    assert amx["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]["name"] == amx["Deployment"]["metadata"]["name"]
    written = write_fleet("tiny", cells, tmp_path / "tiny-fleet.yaml")
    documents = list(yaml.safe_load_all(written.read_text()))
    assert [(d["kind"], d["metadata"]["name"].rsplit("-", 1)[-1]) for d in documents[:4]] == [
        ("Deployment", "amx"), ("HorizontalPodAutoscaler", "amx"), ("Deployment", "avx2"),
        ("HorizontalPodAutoscaler", "avx2")]
    (service,) = [d for d in documents if d["kind"] == "Service"]
    assert "host-kind" not in service["spec"]["selector"], "one Service across every kind's pods"
    avx2 = documents[2]["spec"]["template"]["spec"]
    assert {e["key"] for e in avx2["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]["matchExpressions"]} >= {"feature.node.kubernetes.io/cpu-cpuid.AMXINT8"}
    assert all(validate(d) for d in documents)


def test_deploy_without_a_current_deployment_is_skipped_naming_the_steps_to_run(tmp_path):
    """Nothing the triton step deployed is current (it did not run here): deploy is skipped with the command that
    runs triton, then deploy, and writes nothing."""
    from workbench.core.config import RunConfig

    record = RunRecord.create(tmp_path, RunConfig(steps=["deploy"]))
    entry = deploy.run(record.config, record)
    assert entry.status == "skipped"
    assert entry.detail.startswith("nothing deployed in this run (triton: not run)")
    reason = record.data["steps"]["deploy"]["reason"]
    assert "fix: " in reason and "--steps triton,deploy" in reason and not (tmp_path / "deploy").exists()

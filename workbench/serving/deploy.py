"""Files that run a verified repository beyond this machine, all from the serving plan the triton step verified: an
image recipe (the repository and the pinned packages its Python models import, baked in), `docker run`, Kubernetes
(Deployment, Service, a HorizontalPodAutoscaler on Triton's queue time per request, the prometheus-adapter rule
that derives it, a ServiceMonitor) and a KServe InferenceService."""
from __future__ import annotations

import hashlib
import shlex
from pathlib import Path
from typing import Any

import yaml

from workbench.core.atomic import write_text
from workbench.core.config import TritonSettings
from workbench.core.flavor import Flavor
from workbench.core.pins import pin
from workbench.core.results import Metrics
from workbench.serving.repository import ServingPlan

CONTAINER_PACKAGES = ("transformers", "tokenizers")  # installed into NVIDIA's container as pyproject.toml pins them
PORTS = (("http", 8000), ("grpc", 8001), ("metrics", 8002))
QUEUE_COUNTER = "nv_inference_queue_duration_us"  # Triton's cumulative queue microseconds, per model
SUCCESS_COUNTER = "nv_inference_request_success"  # Triton's cumulative successful requests, per model
QUEUE_METRIC = "triton_queue_us_per_request"  # what prometheus-adapter serves the autoscaler, per pod
RATE_WINDOW = "1m"
KSERVE_RUNTIME = "kserve-tritonserver"
FILES = {"dockerfile": "Dockerfile", "docker": "docker_run.sh", "kubernetes": "kubernetes.yaml",
         "adapter": "prometheus-adapter.yaml", "kserve": "kserve.yaml", "readme": "README.md"}


class Scaling(Metrics):
    """What the autoscalers keep: replicas between `min_replicas` and `max_replicas`, an average queue time per
    request of `queue_target_us`, and (KServe) `concurrency` requests in flight per replica (run.json
    `metrics.deploy.scaling`)."""

    min_replicas: int
    max_replicas: int
    queue_target_us: int
    concurrency: int


class _PlainDumper(yaml.SafeDumper):
    """Writes a mapping used twice (the labels) out in full each time, as people write manifests, not as an
    anchor and alias."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def _yaml(*documents: dict[str, Any]) -> str:
    return yaml.dump_all(list(documents), Dumper=_PlainDumper, sort_keys=False)


def app_name(plan: ServingPlan) -> str:
    """The Kubernetes name of the deployment (DNS-1123: the repository name with dashes)."""
    return plan.name.replace("_", "-").lower()


def network_model(plan: ServingPlan) -> str:
    """The model that runs the network, whose queue time the autoscaler watches."""
    return plan.name if plan.layout == "fused" else plan.model_name


def packages(plan: ServingPlan) -> list[str]:
    """The pinned requirements the repository's Python models import inside NVIDIA's container (OpenVINO too where
    its Python model runs the OpenVINO variant)."""
    runtimes = (["onnxruntime-gpu"] + (["openvino"] if plan.runtime == "openvino" else [])
                if plan.flavor is Flavor.PYTHON_ORT else [])
    return [pin(name) for name in (*CONTAINER_PACKAGES, *runtimes)]


def dockerfile(triton: TritonSettings, plan: ServingPlan) -> str:
    """The image: NVIDIA's Triton container, the pinned packages, the repository copied in (not mounted: the image
    is the unit that was verified, and a pod starts without a volume to fill or a package index to reach)."""
    requirements = " ".join(shlex.quote(p) for p in packages(plan))
    return (f"# The verified Triton repository {plan.name!r} and the Python packages its models import, pinned as\n"
            "# the workbench pins them. Build it with the repository folder as the context (deploy/README.md).\n"
            f"FROM {triton.container_image}\n"
            f"RUN python3 -m pip install --no-cache-dir {requirements}\n"
            "COPY . /models\n"
            f"EXPOSE {' '.join(str(port) for _, port in PORTS)}\n"
            'CMD ["tritonserver", "--model-repository=/models", "--allow-metrics=true"]\n')


def image_tag(triton: TritonSettings, plan: ServingPlan, repository_sha256: str) -> str:
    """`<registry>/<name>:<12 hex digits>` of the repository's content and the image recipe: a new tag whenever
    either changes, never a mutable `latest`."""
    digest = hashlib.sha256(f"{repository_sha256}\n{dockerfile(triton, plan)}".encode()).hexdigest()[:12]
    return f"{triton.image_registry.rstrip('/')}/{app_name(plan)}:{digest}"


def docker_script(image: str) -> str:
    ports = " ".join(f"-p {port}:{port}" for _, port in PORTS)
    return ("#!/usr/bin/env bash\n# Serve the image built from deploy/Dockerfile on one GPU host (HTTP 8000, gRPC "
            f"8001, metrics 8002).\nexec docker run --rm --gpus all --shm-size=1g {ports} {image}\n")


def kubernetes_documents(plan: ServingPlan, image: str, scaling: Scaling) -> list[dict[str, Any]]:
    """Deployment, Service, HorizontalPodAutoscaler (queue time per request, through prometheus-adapter) and the
    ServiceMonitor that has Prometheus scrape the metrics port."""
    name = app_name(plan)
    labels = {"app": name}
    ports = [{"name": n, "containerPort": p} for n, p in PORTS]
    health = {"path": "/v2/health/ready", "port": "http"}
    container = {
        "name": "triton", "image": image, "ports": ports,
        "resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "8Gi", "nvidia.com/gpu": 1}},
        "startupProbe": {"httpGet": health, "periodSeconds": 5, "failureThreshold": 60},
        "readinessProbe": {"httpGet": health, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": "http"}, "periodSeconds": 10},
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]}  # the Python backend's tensors pass through it
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
        "spec": {"replicas": scaling.min_replicas, "selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": labels}, "spec": {"containers": [container], "volumes": [
                {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}]}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
               "spec": {"selector": labels, "ports": [{"name": p["name"], "port": p["containerPort"],
                                                       "targetPort": p["name"]} for p in ports]}}
    autoscaler = {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": name, "labels": labels},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                 "minReplicas": scaling.min_replicas, "maxReplicas": scaling.max_replicas,
                 "metrics": [{"type": "Pods", "pods": {"metric": {"name": QUEUE_METRIC}, "target": {
                     "type": "AverageValue", "averageValue": str(scaling.queue_target_us)}}}],
                 "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}}}}
    monitor = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
               "metadata": {"name": name, "labels": labels},
               "spec": {"selector": {"matchLabels": labels},
                        "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}]}}
    return [deployment, service, autoscaler, monitor]


def adapter_rule(plan: ServingPlan) -> dict[str, Any]:
    """The prometheus-adapter rule serving QUEUE_METRIC per pod: queue microseconds over successful requests of the
    network model, both as rates over RATE_WINDOW."""
    model = f'model="{network_model(plan)}"'

    def rate(counter: str) -> str:
        return f"sum(rate({counter}{{<<.LabelMatchers>>,{model}}}[{RATE_WINDOW}])) by (<<.GroupBy>>)"

    return {"seriesQuery": f'{QUEUE_COUNTER}{{namespace!="",pod!="",{model}}}',
            "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
            "name": {"matches": f"^{QUEUE_COUNTER}$", "as": QUEUE_METRIC},
            "metricsQuery": f"{rate(QUEUE_COUNTER)} / clamp_min({rate(SUCCESS_COUNTER)}, 0.001)"}


def inference_service(triton: TritonSettings, plan: ServingPlan, image: str, scaling: Scaling) -> dict[str, Any]:
    """KServe's Triton runtime serving the repository from `triton.storage_uri`, in this image (for the packages
    its Python models import), scaled by requests in flight per replica."""
    name = app_name(plan)
    return {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
            "metadata": {"name": name, "labels": {"app": name}},
            "spec": {"predictor": {
                "minReplicas": scaling.min_replicas, "maxReplicas": scaling.max_replicas,
                "scaleMetric": "concurrency", "scaleTarget": scaling.concurrency,
                "model": {"modelFormat": {"name": "triton"}, "protocolVersion": "v2", "runtime": KSERVE_RUNTIME,
                          "storageUri": triton.storage_uri or f"pvc://{name}-models/",
                          "image": image,
                          "resources": {"requests": {"cpu": "2", "memory": "4Gi"},
                                        "limits": {"memory": "8Gi", "nvidia.com/gpu": "1"}}}}}}


def deployment_files(triton: TritonSettings, plan: ServingPlan, repository: Path, repository_sha256: str,
                     scaling: Scaling, capacity: list[str], folder: Path) -> dict[str, Path]:
    """Every file in `folder` (deploy/), by FILES key; `capacity` is the README's lines on how the numbers were
    chosen."""
    image = image_tag(triton, plan, repository_sha256)
    texts = {"dockerfile": dockerfile(triton, plan), "docker": docker_script(image),
             "kubernetes": _yaml(*kubernetes_documents(plan, image, scaling)),
             "adapter": _yaml({"rules": {"default": False, "custom": [adapter_rule(plan)]}}),
             "kserve": _yaml(inference_service(triton, plan, image, scaling)),
             "readme": readme(plan, repository, image, scaling, capacity)}
    return {key: write_text(folder / FILES[key], text) for key, text in texts.items()}


def readme(plan: ServingPlan, repository: Path, image: str, scaling: Scaling,
           capacity: list[str]) -> str:
    name = app_name(plan)
    bullets = "\n".join(f"- {line}" for line in capacity)
    return f"""# Deploying {plan.name}

Everything here was written from the serving plan the workbench verified (served parity) for `{repository}`.
The image bakes that repository in at `/models`, with the Python packages its models import pinned as the
workbench pins them: a pod needs no volume to fill and no package index to start.

Run the commands below from the run folder (the one holding `deploy/` and `{repository}`).

## Build and push the image

```bash
docker build -t {image} -f deploy/{FILES['dockerfile']} {repository}
docker push {image}
```

The tag is a hash of the repository and the recipe: rebuild after re-running the workbench and the tag changes.
Another registry: `-p triton.image_registry=registry.example.com/ml` when you run the workbench (or retag).

## One GPU host

```bash
./deploy/{FILES['docker']}
curl localhost:8000/v2/health/ready
```

## Kubernetes, scaled on queue time

Triton counts, per model, the microseconds requests waited in its queue (`{QUEUE_COUNTER}`) and the requests it
answered (`{SUCCESS_COUNTER}`). Their rates' ratio is the average queue time per request: it rises as soon as the
replicas cannot keep up, before latency does, and falls when they can. The autoscaler keeps it at
{scaling.queue_target_us} us per pod between {scaling.min_replicas} and {scaling.max_replicas} replicas.

```bash
# Prometheus Operator (kube-prometheus-stack) scrapes the metrics port through the ServiceMonitor;
# prometheus-adapter turns the counters into the per-pod metric {QUEUE_METRIC}:
helm repo add prometheus-community https://prometheus-community.github.io/helm-charts
helm install prometheus-adapter prometheus-community/prometheus-adapter -f deploy/{FILES['adapter']} \\
  --set prometheus.url=http://<your-prometheus>.monitoring.svc
kubectl apply -f deploy/{FILES['kubernetes']}
kubectl get --raw "/apis/custom.metrics.k8s.io/v1beta1/namespaces/default/pods/*/{QUEUE_METRIC}"
kubectl get hpa {name} --watch        # replicas follow the queue time under load, e.g. perf_analyzer:
perf_analyzer -m {plan.name} -u <service>:8001 -i grpc --concurrency-range 1:64:8 --input-data texts.json
# texts.json: {{"data": [{{"TEXT": {{"content": ["a text"], "shape": [1]}}}}]}} (`workbench serve` writes one)
```

## KServe

`{FILES['kserve']}` serves the same repository with KServe's Triton runtime (`{KSERVE_RUNTIME}`, protocol v2),
in this image (for its pinned packages), scaled by requests in flight ({scaling.concurrency} per replica).
KServe reads the repository from its `storageUri`: the folder there must hold what `{repository}` holds (its
model folders at the top, not `{repository}` itself). The default, `pvc://{name}-models/`, is a
PersistentVolumeClaim: copy the contents in with `kubectl cp {repository}/. <pod mounting the claim>:<mount>/`;
or `-p triton.storage_uri=s3://bucket/{plan.name}` when you run the workbench, and `aws s3 sync {repository}/
s3://bucket/{plan.name}/`.

```bash
kubectl apply -f deploy/{FILES['kserve']}
kubectl get inferenceservice {name} --watch
```

## Capacity

{bullets}

One GPU per pod is assumed: a pod with more GPUs, or several pods sharing one, serves a different rate. A rate
measured on a CPU host says nothing of a GPU pod's: re-run `--steps triton,bench,deploy` on a host like the pods'.
"""

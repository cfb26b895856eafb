"""Files that run a verified repository beyond this machine, all from the serving plan the triton step verified: an
image recipe (the repository and the pinned packages its Python models import, baked in), `docker run`, Kubernetes
(Deployment, Service, a HorizontalPodAutoscaler on Triton's queue time per request, the prometheus-adapter rule
that derives it, a ServiceMonitor) and a KServe InferenceService."""
from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from workbench.core.atomic import write_text
from workbench.core.metrics import Metrics
from workbench.models.pins import pin
from workbench.serving.flavor import Flavor
from workbench.serving.hostkinds import HostKind
from workbench.serving.repository import MODELS_SOURCE, ServingPlan
from workbench.serving.server import API_PORT
from workbench.serving.settings import DeploySettings

if TYPE_CHECKING:  # the front's own modules load aiohttp: not for every command that imports the steps
    from workbench.serving.backend.api_schema import FrontSpec

CONTAINER_PACKAGES = ("transformers", "tokenizers")  # installed into NVIDIA's container as pyproject.toml pins them
PORTS = (("http", 8000), ("grpc", 8001), ("metrics", 8002))
FRONT_PORT = ("api", API_PORT)
FRONT_FILES = ("api_front.py", "api_core.py", "api_schema.py", "api_tei.py", "api_metrics.py",
               "text_input.py")  # what the image copies to run the API front
FRONT_FOLDER = "front"  # deploy/front: the API front's files, the image's second build context
# the front's imports, beside tritonclient's gRPC client and tokenizers
FRONT_PACKAGES = ("aiohttp", "pydantic", "orjson", "uvloop", "prometheus-client")
START_SCRIPT = """#!/usr/bin/env bash
# tritonserver and the workbench's API front in one container: it ends when either ends, and passes SIGTERM
# (docker stop, a pod's end) on to both. MODELS, FRONT and the ports can be set for a run outside the image.
models=${MODELS:-/models} front=${FRONT:-/opt/workbench}
tritonserver --model-repository="$models" --allow-metrics=true --http-port="${HTTP_PORT:-8000}" \\
    --grpc-port="${GRPC_PORT:-8001}" --metrics-port="${METRICS_PORT:-8002}" ${TRITON_ARGS:-} & triton=$!
python3 "$front/api_front.py" --spec "$front/front.json" --repository "$models" \\
    --triton "127.0.0.1:${GRPC_PORT:-8001}" --host 0.0.0.0 --port "${API_PORT:-%d}" & api=$!
trap 'kill -TERM $triton $api 2>/dev/null' TERM INT
wait -n
code=$?
kill -TERM $triton $api 2>/dev/null
wait
exit $code
""" % API_PORT
QUEUE_COUNTER = "nv_inference_queue_duration_us"  # Triton's cumulative queue microseconds, per model
SUCCESS_COUNTER = "nv_inference_request_success"  # Triton's cumulative successful requests, per model
HOST_KIND_LABEL = "host-kind"  # a per-kind Deployment's pods carry their kind: the Service spans the kinds
QUEUE_METRIC = "triton_queue_us_per_request"  # what prometheus-adapter serves the autoscaler, per pod
RATE_WINDOW = "1m"
KSERVE_RUNTIME = "kserve-tritonserver"
FILES = {"dockerfile": "Dockerfile", "docker": "docker_run.sh", "kubernetes": "kubernetes.yaml",
         "adapter": "prometheus-adapter.yaml", "kserve": "kserve.yaml", "readme": "README.md",
         "front_spec": f"{FRONT_FOLDER}/front.json", "front_start": f"{FRONT_FOLDER}/start.sh",
         **{f"front_{Path(name).stem}": f"{FRONT_FOLDER}/{name}" for name in FRONT_FILES}}


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


def packages(plan: ServingPlan, front: bool) -> list[str]:
    """The pinned requirements the repository's Python models import inside NVIDIA's container (OpenVINO too where
    its Python model runs the OpenVINO variant), and the API front's where it is in the image."""
    runtimes = (["onnxruntime-gpu"] + (["openvino"] if plan.runtime == "openvino" else [])
                if plan.flavor is Flavor.PYTHON_ORT else [])
    client = [pin("tritonclient").replace("[all]", "[grpc]")] if front else []
    return [pin(name) for name in (*CONTAINER_PACKAGES, *runtimes, *(FRONT_PACKAGES if front else ()))] + client


def ports(front: bool) -> tuple[tuple[str, int], ...]:
    return (*PORTS, FRONT_PORT) if front else PORTS


def dockerfile(settings: DeploySettings, plan: ServingPlan, front: bool) -> str:
    """The image: NVIDIA's Triton container, the pinned packages, the repository copied in (not mounted: the image
    is the unit that was verified, and a pod starts without a volume to fill or a package index to reach), and the
    API front beside tritonserver where the repository has a model it answers for."""
    requirements = " ".join(shlex.quote(p) for p in packages(plan, front))
    start = (f"COPY --from={FRONT_FOLDER} . /opt/workbench/\n", 'CMD ["bash", "/opt/workbench/start.sh"]\n') if front \
        else ("", 'CMD ["tritonserver", "--model-repository=/models", "--allow-metrics=true"]\n')
    return (f"# The verified Triton repository {plan.name!r} and the Python packages its models import, pinned as\n"
            "# the workbench pins them. Build it with the repository folder as the context (deploy/README.md).\n"
            f"FROM {settings.container_image}\n"
            f"RUN python3 -m pip install --no-cache-dir {requirements}\n"
            "COPY . /models\n"
            f"{start[0]}"
            f"EXPOSE {' '.join(str(port) for _, port in ports(front))}\n"
            f"{start[1]}")


def front_texts(front: FrontSpec | None) -> dict[str, str]:
    """The files of deploy/front (by FILES key): the front's source, its spec and the container's start script;
    none without a front."""
    if front is None:
        return {}
    return {"front_spec": front.model_dump_json(indent=2) + "\n", "front_start": START_SCRIPT,
            **{f"front_{Path(name).stem}": (MODELS_SOURCE / name).read_text(encoding="utf-8") for name in FRONT_FILES}}


def image_tag(settings: DeploySettings, plan: ServingPlan, repository_sha256: str, front: FrontSpec | None) -> str:
    """`<registry>/<name>:<12 hex digits>` of the repository's content, the image recipe and the front's files: a
    new tag whenever one changes, never a mutable `latest`."""
    material = "\n".join([repository_sha256, dockerfile(settings, plan, front is not None),
                          *front_texts(front).values()])
    digest = hashlib.sha256(material.encode()).hexdigest()[:12]
    return f"{settings.image_registry.rstrip('/')}/{app_name(plan)}:{digest}"


def docker_script(image: str, front: bool) -> str:
    published = " ".join(f"-p {port}:{port}" for _, port in ports(front))
    named = ", ".join(f"{name} {port}" for name, port in ports(front))
    return (f"#!/usr/bin/env bash\n# Serve the image built from deploy/Dockerfile on one GPU host ({named}).\n"
            f"exec docker run --rm --gpus all --shm-size=1g {published} {image}\n")


def kubernetes_documents(plan: ServingPlan, image: str, scaling: Scaling, front: bool,
                         kind: HostKind | None = None) -> list[dict[str, Any]]:
    """Deployment, Service, HorizontalPodAutoscaler (queue time per request, through prometheus-adapter) and the
    ServiceMonitor that has Prometheus scrape the metrics port (and the API front's /metrics). With the API front,
    the pod is ready when the front is (its /health answers 200 once Triton's models are ready). For a run measured
    on a node of host `kind` (a sweep cell), the Deployment and its autoscaler are that kind's (`<app>-<kind>`),
    placed on nodes whose node-feature-discovery labels make them that kind, asking a GPU only on the GPU kind; the
    Service and the ServiceMonitor select the app across every kind's Deployment."""
    name = app_name(plan)
    labels = {"app": name}
    own = f"{name}-{kind.name.replace('_', '-')}" if kind else name
    pod_labels = {**labels, HOST_KIND_LABEL: kind.name.replace("_", "-")} if kind else labels
    exposed = [{"name": n, "containerPort": p} for n, p in ports(front)]
    health = {"path": "/health", "port": FRONT_PORT[0]} if front else {"path": "/v2/health/ready", "port": "http"}
    gpu = {"nvidia.com/gpu": 1} if kind is None or kind.name == "gpu" else {}
    container = {
        "name": "triton", "image": image, "ports": exposed,
        "resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "8Gi", **gpu}},
        "startupProbe": {"httpGet": health, "periodSeconds": 5, "failureThreshold": 60},
        "readinessProbe": {"httpGet": health, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": "http"}, "periodSeconds": 10},
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]}  # the Python backend's tensors pass through it
    placement: dict[str, Any] = {"nodeSelector": kind.node_selector(), **({"affinity": kind.affinity()}
                                                                           if kind.affinity() else {})} if kind else {}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": own, "labels": pod_labels},
        "spec": {"replicas": scaling.min_replicas, "selector": {"matchLabels": pod_labels}, "template": {
            "metadata": {"labels": pod_labels}, "spec": {**placement, "containers": [container], "volumes": [
                {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}]}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
               "spec": {"selector": labels, "ports": [{"name": p["name"], "port": p["containerPort"],
                                                       "targetPort": p["name"]} for p in exposed]}}
    autoscaler = {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": own, "labels": pod_labels},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": own},
                 "minReplicas": scaling.min_replicas, "maxReplicas": scaling.max_replicas,
                 "metrics": [{"type": "Pods", "pods": {"metric": {"name": QUEUE_METRIC}, "target": {
                     "type": "AverageValue", "averageValue": str(scaling.queue_target_us)}}}],
                 "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}}}}
    monitor = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
               "metadata": {"name": name, "labels": labels},
               "spec": {"selector": {"matchLabels": labels},
                        "endpoints": [{"port": port, "path": "/metrics", "interval": "15s"}
                                      for port in ("metrics", *([FRONT_PORT[0]] if front else []))]}}
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


def inference_service(settings: DeploySettings, plan: ServingPlan, image: str, scaling: Scaling) -> dict[str, Any]:
    """KServe's Triton runtime serving the repository from `deploy.storage_uri`, in this image (for the packages
    its Python models import), scaled by requests in flight per replica."""
    name = app_name(plan)
    return {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
            "metadata": {"name": name, "labels": {"app": name}},
            "spec": {"predictor": {
                "minReplicas": scaling.min_replicas, "maxReplicas": scaling.max_replicas,
                "scaleMetric": "concurrency", "scaleTarget": scaling.concurrency,
                "model": {"modelFormat": {"name": "triton"}, "protocolVersion": "v2", "runtime": KSERVE_RUNTIME,
                          "storageUri": settings.storage_uri or f"pvc://{name}-models/",
                          "image": image,
                          "resources": {"requests": {"cpu": "2", "memory": "4Gi"},
                                        "limits": {"memory": "8Gi", "nvidia.com/gpu": "1"}}}}}}


def deployment_files(settings: DeploySettings, plan: ServingPlan, repository: Path, repository_sha256: str,
                     scaling: Scaling, capacity: list[str], folder: Path, front: FrontSpec | None,
                     kind: HostKind | None = None) -> dict[str, Path]:
    """Every file in `folder` (deploy/), by FILES key; `capacity` is the README's lines on how the numbers were
    chosen; `front`: the API front's models, where the image runs it; `kind`: the host kind the run measured on,
    where it is a sweep cell (its Deployment is that kind's)."""
    image = image_tag(settings, plan, repository_sha256, front)
    with_front = front is not None
    texts = {"dockerfile": dockerfile(settings, plan, with_front), "docker": docker_script(image, with_front),
             **front_texts(front),
             "kubernetes": _yaml(*kubernetes_documents(plan, image, scaling, with_front, kind)),
             "adapter": _yaml({"rules": {"default": False, "custom": [adapter_rule(plan)]}}),
             "kserve": _yaml(inference_service(settings, plan, image, scaling)),
             "readme": readme(plan, repository, image, scaling, capacity, front)}
    return {key: write_text(folder / FILES[key], text) for key, text in texts.items()}


def front_section(front: FrontSpec | None) -> str:
    """The README's lines on the API front: what it answers and one request per model, or why it is not there."""
    if front is None:
        return ("No API front in this image: the repository has no embedding model or one-score reranker for it; "
                "clients speak Triton's protocol (HTTP 8000, gRPC 8001).\n")
    calls = []
    for model in front.models:
        body = ({"model": model.id, "query": "a query", "documents": ["a document", "another"]}
                if model.kind == "rerank" else {"model": model.id, "input": ["a text"]})
        path = "rerank" if model.kind == "rerank" else "embeddings"
        calls.append(f"curl -s localhost:{API_PORT}/v1/{path} -H 'Content-Type: application/json' "
                     f"-d '{json.dumps(body)}'")
    embedder = next((m.id for m in front.models if m.kind == "embeddings"), None)
    snippet = (f"""
```python
from openai import OpenAI
client = OpenAI(base_url="http://localhost:{API_PORT}/v1", api_key="none")
client.embeddings.create(model="{embedder}", input=["a text"]).data[0].embedding
```
""" if embedder else "")
    return (f"The image also runs the API front on port {API_PORT} (`deploy/{FRONT_FOLDER}/start.sh` starts "
            "tritonserver and it): OpenAI's `/v1/embeddings`, a Cohere-style `/v1/rerank`, `/v1/models` and "
            "`/health` (ready once Triton's models are: the pod's probes ask it). Set `WORKBENCH_API_KEY` in the "
            "container's environment to ask clients for `Authorization: Bearer <key>`.\n\n```bash\n"
            + "\n".join(calls) + f"\n```\n{snippet}")


def readme(plan: ServingPlan, repository: Path, image: str, scaling: Scaling,
           capacity: list[str], front: FrontSpec | None) -> str:
    name = app_name(plan)
    bullets = "\n".join(f"- {line}" for line in capacity)
    context = f" --build-context {FRONT_FOLDER}=deploy/{FRONT_FOLDER}" if front else ""
    return f"""# Deploying {plan.name}

Everything here was written from the serving plan the workbench verified (served parity) for `{repository}`.
The image bakes that repository in at `/models`, with the Python packages its models import pinned as the
workbench pins them: a pod needs no volume to fill and no package index to start.

Run the commands below from the run folder (the one holding `deploy/` and `{repository}`).

## Build and push the image

```bash
docker build -t {image} -f deploy/{FILES['dockerfile']}{context} {repository}
docker push {image}
```

The tag is a hash of the repository, the recipe and the front's files: rebuild after re-running the workbench and
the tag changes.
Another registry: `-p deploy.image_registry=registry.example.com/ml` when you run the workbench (or retag).

## One GPU host

```bash
./deploy/{FILES['docker']}
curl localhost:8000/v2/health/ready
```

{front_section(front)}
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
KServe's runtime starts tritonserver by its own command and routes one port, so an InferenceService answers
Triton's protocol only: the API front comes with the Deployment above.
KServe reads the repository from its `storageUri`: the folder there must hold what `{repository}` holds (its
model folders at the top, not `{repository}` itself). The default, `pvc://{name}-models/`, is a
PersistentVolumeClaim: copy the contents in with `kubectl cp {repository}/. <pod mounting the claim>:<mount>/`;
or `-p deploy.storage_uri=s3://bucket/{plan.name}` when you run the workbench, and `aws s3 sync {repository}/
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

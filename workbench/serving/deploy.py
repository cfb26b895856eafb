"""Files that serve a generated repository on GPU hosts: a `docker run` script and a Kubernetes manifest."""
from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from workbench.core.atomic import write_text
from workbench.core.config import Flavor, RunConfig
from workbench.core.pins import pin
from workbench.serving.repository import ServingPlan

CONTAINER_PACKAGES = ("transformers", "tokenizers")  # installed into NVIDIA's container as pyproject.toml pins them


class _PlainDumper(yaml.SafeDumper):
    """Writes a mapping used twice (the labels) out in full each time, as people write manifests, not as an
    anchor and alias."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def deployment_files(config: RunConfig, plan: ServingPlan, folder: Path) -> dict[str, Path]:
    """A `docker run` script for NVIDIA's Triton container and a Kubernetes Deployment + Service."""
    packages = [*CONTAINER_PACKAGES, *(["onnxruntime-gpu"] if plan.flavor is Flavor.PYTHON_ORT else [])]
    requirements = " ".join(shlex.quote(pin(name)) for name in packages)
    serve = f"pip install --quiet {requirements} && tritonserver --model-repository=/models"
    docker = ["docker", "run", "--rm", "--gpus", "all", "--shm-size=1g", "-p", "8000:8000", "-p", "8001:8001",
              "-p", "8002:8002", "-v", f'"$(realpath "$(dirname "$0")/../model_repository/{plan.name}")":/models',
              config.triton.container_image, "bash", "-c", shlex.quote(serve)]
    script = write_text(folder / "docker_run.sh", "#!/usr/bin/env bash\n# Serve this repository from NVIDIA's "
                        "Triton container on a GPU host (HTTP 8000, gRPC 8001, metrics 8002).\n" + " ".join(docker)
                        + "\n")
    labels = {"app": plan.name.replace("_", "-")}
    ports = [{"name": n, "containerPort": p} for n, p in (("http", 8000), ("grpc", 8001), ("metrics", 8002))]
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": labels["app"], "labels": labels},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": labels, "annotations": {"prometheus.io/scrape": "true",
                                                             "prometheus.io/port": "8002"}},
            "spec": {"containers": [{
                "name": "triton", "image": config.triton.container_image, "command": ["bash", "-c", serve],
                "ports": ports, "resources": {"limits": {"nvidia.com/gpu": 1}},
                "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": "http"},
                                   "initialDelaySeconds": 10, "periodSeconds": 5},
                "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": "http"}, "periodSeconds": 10},
                "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}]}],
                "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": f"{labels['app']}-models"}}]}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": labels["app"], "labels": labels},
               "spec": {"selector": labels, "ports": [{"name": p["name"], "port": p["containerPort"],
                                                       "targetPort": p["name"]} for p in ports]}}
    manifest = write_text(folder / "kubernetes.yaml",
                          "# Copy the repository into the PersistentVolumeClaim "
                          f"{labels['app']}-models, then kubectl apply -f this file.\n"
                          + yaml.dump_all([deployment, service], Dumper=_PlainDumper, sort_keys=False))
    return {"docker": script, "kubernetes": manifest}

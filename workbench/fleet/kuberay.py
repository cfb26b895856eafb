"""The same fleet sweep on Kubernetes through KubeRay: a RayCluster with one worker group per host kind (placed by
node-feature-discovery's labels, advertising the kind as `workbench node start` does) and a RayJob that runs
`workbench sweep --ray auto` on its head, the run folders landing on the claim the head mounts."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from workbench.core.atomic import write_marked
from workbench.core.errors import ConfigError
from workbench.models.pins import pin
from workbench.serving.hostkinds import host_kind
from workbench.sweep import Sweep

RAY_PORT = 6379
MANIFEST_MARK = "KubeRay: kubectl apply -f this file"  # the first line of every manifest written here


def _worker_group(sweep: Sweep, kind_name: str) -> dict[str, Any]:
    """One host kind's workers: on nodes of that kind only, each advertising it (one cell per worker at a time)."""
    settings = sweep.spec.kubernetes
    assert settings is not None
    kind = host_kind(kind_name)
    limits: dict[str, Any] = {"memory": settings.memory, **({"nvidia.com/gpu": settings.gpu or 1}
                                                            if kind.name == "gpu" else {})}
    spec: dict[str, Any] = {"nodeSelector": kind.node_selector(), "containers": [{
        "name": "ray-worker", "image": settings.image,
        "resources": {"requests": {"cpu": settings.cpu, "memory": settings.memory}, "limits": limits}}]}
    if kind.affinity():
        spec["affinity"] = kind.affinity()
    return {"groupName": kind.name.replace("_", "-"), "replicas": 1, "minReplicas": 1,
            "maxReplicas": max(1, settings.parallelism), "resources": {kind.resource: "1"},
            "rayStartParams": {}, "template": {"spec": spec}}


def manifests(sweep: Sweep) -> list[dict[str, Any]]:
    """The sweep file's ConfigMap, the RayCluster and the RayJob running the sweep on it."""
    settings = sweep.spec.kubernetes
    kinds = sweep.spec.ray.kinds if sweep.spec.ray else []
    if settings is None or not kinds:
        raise ConfigError(f"sweep file {sweep.path} needs `kubernetes:` (image, claim) and `ray: {{kinds: [...]}}` "
                          "for KubeRay manifests", "add both (docs/compare.md, 'A fleet')")
    name = sweep.name
    head = {"rayStartParams": {"num-cpus": "0"}, "template": {"spec": {
        "containers": [{"name": "ray-head", "image": settings.image,
                        "ports": [{"name": "gcs", "containerPort": RAY_PORT}],
                        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}},
                        "volumeMounts": [{"name": "sweep", "mountPath": "/sweep", "readOnly": True},
                                         {"name": "runs", "mountPath": "/runs"}]}],
        "volumes": [{"name": "sweep", "configMap": {"name": name}},
                    {"name": "runs", "persistentVolumeClaim": {"claimName": settings.claim}}]}}}
    cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": name},
               "spec": {"rayVersion": pin("ray").partition("==")[2], "headGroupSpec": head,
                        "workerGroupSpecs": [_worker_group(sweep, kind) for kind in kinds]}}
    job = {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": name},
           "spec": {"clusterSelector": {"ray.io/cluster": name},
                    "entrypoint": f"workbench sweep /sweep/{sweep.path.name} --ray auto --output-root /runs"}}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name},
                  "data": {sweep.path.name: sweep.text}}
    return [config_map, cluster, job]


def write_kuberay(sweep: Sweep, path: Path) -> Path:
    """The manifests in `path`; a file there that this command did not write is refused."""
    text = (f"# {len(sweep.runs)} runs of {sweep.path.name} on each host kind, {MANIFEST_MARK}; the run folders "
            "land on the claim; then `workbench compare` them.\n"
            + yaml.safe_dump_all(manifests(sweep), sort_keys=False))
    return write_marked(path, text, MANIFEST_MARK, "a manifest `workbench sweep --kuberay` wrote")

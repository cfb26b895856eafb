"""What a fleet deploys of one model: each host kind's Deployment and autoscaler (from the deploy step of the sweep
cell measured on that kind, serving the variant verified and fastest there), one Service and ServiceMonitor that
span the kinds."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from workbench.core.atomic import write_marked
from workbench.core.errors import MissingArtifactError
from workbench.core.record import RunRecord
from workbench.serving.deploy import HOST_KIND_LABEL

MANIFEST_MARK = "every host kind's Deployment: kubectl apply -f this file"
PER_KIND = ("Deployment", "HorizontalPodAutoscaler")


def fleet_documents(cell_dirs: list[Path]) -> list[dict[str, Any]]:
    """The per-kind documents of every cell that deployed, then the shared ones of the first; none when no cell's
    deploy step wrote files."""
    per_kind: list[dict[str, Any]] = []
    shared: list[dict[str, Any]] = []
    for cell in cell_dirs:
        try:
            path = RunRecord.load(cell).artifact("deploy.kubernetes")
        except MissingArtifactError:
            continue
        documents = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
        per_kind += [d for d in documents if d["kind"] in PER_KIND]
        shared = shared or [d for d in documents if d["kind"] not in PER_KIND]
    return per_kind + shared if per_kind else []


def write_fleet(run: str, cell_dirs: list[Path], path: Path) -> Path | None:
    """`run`'s fleet manifest in `path` (None: no cell deployed); a file there this did not write is refused."""
    documents = fleet_documents(cell_dirs)
    if not documents:
        return None
    kinds = ", ".join(str(d["metadata"]["labels"].get(HOST_KIND_LABEL, "?")) for d in documents
                      if d["kind"] == "Deployment")
    text = f"# {run} on host kinds {kinds}: {MANIFEST_MARK}\n" + yaml.safe_dump_all(documents, sort_keys=False)
    return write_marked(path, text, MANIFEST_MARK, "a fleet manifest the sweep wrote")

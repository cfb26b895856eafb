"""The files the triton step writes for GPU hosts: the Kubernetes manifest passes the Kubernetes schema, strictly."""
from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from workbench.serving.deploy import deployment_files
from workbench.steps.triton import serving_plan

from .test_triton import prepared

pytestmark = pytest.mark.slow
KUBERNETES = "1.37.0"  # the newest schemas kubernetes-validate (pinned in pyproject.toml) ships


def test_every_kubernetes_document_passes_the_schema(tiny_models, tmp_path):
    """Strict: an unknown or misspelled field fails too, not only a missing or mistyped one."""
    config, record = prepared(tiny_models["bert"], tmp_path / "run", tmp_path / "repos")
    plan, _ = serving_plan(config, record)
    manifest = deployment_files(config, plan, tmp_path / "triton")["kubernetes"]
    text = manifest.read_text()
    assert "&id" not in text and "*id" not in text, "written out in full, as people write manifests"
    documents = list(yaml.safe_load_all(text))
    assert [d["kind"] for d in documents] == ["Deployment", "Service"]
    for document in documents:
        assert kubernetes_validate.validate(document, KUBERNETES, strict=True) == "1.37", document["kind"]

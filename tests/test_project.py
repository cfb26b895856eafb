"""Promises about the project files themselves: notebooks, environment.yml vs pyproject."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tomllib
import yaml

from workbench.steplist import STEPS

ROOT = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[<>=!\[ ;]", requirement.strip(), maxsplit=1)[0].lower()


def test_environment_yml_names_the_gpu_stack_of_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    want = {r for r in project["dependencies"]} | {r for e in ("gpu", "serve", "generation", "dev") for r in extras[e]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    got = {r for r in pip if not r.startswith("-e")}
    assert {_name(r): r for r in got} == {_name(r): r for r in want}
    assert "onnxruntime" not in {_name(r) for r in got}, "onnxruntime must not sit beside onnxruntime-gpu"
    assert not set(map(_name, extras["cpu"])) & set(map(_name, extras["gpu"]))


@pytest.mark.parametrize("step", STEPS, ids=lambda s: s.name)
def test_step_notebook_is_clean_and_parameterized(step):
    notebook = json.loads((ROOT / "notebooks" / step.notebook).read_text())
    assert notebook["metadata"]["kernelspec"]["name"] == "python3"
    assert notebook["metadata"]["language_info"]["name"] == "python"
    code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert sum("parameters" in c["metadata"].get("tags", []) for c in code) == 1
    assert all(not c["outputs"] and c["execution_count"] is None for c in code)
    source = "".join("".join(c["source"]) for c in code)
    assert f"from workbench.steps import {step.name}" in source
    assert (ROOT / "workbench" / "steps" / f"{step.name}.py").is_file()


def test_readme_opens_with_the_two_commands_and_ci_runs_the_tests():
    readme = (ROOT / "README.md").read_text()
    head = readme[:600]
    assert "make demo" in head and "make test" in head
    assert "make test" in (ROOT / ".ci" / "run").read_text()

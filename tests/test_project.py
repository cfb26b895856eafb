"""Promises about the project files themselves: notebooks, environment.yml, version pins in one place."""
from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest
import tomllib
import yaml

from workbench.cli import main
from workbench.core.config import RunConfig
from workbench.models.pins import pin
from workbench.steps import specs, step_names

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!\[ ;]", requirement.strip(), maxsplit=1)[0].lower()


def _requirements() -> list[str]:
    return [*PYPROJECT["dependencies"], *(r for extra in PYPROJECT["optional-dependencies"].values() for r in extra)]


def test_environment_yml_installs_the_project_with_the_gpu_extras_and_pins_nothing_itself():
    extras = PYPROJECT["optional-dependencies"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = [d for d in env["dependencies"] if not isinstance(d, dict)]
    assert sorted(_name(d.split("=")[0]) for d in conda) == ["pip", "python"], "conda brings Python and pip only"
    assert [d for d in conda if d.startswith("python")] == ["python=3.11"]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert len(pip) == 1, f"the pip section installs the project and nothing beside it: {pip}"
    match = re.fullmatch(r"-e \.\[([\w,]+)\]", pip[0])
    assert match, f"not an editable install of this folder with extras: {pip[0]!r}"
    assert sorted(match.group(1).split(",")) == ["dev", "generation", "gpu", "serve"]
    assert set(match.group(1).split(",")) <= set(extras)
    assert not set(map(_name, extras["cpu"])) & set(map(_name, extras["gpu"])), "never onnxruntime beside -gpu"


def test_pins_come_from_pyproject():
    requirements = _requirements()
    assert {_name(r): pin(_name(r)) for r in requirements} == {_name(r): r for r in requirements}, \
        "the installed metadata differs from pyproject.toml: reinstall (make env)"
    assert pin("Nvidia_PyTriton") == pin("nvidia-pytriton")
    with pytest.raises(KeyError, match="not a requirement"):
        pin("no-such-package")


def test_no_pin_is_written_twice():
    """A pyproject.toml pin (name==version) appears nowhere else in the code or the environment file."""
    pinned = [r for r in _requirements() if "==" in r]
    files = [ROOT / "environment.yml", ROOT / "Makefile", *(ROOT / "workbench").rglob("*.py"),
             *(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "notebooks").glob("*.ipynb")]
    spellings = {r: {r, _name(r) + r[r.index("=="):]} for r in pinned}  # tritonclient[all]==v, tritonclient==v
    found = [(str(path.relative_to(ROOT)), r) for path in files for r in pinned
             if any(s in path.read_text() for s in spellings[r])]
    assert not found


@pytest.mark.parametrize("step", specs(), ids=lambda s: s.name)
def test_step_notebook_is_clean_and_parameterized(step):
    notebook = json.loads((ROOT / "notebooks" / step.notebook).read_text())
    assert notebook["metadata"]["kernelspec"]["name"] == "python3"
    assert notebook["metadata"]["language_info"]["name"] == "python"
    assert all(c.get("id") for c in notebook["cells"]), "nbformat 4.5 cells have ids (papermill warns without)"
    code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert sum("parameters" in c["metadata"].get("tags", []) for c in code) == 1
    assert all(not c["outputs"] and c["execution_count"] is None for c in code)
    source = "".join("".join(c["source"]) for c in code)
    assert f"from workbench.steps import {step.name}" in source and f"{step.name}.run(cfg, record)" in source
    assert "record.data" not in source, "notebooks read the record through its typed readers"
    assert "".join(notebook["cells"][0]["source"]).startswith(f"# {step.number:02d} · ")


def test_one_word_names_each_step_everywhere(capsys):
    """--steps, `workbench steps`, the notebooks (numbered in run order), the modules and the README agree."""
    assert sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb")) == [s.notebook for s in specs()]
    assert [s.number for s in specs()] == list(range(1, len(specs()) + 1)), (
        "the package's steps are numbered 1..N: a step added to it takes the next number and the later steps (and "
        "their notebooks) move up; only a plug-in step ($WORKBENCH_STEPS_PATH) shares the number of the one it "
        "follows (docs/contributing.md)")
    steps = ROOT / "workbench" / "steps"  # a module per step, or a package where the step has several jobs
    modules = {p.stem for p in steps.glob("*.py")} - {"__init__"} | {p.parent.name for p in steps.glob("*/__init__.py")}
    assert modules == set(step_names())
    for step in specs():
        module = importlib.import_module(f"workbench.steps.{step.name}")
        assert module.SPEC is step and module.__doc__.startswith(f"The {step.name} step: ")
    assert main(["steps"]) == 0
    listed = [line.split()[:2] for line in capsys.readouterr().out.splitlines()]
    assert listed == [[s.name, f"notebooks/{s.notebook}"] for s in specs()]
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| `notebooks/(\S+)` \|", readme, re.MULTILINE)
    assert rows == [(s.name, s.notebook) for s in specs()]
    assert RunConfig(steps=list(reversed(step_names()))).steps == list(step_names())


def test_steps_do_not_import_steps_and_only_record_reads_the_raw_record():
    """A step module may import the declarations' package (StepSpec, specs), never another step."""
    names = "|".join(step_names())
    for path in (ROOT / "workbench").rglob("*.py"):
        text = path.read_text()
        if path.parent.name == "steps":
            assert not re.search(rf"workbench\.steps\.({names})\b|from workbench\.steps import .*\b({names})\b",
                                 text), path
        if path.name != "record.py":
            assert not re.search(r"record\.data\b|\.data\[\"(steps|metrics|artifacts)", text), path


def test_docs_pages_are_a_few_screens_and_results_live_in_pages_of_their_own():
    """A guide page says what to run and how to read it in at most about 300 lines; measured tables from particular
    days and hosts live in docs/results/, each page naming its date and host."""
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "docs").rglob("*.md"))
            if (n := len(p.read_text().splitlines())) > 310}
    assert not long, long
    results = sorted((ROOT / "docs" / "results").glob("*.md"))
    assert len(results) > 3
    for page in results:
        if page.name != "README.md":
            assert re.search(r"20\d\d-\d\d-\d\d", page.read_text()) and "host" in page.read_text(), page


def test_readme_opens_with_the_two_commands_and_ci_runs_the_tests():
    readme = (ROOT / "README.md").read_text()
    head = readme[:600]
    assert "make demo" in head and "make test" in head
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_readme_and_docs_pages_link_only_to_what_exists():
    """Every relative link of README.md and docs/*.md, and every repository path they name in backticks, exists."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert len(pages) > 5 and len((ROOT / "README.md").read_text()) < 12_000, "the README is the front door"
    broken = []
    for page in pages:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not target.startswith(("http://", "https://")) and not (page.parent / target).exists():
                broken.append(f"{page.name}: link {target}")
        for path in re.findall(r"`((?:workbench|tests|benchmarks|notebooks|docs)/[\w./-]*)`", text):
            if not (ROOT / path).exists():
                broken.append(f"{page.name}: path {path}")
    assert not broken

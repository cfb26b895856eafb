"""The notebooks as users run them: JupyterLab's way (nbclient, defaults, the notebook's own folder) and papermill's."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import papermill
import pytest
from nbclient import NotebookClient
from papermill.exceptions import PapermillExecutionError

from workbench.core.config import OUTPUTS_VARIABLE, RunConfig
from workbench.core.errors import ConfigError
from workbench.pipeline import pristine
from workbench.report.notebook import (
    NOTEBOOKS_DIR,
    PARAMETERS,
    SHIPPED_NOTEBOOKS,
    config_from,
    injected_cell,
    notebooks_dir,
    parameters_cell,
    refuse_unknown_injected,
    start,
)
from workbench.serving.server import free_port
from workbench.steps import specs

DEFAULT_SLUG = RunConfig().model_slug


def test_every_notebook_has_the_generated_parameters_cell():
    for step in specs():
        notebook = nbformat.read(NOTEBOOKS_DIR / step.notebook, as_version=4)
        cells = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
        assert [c.source for c in cells] == [parameters_cell()], \
            f"{step.notebook}: run workbench steps --write-parameter-cells"
        assert "verdict_line(" in notebook.cells[-1].source, step.notebook  # it ends with its verdict line


def test_papermill_lists_the_typed_parameters():
    notebook = str(NOTEBOOKS_DIR / specs()[0].notebook)
    shown = subprocess.run([sys.executable, "-m", "papermill", "--help-notebook", notebook], capture_output=True,
                           text=True, check=True).stdout
    assert "precisions: list or auto (default None)" in shown and "(new run: 'auto')" in shown
    assert "sequence_max: int or auto (default None)" in shown
    assert "batch_max: int (default None)" in shown and "largest (new run: 32)" in shown
    assert "config: dict (default {})" in shown


def test_named_parameters_override_config_and_strings_are_read_as_yaml():
    cfg = config_from({"config": '{"opset": 16, "batch": {"max": 16}, "precisions": ["fp16"]}',
                       "precisions": "[fp32, int8]", "batch_max": None, "batch_opt": 8, "sequence_opt": 32,
                       "sequence_max": "64", "model": "here"})
    assert cfg.opset == 16 and cfg.precisions == ["fp32", "int8"] and cfg.model == "here"
    assert cfg.batch.max == 16  # batch_max left None: config's value stands
    assert cfg.sequence.max == 64
    assert config_from({"config": "opset: 18"}).opset == 18


def test_a_setting_changed_in_one_notebook_reaches_the_next_and_the_record_says_who_set_it(tmp_path, monkeypatch,
                                                                                          capsys):
    monkeypatch.setenv(OUTPUTS_VARIABLE, str(tmp_path))
    cfg, record = start({"sequence_max": 128}, "export")
    assert cfg.sequence.max == 128 and record.run_dir == tmp_path / f"interactive-{DEFAULT_SLUG}"
    assert "sequence.max 128 (01_export.ipynb)" in capsys.readouterr().out
    with record.step("export"):
        pass

    cfg, record = start({}, "optimize")  # every parameter None: the run's settings stand
    opened = capsys.readouterr().out
    assert cfg.sequence.max == 128 and record.config.sequence.max == 128
    assert "done: export" in opened and "sequence.max 128 (01_export.ipynb)" in opened
    assert "changed here: nothing" in opened and record.status("export") == "ok"

    cfg, record = start({"sequence_max": 64, "config": {"optimize": {"int8": {"per_channel": False}}}}, "optimize")
    opened = capsys.readouterr().out
    assert cfg.sequence.max == 64 and record.status("export") == "stale"
    assert "it ran with other settings: sequence.max 128 -> 64" in record.step_entry("export").detail
    assert "now stale, run their notebooks again: export" in opened and "sequence.max 128 -> 64" in opened
    assert record.set_by("sequence.max") == "02_optimize.ipynb"
    _, record = start({"sequence_max": 128}, "optimize")  # changed back: what export ran with is the run's again
    assert record.status("export") == "ok"
    _, record = start({"sequence_max": 64}, "optimize")
    with record.step("export"):
        pass  # export again: ok, and a setting of optimize's own does not make it stale
    assert record.status("export") == "ok" and record.config.optimize.int8.per_channel is False
    _, record = start({"config": {"tolerances": {"sentence_embedding": {"min_cosine": 0.98}}}}, "parity")
    assert record.status("export") == "ok"  # tolerances: parity reads them first


def test_the_command_runs_the_template_with_its_own_parameters_cell_whatever_was_saved(tmp_path, capsys):
    edited = nbformat.read(NOTEBOOKS_DIR / specs()[0].notebook, as_version=4)
    cell = next(c for c in edited.cells if "parameters" in c.metadata.get("tags", []))
    cell.source = "sequence_max = 128\nrun_dir = None"
    edited.cells[2].outputs = [nbformat.v4.new_output("stream", text="an earlier run")]
    nbformat.write(edited, tmp_path / "saved.ipynb")
    (tmp_path / "run").mkdir()
    copy = nbformat.read(pristine(tmp_path / "saved.ipynb", tmp_path / "run"), as_version=4)
    assert [c.source for c in copy.cells if "parameters" in c.metadata.get("tags", [])] == [parameters_cell()]
    assert not [c for c in copy.cells if c.get("outputs")]
    warned = capsys.readouterr().err
    assert "saved.ipynb's saved parameters are not used (sequence_max = 128; run_dir = None)" in warned
    assert "pass yours with -p (-p sequence.max=128)" in warned


def test_the_templates_are_the_checkouts_notebooks_else_those_a_wheel_installed(tmp_path):
    assert notebooks_dir() == NOTEBOOKS_DIR and (NOTEBOOKS_DIR / specs()[0].notebook).is_file()
    assert notebooks_dir(tmp_path) == SHIPPED_NOTEBOOKS  # a site-packages install has no notebooks/ beside it


@pytest.mark.parametrize("config, problem", [("[1, 2]", "holds a list"), ("{opset: [", "not valid YAML"),
                                             (7, "holds a int")])
def test_a_config_that_is_not_a_mapping_is_refused(config, problem):
    with pytest.raises(ConfigError, match=problem) as caught:
        config_from({"config": config})
    assert "-p config" in caught.value.fix


def test_an_unknown_injected_parameter_is_refused_with_the_closest_name():
    injected = "# Parameters\nprecisionz = '[fp32]'\nrun_dir = '/tmp/x'\n"
    with pytest.raises(ConfigError, match="'precisionz': did you mean 'precisions'"):
        refuse_unknown_injected([injected, "cfg, record = start(globals())"])
    refuse_unknown_injected(["# Parameters\nprecisions = '[fp32]'\n", "start"])  # known: accepted
    refuse_unknown_injected(["x = 1\n", "start"])  # not papermill's cell (an interactive session): not judged
    assert injected_cell([parameters_cell(), "start"]) is None  # the notebooks' own parameters cell, run in Lab
    assert {p.name for p in PARAMETERS} >= {"model", "task", "precisions", "batch_max", "sequence_max", "corpus"}


@pytest.mark.slow
def test_a_copied_notebook_runs_like_jupyterlab_and_writes_under_its_folder(tmp_path, monkeypatch):
    """nbclient with the default parameters, in the notebook's own folder, as JupyterLab's kernel runs it."""
    monkeypatch.delenv(OUTPUTS_VARIABLE, raising=False)
    copies = tmp_path / "my-notebooks"
    copies.mkdir()
    for step in specs()[:2]:
        shutil.copy(NOTEBOOKS_DIR / step.notebook, copies)
        notebook = nbformat.read(copies / step.notebook, as_version=4)
        NotebookClient(notebook, kernel_name="python3", timeout=600,
                       resources={"metadata": {"path": str(copies)}}).execute()
        assert not [o for c in notebook.cells for o in c.get("outputs", []) if o.get("name") == "stderr"], \
            f"{step.notebook} printed warnings"
    run = copies / "outputs" / f"interactive-{DEFAULT_SLUG}"
    record = json.loads((run / "run.json").read_text())
    assert {n: s["status"] for n, s in record["steps"].items()} == {"export": "ok", "optimize": "ok"}
    assert "Attention fused in 6 of 6 layers" in notebook.cells[-1].outputs[0]["text"]

    monkeypatch.setenv(OUTPUTS_VARIABLE, str(tmp_path / "elsewhere"))
    notebook = nbformat.read(copies / specs()[0].notebook, as_version=4)
    NotebookClient(notebook, kernel_name="python3", timeout=600,
                   resources={"metadata": {"path": str(copies)}}).execute()
    assert (tmp_path / "elsewhere" / f"interactive-{DEFAULT_SLUG}" / "run.json").is_file()


@pytest.mark.slow
def test_papermill_typed_parameters_run_and_an_unknown_one_is_refused(tiny_bert, tmp_path):
    notebook = str(NOTEBOOKS_DIR / specs()[0].notebook)
    run_dir = tmp_path / "run"
    papermill.execute_notebook(notebook, str(tmp_path / "out.ipynb"), kernel_name="python3", progress_bar=False,
                               parameters={"model": str(tiny_bert), "precisions": "[fp32]", "batch_opt": 2,
                                           "batch_max": 4, "config": "{opset: 16}", "run_dir": str(run_dir)})
    config = json.loads((run_dir / "run.json").read_text())["config"]
    assert (config["precisions"], config["batch"]["max"], config["opset"]) == (["fp32"], 4, 16)

    refused = tmp_path / "refused"
    with pytest.raises(PapermillExecutionError, match="did you mean 'precisions'"):
        papermill.execute_notebook(notebook, str(tmp_path / "bad.ipynb"), kernel_name="python3", progress_bar=False,
                                   parameters={"model": str(tiny_bert), "precisionz": "[fp32]",
                                               "run_dir": str(refused)})
    assert not refused.exists()  # refused before anything was written


@pytest.mark.slow
def test_make_lab_opens_working_copies_beside_the_runs_and_keeps_the_users(tmp_path):
    """As root too (containers): `make lab` must not stop at JupyterLab's root check."""
    port, token = free_port(), "workbench-test"
    repo, outputs = NOTEBOOKS_DIR.parent, tmp_path / "outputs"
    mine = outputs / "lab" / specs()[0].notebook
    mine.parent.mkdir(parents=True)
    edited = nbformat.read(NOTEBOOKS_DIR / specs()[0].notebook, as_version=4)
    edited.cells.append(nbformat.v4.new_code_cell("print('my own cell')"))
    nbformat.write(edited, mine)
    args = f"--no-browser --port={port} --ServerApp.ip=127.0.0.1 --IdentityProvider.token={token}"
    lab = subprocess.Popen(["make", "-s", "-C", str(repo), "lab", f"ARGS={args}"], stdout=open(tmp_path / "out", "w"),
                           stderr=open(tmp_path / "lab.log", "w"), start_new_session=True,
                           env={**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
                                OUTPUTS_VARIABLE: str(outputs)})
    try:
        root = poll_json(f"http://127.0.0.1:{port}/api/contents?token={token}", lab, tmp_path / "lab.log")
        assert {"lab"} <= {item["name"] for item in root["content"]}
        listing = poll_json(f"http://127.0.0.1:{port}/api/contents/lab?token={token}", lab, tmp_path / "lab.log")
        assert {step.notebook for step in specs()} <= {item["name"] for item in listing["content"]}
        assert "my own cell" in mine.read_text()  # the user's copy is theirs
        assert f"kept your edited lab/{specs()[0].notebook}" in (tmp_path / "out").read_text()
    finally:
        os.killpg(lab.pid, signal.SIGTERM)
        lab.wait(timeout=60)


def poll_json(url: str, process: subprocess.Popen, log: Path) -> dict:
    """The JSON at `url` once the server answers; fails with the server's log if it exits first."""
    for _ in range(600):
        if process.poll() is not None:
            pytest.fail(f"JupyterLab exited ({process.returncode}): {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                return json.load(answer)
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"JupyterLab did not answer at {url}: {log.read_text()[-2000:]}")

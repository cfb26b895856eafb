"""The command line's own answers: --version, run --help, and `workbench doctor` on this machine."""
from __future__ import annotations

import re
import shutil
from importlib import metadata

import pytest

from workbench.cli import main
from workbench.core.config import RunConfig
from workbench.core.errors import ConfigError
from workbench.core.machine import gpu_name, package_version
from workbench.core.record import RunRecord
from workbench.doctor import GPU, Finding, run_checks, step_support
from workbench.models.pins import PROJECT
from workbench.steps import specs, step_names

needs_no_gpu = pytest.mark.skipif(gpu_name() is not None, reason="checks what doctor says on machines without a GPU")


def test_version_is_the_installed_distribution_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"workbench {metadata.version(PROJECT)}\n"


def test_run_help_lists_every_step_and_two_examples(capsys):
    with pytest.raises(SystemExit) as done:
        main(["run", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    listed = re.findall(r"^  (\w+) +\S", out.split("steps, in run order")[1].split("examples:")[0], re.MULTILINE)
    assert tuple(listed) == step_names()
    assert "workbench run --steps export,optimize" in out
    assert "workbench run --resume --output-dir outputs/<run> --steps tensorrt" in out


@needs_no_gpu
def test_doctor_reports_what_this_machine_lacks_and_has(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  tensorrt +skipped here: needs an NVIDIA GPU$", out, re.MULTILINE)
    assert re.search(r"^  report +runs here$", out, re.MULTILINE)
    found = {finding.name: finding for finding in run_checks()}
    assert {name for step in specs() for name in step.machine} <= set(found)
    assert len(re.findall(r"^  \S.* (found|missing) ", out, re.MULTILINE)) == len(found)
    assert not found[GPU].available and found[GPU].fix.startswith("needs an NVIDIA GPU")
    cuda = found["onnxruntime CUDA EP"]
    assert not cuda.available and "CUDAExecutionProvider" in cuda.reason and "needs an NVIDIA GPU" in cuda.fix
    assert found["onnxruntime CPU EP"].available
    tensorrt = found["tensorrt"]
    assert not tensorrt.available and tensorrt.reason == "not installed" and "[gpu]" in tensorrt.fix
    triton = found["tritonserver"]
    assert triton.available and triton.version
    if shutil.which("tritonserver") is None:  # the server bundled in the nvidia-pytriton wheel
        assert triton.version == f"nvidia-pytriton {package_version('nvidia-pytriton')}"
    assert found["torch"].version == package_version("torch")


def test_steps_need_known_checks_and_a_missing_gpu_is_named_first():
    findings = [Finding(name, True, "1") for name in {n for step in specs() for n in step.machine}]
    lacking = {"tritonserver", GPU, "tensorrt"}
    support = {s.step: s for s in step_support([f for f in findings if f.name not in lacking] +
                                               [Finding(name, False, reason="absent", fix="x") for name in lacking])}
    assert support["tensorrt"].reason == "needs an NVIDIA GPU" and not support["tensorrt"].runs
    assert support["triton"].reason == "needs tritonserver" and support["generation"].reason == "needs tritonserver"
    assert [s for s, entry in support.items() if entry.runs] == ["export", "optimize", "parity", "bench", "deploy",
                                                                 "report"]


@pytest.mark.slow
def test_a_setting_passed_on_resume_mends_a_stored_one_that_no_longer_loads(tmp_path, capsys):
    record = RunRecord.create(tmp_path / "run", RunConfig())
    record.data["config"]["parity"]["repair"]["budget_s"] = None  # as an older workbench recorded `.inf`
    record.save()
    resume = ["run", "--resume", "--output-dir", str(tmp_path / "run"), "--steps", "report", "--quiet"]
    assert main(resume) == 2
    assert "parity.repair.budget_s: Input should be a valid number or Input should be 'auto' (got None)" in \
        capsys.readouterr().err
    assert main([*resume, "-p", "parity.repair.budget_s=100"]) == 0
    assert RunRecord.load(tmp_path / "run").config.parity.repair.budget_s == 100
    with pytest.raises(ConfigError, match=r"parity.repair.budget_s: Input should be a finite number") as refused:
        RunConfig.load(overrides=["parity.repair.budget_s=.inf"])  # never recorded again
    assert refused.value.fix == "set parity.repair.budget_s to a valid value: a number, or auto"


def test_a_moved_setting_is_taken_with_one_line_naming_its_new_key(capsys):
    assert main(["config", "-p", "openvino=never"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "note: setting 'openvino' is now 'optimize.openvino' (the old key still works)\n"
    assert "openvino: never" in captured.out

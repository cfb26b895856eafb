"""A step declares itself once: a throwaway step, one module and one notebook added in a folder of their own, runs
in order, is preflighted, gets its notebook name, verdict line, typed metrics and report section, and no other module
changes."""
from __future__ import annotations

import shutil
import sys
import textwrap

import nbformat
import pytest

from workbench.cli import main
from workbench.core.config import RunConfig
from workbench.core.errors import ConfigError, MissingArtifactError
from workbench.pipeline import NOTEBOOKS_DIR, run_pipeline
from workbench.preflight import preflight
from workbench.report.page import build_report
from workbench.steps import STEPS_PATH, StepSpec, discover, spec, specs, step_names, verdict_line

PROBE = '''
    """The probe step: a throwaway step declared in its own module, for tests/test_declarations.py."""
    from workbench.core.config import StepSettings
    from workbench.core.errors import ConfigError
    from workbench.core.metrics import Metrics
    from workbench.report.page import Section
    from workbench.steps import StepSpec

    STEP = "probe"


    class ProbeSettings(StepSettings):
        factor: int = 1


    class ProbeMetrics(Metrics):
        export_nodes: int


    def check(config):
        if config.seed == 13:
            raise ConfigError("the probe step refuses seed 13", "use another seed")


    def run(config, record):
        with record.step(STEP):
            record.set_metric(STEP, {"export_nodes": record.metric("export.nodes") * ProbeSettings.of(config).factor})
        return record.step_entry(STEP)


    def lines(record):
        return [f"probe: export wrote {record.metric('probe.export_nodes')} nodes"]


    def section(metrics: ProbeMetrics):
        return [("Probe", f"The probe read {metrics.export_nodes} export nodes.", [])]


    SPEC = StepSpec(STEP, NUMBER, "a throwaway step", run, lines, sections=(Section("Probe", section),), check=check,
                    reads=("export",), owns=("probe",), metrics=ProbeMetrics, settings=ProbeSettings, after=AFTER)
'''


@pytest.fixture
def probe(request, tmp_path, monkeypatch):
    """The probe module in a folder of its own on the steps package's path, declared at (number, after) (default:
    10, after report); its notebook beside copies of the others. Both go when the test ends."""
    number, after = getattr(request, "param", (10, "report"))
    folder = tmp_path / "more_steps"
    folder.mkdir()
    declared = textwrap.dedent(PROBE).replace("NUMBER", str(number)).replace("AFTER", repr(after))
    (folder / "probe.py").write_text(declared, encoding="utf-8")
    notebooks = tmp_path / "notebooks"
    shutil.copytree(NOTEBOOKS_DIR, notebooks)
    book = nbformat.read(NOTEBOOKS_DIR / "01_export.ipynb", as_version=4)
    parameters = next(c for c in book.cells if "parameters" in c.metadata.get("tags", []))
    book.cells = [nbformat.v4.new_markdown_cell(f"# {number:02d} · Probe"), parameters, nbformat.v4.new_code_cell(
        "from workbench.report.notebook import start\nfrom workbench.steps import spec, verdict_line\n"
        "cfg, record = start(globals())\nspec('probe').run(cfg, record)\nprint(verdict_line('probe', record))")]
    nbformat.write(book, notebooks / f"{number:02d}_probe.ipynb")
    monkeypatch.setenv(STEPS_PATH, str(folder))  # the kernels of the run inherit it
    discover()
    yield notebooks
    monkeypatch.delenv(STEPS_PATH)
    sys.modules.pop("workbench.steps.probe")  # the next probe may be declared elsewhere in the run order
    discover()
    assert "probe" not in step_names() and "probe" not in RunConfig().sections()


def test_a_new_step_is_one_module_and_one_notebook(probe, tiny_bert, tmp_path, capsys):
    assert step_names()[-1] == "probe" and spec("probe").notebook == "10_probe.ipynb"
    config = RunConfig.load(values={"model": str(tiny_bert), "steps": ["probe", "export"], "precisions": ["fp32"],
                                    "sequence.opt": 32, "sequence.max": 64}, overrides=["probe.factor=3"])
    assert config.steps == ["export", "probe"], "in the order the declarations give"
    assert main(["steps"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("a throwaway step (settings: probe.*)")
    with pytest.raises(ConfigError, match="unknown setting 'probe.factr' \\(did you mean 'probe.factor'\\?\\)"):
        RunConfig.load(overrides=["probe.factr=2"])
    with pytest.raises(ConfigError, match="the probe step refuses seed 13"):
        preflight(config.model_copy(update={"seed": 13}))
    with pytest.raises(MissingArtifactError, match="the probe step reads what the export step writes"):
        preflight(config.model_copy(update={"steps": ["probe"]}))
    record = run_pipeline(config, tmp_path / "run", progress=False, notebooks_dir=probe)
    assert [(s.name, s.status) for s in record.step_entries()] == [("export", "ok"), ("probe", "ok")]
    nodes = record.metric("export.nodes") * 3
    assert record.settings["probe"] == {"factor": 3}, "its section, in run.json as the run's others"
    assert verdict_line("probe", record) == f"probe: export wrote {nodes} nodes"
    assert (tmp_path / "run" / "notebooks" / "10_probe.ipynb").is_file()
    page = build_report(record, tmp_path / "report.html", specs()).read_text()
    assert f"<h2>Probe</h2>\n<p>The probe read {nodes} export nodes.</p>" in page


@pytest.mark.parametrize("probe", [(5, "triton")], indirect=True)
def test_a_step_goes_in_between_two_others_and_no_notebook_is_renamed(probe, tiny_bert, tmp_path):
    before = {s.name: s.notebook for s in specs() if s.name != "probe"}
    assert before == {path.name.split("_", 1)[1].removesuffix(".ipynb"): path.name
                      for path in NOTEBOOKS_DIR.glob("*.ipynb")}, "every real step keeps its notebook"
    names = step_names()
    assert names[names.index("triton") + 1:names.index("triton") + 3] == ("probe", "generation")
    assert spec("probe").notebook == "05_probe.ipynb"
    # its notebook beside its module: the run finds it there, the others in the checkout's notebooks/
    shutil.move(probe / "05_probe.ipynb", tmp_path / "more_steps" / "05_probe.ipynb")
    config = RunConfig.model_validate({"model": str(tiny_bert), "steps": ["probe", "export"], "precisions": ["fp32"],
                                       "sequence": {"min": 1, "opt": 32, "max": 64}})
    record = run_pipeline(config, tmp_path / "run", progress=False)
    assert [(s.name, s.status) for s in record.step_entries()] == [("export", "ok"), ("probe", "ok")]
    assert (tmp_path / "run" / "notebooks" / "05_probe.ipynb").is_file()


def test_a_step_placed_before_what_it_reads_is_refused():
    from workbench.core.registry import run_order

    first, second, third = (StepSpec(name, number, name, run=lambda c, r: None, takeaway=lambda r: [], after=after,
                                     reads=reads)
                            for name, number, after, reads in (("a", 1, None, ()), ("b", 1, "a", ("c",)),
                                                               ("c", 2, "a", ())))
    assert [s.name for s in run_order([third, first])] == ["a", "c"]
    with pytest.raises(RuntimeError, match="the b step reads c, which would run after it"):
        run_order([first, second, third])
    with pytest.raises(RuntimeError, match="steps that follow no registered step: d"):
        run_order([first, StepSpec("d", 3, "d", run=lambda c, r: None, takeaway=lambda r: [], after="gone")])

"""The report step: render run.json into one self-contained report.html; it measures nothing, so it is fast and
can run any number of times."""
from __future__ import annotations

from workbench.core.catalog import StepSpec, specs
from workbench.core.config import RunConfig
from workbench.core.record import RunRecord, StepEntry
from workbench.report.page import build_report
from workbench.report.takeaways import report_lines

STEP = "report"


def run(config: RunConfig, record: RunRecord) -> StepEntry:
    """Write report.html from what the record holds; each missing section names the step that fills it."""
    with record.step(STEP):
        path = build_report(record, record.run_dir / "report.html", specs())
        record.add_artifact(STEP, path, kind="report")
    return record.step_entry(STEP)


SPEC = StepSpec(STEP, 9, "render run.json into one self-contained report.html", run, report_lines, writes=0.1)

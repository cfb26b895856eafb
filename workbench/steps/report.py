"""The report step: render run.json into one self-contained report.html; it measures nothing, so it is fast and
can run any number of times."""
from __future__ import annotations

from workbench.core.config import RunConfig
from workbench.core.record import RunRecord, StepEntry
from workbench.report.page import build_report
from workbench.report.recommend import recommend
from workbench.report.takeaways import disturbed_lines
from workbench.steps import StepSpec, specs

STEP = "report"


def run(config: RunConfig, record: RunRecord) -> StepEntry:
    """Write report.html from what the record holds; each missing section names the step that fills it."""
    with record.step(STEP):
        path = build_report(record, record.run_dir / "report.html", specs())
        record.add_artifact(STEP, path, kind="report")
    return record.step_entry(STEP)


def lines(record: RunRecord) -> list[str]:
    """The verdict line: the recommendation per goal, and where the page is."""
    return [*disturbed_lines(record), *(r.line(record.run_dir) for r in recommend(record)),
            f"report: {record.run_dir / 'report.html'}"]


SPEC = StepSpec(STEP, 9, "render run.json into one self-contained report.html", run, lines, writes=0.1,
                after="deploy")

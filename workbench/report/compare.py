"""Many runs side by side (`workbench compare`): per run and variant, the parity verdict and its margin, size on
disk, in-process latency and throughput at cells every run of its host measured, served throughput and p99 where
measured; per host group and goal, the (model, variant) to deploy with the rule that chose it. Runs from different
hosts or devices are grouped apart and never compared."""
from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import jinja2
import plotly.graph_objects as go
from pydantic import ValidationError

from workbench.core.advice import run_again
from workbench.core.atomic import write_text
from workbench.core.errors import ConfigError, OutputDirError
from workbench.core.record import RECORD_NAME, RunRecord, StepStatus, ensure_writable
from workbench.measure.latency import is_variant_row
from workbench.measure.settings import BenchSettings
from workbench.measure.tables import BenchMetrics, CellTiming
from workbench.models.batches import Cell
from workbench.report import figures
from workbench.report.recommend import gate, goal_cells
from workbench.serving.tables import TritonMetrics

TEMPLATE = Path(__file__).parent / "templates" / "compare.html.j2"
ACCURACY_FLOOR = 0.999  # the accuracy goal: min cosine (or label agreement) at least this against the reference
FILES = ("compare.html", "compare.csv", "compare.json")


@dataclass
class Row:
    """One variant of one run, as compared."""

    run: str
    model: str
    host: str
    variant: str
    precision: str | None
    passed: bool
    gate: str | None  # the criterion with the least margin, e.g. "min cosine"
    value: float | None
    margin: float | None
    agreement_at_1: float | None
    size_mb: float | None
    latency_ms: float | None = None  # median ms at the group's latency cell
    latency_speedup: float | None = None
    throughput: float | None = None  # sequences/s at the group's throughput cell
    throughput_speedup: float | None = None
    served_rps: float | None = None
    served_p99_ms: float | None = None
    cells: dict[str, CellTiming] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Pick:
    goal: str
    rule: str
    run: str | None = None
    model: str | None = None
    variant: str | None = None
    value: str = ""
    reason: str = ""


@dataclass
class Group:
    host: str
    rows: list[Row]
    latency_cell: str | None
    throughput_cell: str | None
    picks: list[Pick]
    unmeasured: list[str] = field(default_factory=list)  # runs with no bench: in the table, never picked


def find_runs(paths: list[Path]) -> list[Path]:
    """Run folders: each path that holds a run.json, or the run folders one level inside it (a sweep root)."""
    found: list[Path] = []
    for path in paths:
        inside = [path] if (path / RECORD_NAME).is_file() else sorted(p.parent for p in path.glob(f"*/{RECORD_NAME}"))
        if not inside:
            raise ConfigError(f"{path} is neither a run folder nor a folder of runs (no run.json in or under it)",
                              "pass run folders (each holds a run.json) or a sweep's output root")
        found += [p for p in (folder.resolve() for folder in inside) if p not in found]
    return found


def run_labels(run_dirs: list[Path]) -> dict[Path, str]:
    """Each run's name in the tables: its folder's name, with as many parent folders as tell it from the other
    runs' (`a/full` and `b/full` for two sweeps' `full` runs)."""
    depth = {run_dir: 1 for run_dir in run_dirs}
    while True:
        labels = {run_dir: "/".join(run_dir.parts[-depth[run_dir]:]) for run_dir in run_dirs}
        seen: dict[str, list[Path]] = {}
        for run_dir, label in labels.items():
            seen.setdefault(label, []).append(run_dir)
        clashes = [run_dir for same in seen.values() if len(same) > 1 for run_dir in same
                   if depth[run_dir] < len(run_dir.parts)]
        if not clashes:
            return labels
        for run_dir in clashes:
            depth[run_dir] += 1


def host_of(record: RunRecord) -> str:
    """The machine and device a run measured on: runs are compared only with runs on the same one. A sweep cell's
    names its node's host kind first (two kinds are two groups, even on one machine)."""
    env = record.environment
    int8 = env.int8_dot_product or "no int8 dot product"
    device = record.config.device if record.config.device != "auto" else ("cuda" if env.gpu else "cpu")
    machine = f"{env.cpu} ({env.cpu_count} cores, {int8}), GPU {env.gpu or 'none'}, {device}"
    if env.node is None:
        return machine
    return f"host kind {env.node.kind}{' (told)' if env.node.told else ''}: {machine}"


def kind_of_host(host: str) -> str | None:
    """The host kind a group's host names (None: not a sweep cell's)."""
    return host.split(":", 1)[0].removeprefix("host kind ").removesuffix(" (told)") \
        if host.startswith("host kind ") else None


def rows_of(record: RunRecord, name: str) -> list[Row]:
    """Every variant with a parity verdict in the run, with what was measured of it."""
    bench = record.results_as("bench", BenchMetrics) if record.status("bench") == StepStatus.OK else None
    cells = bench.latency.cells if bench and bench.latency else {}
    served = bench.served if bench else None
    try:
        deployment = record.current(TritonMetrics)
    except ValidationError:  # a damaged triton section: nothing is known to be deployed
        deployment = None
    deployed = deployment.variant if deployment else None
    level = served.best_level(BenchSettings.of(record.config).p99_limit_ms) if served else None
    rows = []
    for variant, verdict in record.verdicts().items():
        least = gate(verdict)
        size = record.artifact_bytes(f"onnx.{variant}") or record.artifact_bytes(f"engine.{variant}")
        rows.append(Row(
            name, record.config.model, host_of(record), variant, verdict.precision, verdict.passed,
            least.metric if least else None, least.value if least else None, least.margin if least else None,
            (verdict.retrieval or {}).get("agreement_at_1"),
            round(size / 1e6, 2) if size else None,
            served_rps=level[1].throughput if level and variant == deployed else None,
            served_p99_ms=level[1].p99 if level and variant == deployed else None,
            cells={cell: stats[variant] for cell, stats in cells.items()
                   if variant in stats and is_variant_row(variant)}))
    return rows


def _common_cells(rows: list[Row]) -> tuple[str | None, str | None]:
    """The latency cell (batch 1, shortest sequence) and throughput cell (largest batch, longest sequence) among
    the cells every run of the group that has a bench measured."""
    by_run: dict[str, set[str]] = {}
    for row in rows:
        if row.cells:
            by_run.setdefault(row.run, set()).update(row.cells)
    common = set.intersection(*by_run.values()) if by_run else set()
    shapes = [cell for name in common if (cell := Cell.parse(name))]
    if not shapes:
        return None, None
    goals = goal_cells(shapes)  # the per-run report's goal cells, among the common ones
    latency, throughput = goals["latency"], goals["throughput"]
    return (latency.key if latency else None), (throughput.key if throughput else None)


def _pick(goal: str, rule: str, rows: list[Row], key: str, best: str) -> Pick:
    """The row with the lowest (best="min") or highest value of `key` among `rows`; none when no row has it."""
    measured = [r for r in rows if getattr(r, key) is not None]
    if not measured:
        return Pick(goal, rule, reason="no variant that qualifies was measured there")
    choose = min if best == "min" else max
    winner = choose(measured, key=lambda r: getattr(r, key))
    unit = "ms" if key == "latency_ms" else "sequences/s"
    return Pick(goal, rule, winner.run, winner.model, winner.variant, f"{getattr(winner, key):.4g} {unit}",
                f"best of {len(measured)}")


def _no_bench(unmeasured: dict[str, Path]) -> str:
    """Why nothing was picked when no run of the group has a bench, with the command that gives one."""
    if not unmeasured:
        return "no cell common to these runs"
    folder = next(iter(unmeasured.values()))
    return f"no bench in {', '.join(unmeasured)}: run `{bench_command(folder)}` (each run alike), then compare again"


def bench_command(run: Path | str) -> str:
    """What measures a run that has no bench."""
    return run_again(["bench"], run, lab=False)


def group(rows: list[Row], floor: float, unmeasured: dict[str, Path] | None = None) -> Group:
    """One host's rows at the cells all its benched runs measured, and a pick per goal; `unmeasured` (label ->
    folder) are its runs without a bench, named in the reasons."""
    unmeasured = unmeasured or {}
    latency, throughput = _common_cells(rows)
    for row in rows:
        at = row.cells.get(latency or "")
        row.latency_ms, row.latency_speedup = (at.p50, at.speedup) if at else (None, None)
        at = row.cells.get(throughput or "")
        row.throughput, row.throughput_speedup = (at.sequences_per_s, at.speedup) if at else (None, None)
    passing = [r for r in rows if r.passed]
    accurate = [r for r in passing if r.gate in ("min cosine", "label agreement") and (r.value or 0) >= floor]
    cell = latency.replace("_", " ") if latency else None
    picks = [
        _pick("latency", f"lowest median ms at {cell}, among variants that pass parity in their run", passing,
              "latency_ms", "min") if latency else Pick("latency", "batch 1 at a sequence every run measured",
                                                        reason=_no_bench(unmeasured)),
        _pick("throughput", f"most sequences/s at {throughput.replace('_', ' ')}, among variants that pass parity",
              passing, "throughput", "max") if throughput else Pick(
                  "throughput", "the largest cell every run measured", reason=_no_bench(unmeasured)),
        _pick("accuracy", f"lowest median ms at {cell} among variants whose min cosine (or label agreement) is at "
              f"least {floor}", accurate, "latency_ms", "min") if latency else Pick(
                  "accuracy", f"min cosine at least {floor}", reason=_no_bench(unmeasured)),
    ]
    return Group(rows[0].host, rows, latency, throughput, picks, list(unmeasured))


@dataclass(frozen=True)
class FleetRow:
    """What one host kind deploys of one model for one goal: the verified fastest variant there, its speedup over
    the run's PyTorch at the goal's cell, and its parity margin."""

    kind: str
    model: str
    goal: str
    run: str | None
    variant: str | None
    value: str
    speedup: float | None
    margin: float | None
    reason: str
    cell: str | None = None  # the goal's cell among this model's runs of this kind


def fleet(groups: list[Group], floor: float) -> list[FleetRow]:
    """Per host kind (the groups of sweep cells) and model, each goal's pick among that model's variants."""
    found = []
    for host_group in groups:
        kind = kind_of_host(host_group.host)
        if kind is None:
            continue
        for model in dict.fromkeys(row.model for row in host_group.rows):
            rows = [replace(row) for row in host_group.rows if row.model == model]
            by_variant = {(row.run, row.variant): row for row in rows}
            picked = group(rows, floor)
            for pick in picked.picks:
                row = by_variant.get((pick.run, pick.variant))
                throughput = pick.goal == "throughput"
                speedup = (row.throughput_speedup if throughput else row.latency_speedup) if row else None
                found.append(FleetRow(kind, model, pick.goal, pick.run, pick.variant, pick.value, speedup,
                                      row.margin if row else None, pick.reason if not row else pick.rule,
                                      picked.throughput_cell if throughput else picked.latency_cell))
    return found


@dataclass
class Comparison:
    """Every run given, by label: the host groups its variants are compared in, the runs with no row and why, and
    per host kind of sweep cells, what each kind deploys."""

    runs: list[str]
    groups: list[Group]
    left_out: dict[str, str]  # label -> why it has no row, and what gives it one
    fleet: list[FleetRow] = field(default_factory=list)


def compare(run_dirs: list[Path], floor: float = ACCURACY_FLOOR) -> Comparison:
    labels = run_labels(run_dirs)
    rows: dict[str, list[Row]] = {}
    unmeasured: dict[str, dict[str, Path]] = {}
    left_out: dict[str, str] = {}
    for run_dir in run_dirs:
        try:
            record = RunRecord.load(run_dir)
        except OutputDirError as unreadable:
            left_out[labels[run_dir]] = f"its run.json cannot be read ({unreadable.problem})"
            continue
        found = rows_of(record, labels[run_dir])
        if not found:
            left_out[labels[run_dir]] = _no_rows(record, run_dir)
        for row in found:
            rows.setdefault(row.host, []).append(row)
        if found and not any(row.cells for row in found):
            unmeasured.setdefault(found[0].host, {})[labels[run_dir]] = run_dir
    groups = [group(found, floor, unmeasured.get(host)) for host, found in rows.items()]
    return Comparison(list(labels.values()), groups, left_out, fleet(groups, floor))


def _no_rows(record: RunRecord, run_dir: Path) -> str:
    """Why a run has no variant to compare (none has a parity verdict), and the command that gives it some."""
    entry = record.step_entry("parity")
    state = f"its parity step is {entry.label}" + (f" ({entry.detail})" if entry.detail else "") \
        if entry.status is not None else "its parity step never ran"
    return f"no variant with a parity verdict: {state}; run `{run_again(['optimize', 'parity', 'bench'], run_dir)}`"


COLUMNS = ("run", "model", "variant", "precision", "passed", "gate", "value", "margin", "agreement_at_1", "size_mb",
           "latency_ms", "latency_speedup", "throughput", "throughput_speedup", "served_rps", "served_p99_ms", "host")


def table(groups: list[Group]) -> list[dict[str, Any]]:
    return [{key: getattr(row, key) for key in COLUMNS} for g in groups for row in g.rows]


def _number(value: float | None, unit: str = "", ratio: float | None = None) -> str:
    if value is None:
        return ""
    return f"{value:.4g}{unit}" + (f" ({ratio:.3g}x)" if ratio is not None else "")


def group_figures(found: Group) -> list[go.Figure]:
    """The picks with their rules, every variant's numbers, and latency against accuracy."""
    rows = [[r.run, Path(r.model).name, r.variant, r.precision or "", "pass" if r.passed else "FAIL",
             f"{r.gate} {_number(r.value)} ({r.margin:+.2g})" if r.gate and r.margin is not None else "",
             _number(r.agreement_at_1), _number(r.size_mb), _number(r.latency_ms, " ms", r.latency_speedup),
             _number(r.throughput, "/s", r.throughput_speedup),
             f"{r.served_rps:.4g}/s, p99 {r.served_p99_ms:.4g} ms" if r.served_rps is not None else ""]
            for r in found.rows]
    header = ["run", "model", "variant", "precision", "parity", "gate (margin)", "agreement@1", "MB",
              f"{found.latency_cell} (speedup)", f"{found.throughput_cell} (speedup)", "served"]
    picks = [[p.goal, p.run or "none", p.variant or "", p.value, p.rule if p.variant else f"{p.rule}: {p.reason}"]
             for p in found.picks]
    decided = figures.table("What to deploy, per goal, and the rule", ["goal", "run", "variant", "value", "rule"],
                            picks)
    decided.update_layout(height=70 + 48 * (len(picks) + 1))
    made = [decided, figures.table("Every variant", header, rows)]
    measured = [r for r in found.rows if r.latency_ms is not None and r.value is not None]
    if measured:
        scatter = go.Figure(go.Scatter(
            x=[r.latency_ms for r in measured], y=[r.value for r in measured], mode="markers+text",
            text=[f"{r.run}/{r.variant}" for r in measured], textposition="top center",
            marker={"color": ["#2a7" if r.passed else "#c33" for r in measured], "size": 10}))
        scatter.update_layout(title="Latency against accuracy (green: passes parity)",
                              xaxis_title=f"median ms at {found.latency_cell}", yaxis_title="gate value "
                              "(min cosine, agreement or max abs error)", yaxis_tickformat=".6f", height=420)
        made.append(scatter)
    return made


def fleet_figure(rows: list[FleetRow]) -> go.Figure:
    """The fleet table: per host kind and model, what each goal deploys there."""
    cells = [[r.kind, Path(r.model).name, r.goal, f"{r.run}: {r.variant}" if r.variant else "none",
              f"{r.value} at {r.cell.replace('_', ' ')}" if r.cell and r.variant else r.value,
              f"{r.speedup:.3g}x" if r.speedup is not None else "",
              f"{r.margin:+.2g}" if r.margin is not None else "", r.reason] for r in rows]
    made = figures.table("The fleet: what each host kind deploys, per model and goal (verified there, fastest there)",
                         ["host kind", "model", "goal", "run: variant", "value", "speedup vs PyTorch",
                          "parity margin", "rule"], cells)
    made.update_layout(height=90 + 48 * (len(cells) + 1))
    return made


def write_compare(compared: Comparison, folder: Path, overwrite: bool = False) -> dict[str, Path]:
    """compare.html (self-contained), compare.csv and compare.json in `folder`; files there are replaced only with
    `overwrite`."""
    groups = compared.groups
    existing = [folder / name for name in FILES if (folder / name).exists()]
    if existing and not overwrite:
        raise OutputDirError(f"{existing[0]} exists", "pass another --output folder, or --overwrite to replace it")
    ensure_writable(folder, "--output")
    data = {"runs": compared.runs, "left_out": compared.left_out,
            "fleet": [asdict(row) for row in compared.fleet], "groups": [
        {"host": g.host, "latency_cell": g.latency_cell, "throughput_cell": g.throughput_cell,
         "picks": [asdict(p) for p in g.picks], "unmeasured": g.unmeasured, "rows": table([g])} for g in groups]}
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows(table(groups))
    sections, first = [], True
    fleet_html = ""
    if compared.fleet:
        fleet_html = fleet_figure(compared.fleet).to_html(full_html=False, include_plotlyjs=True,
                                                          config={"responsive": True})
        first = False
    for found in groups:
        parts = []
        for figure in group_figures(found):
            parts.append(figure.to_html(full_html=False, include_plotlyjs=first, config={"responsive": True}))
            first = False
        sections.append({"host": found.host, "figures": parts})
    page = jinja2.Template(TEMPLATE.read_text(encoding="utf-8"), autoescape=True).render(
        runs=compared.runs, left_out=compared.left_out, groups=sections, fleet=fleet_html)
    return {"html": write_text(folder / FILES[0], page), "csv": write_text(folder / FILES[1], buffer.getvalue()),
            "json": write_text(folder / FILES[2], json.dumps(data, indent=1))}

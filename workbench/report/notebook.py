"""What every step notebook does first: turn its parameters into a config and an open record.

The parameters cell of every notebook is written from `PARAMETERS` (`workbench steps --write-parameter-cells` rewrites
it), so papermill's `--help-notebook` lists typed, commented settings, and a value a user or papermill passes is
checked here.
"""
from __future__ import annotations

import ast
import difflib
import html
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from IPython.display import HTML

from workbench.core import dotted, registry
from workbench.core.advice import speak_notebooks
from workbench.core.config import RunConfig, outputs_root
from workbench.core.dotted import Tree
from workbench.core.errors import ConfigError
from workbench.core.memory import first_to_go
from workbench.core.parameters import PARAMETERS, Parameter
from workbench.core.progress import use_text_bars
from workbench.core.record import RECORD_NAME, RunRecord, described, settings_changes
from workbench.models.quiet import quiet_known_warnings

SHIPPED_NOTEBOOKS = Path(sys.prefix) / "share" / "workbench" / "notebooks"  # where a wheel install puts them


def notebooks_dir(checkout: Path = Path(__file__).resolve().parents[2]) -> Path:
    """The step notebooks' templates: the checkout's `notebooks/` folder (a clone, an editable install), else those
    the package installed (`pip install` of a wheel)."""
    return checkout / "notebooks" if (checkout / "notebooks" / "01_export.ipynb").is_file() else SHIPPED_NOTEBOOKS


NOTEBOOKS_DIR = notebooks_dir()
INJECTED_MARK = "# Parameters"  # the whole first line of the cell papermill injects after the parameters cell


def parameter_line(parameter: Parameter) -> str:
    """`name: type = None  # help (new run: default)`; a type in words (e.g. `int or auto`) quoted, as papermill
    reads it."""
    annotation = f'"{parameter.type_name}"' if " " in parameter.type_name else parameter.type_name
    default = dotted.get(RunConfig().to_params(), parameter.setting)
    return f"{parameter.name}: {annotation} = None  # {parameter.help} (new run: {default!r})"


OTHER_PARAMETERS = (
    'config: dict = {}  # any other setting (`workbench config` lists them), as a dict or a YAML/JSON string, '
    'e.g. {"opset": 18, "triton": {"layout": "fused"}}',
    "run_dir: str = None  # run folder; None: interactive-<model> under $WORKBENCH_OUTPUTS (default ./outputs) "
    "when model is set, else the run the last notebook opened",
)
LAST_RUN = ".last-run"  # in the outputs root: the run folder the last notebook opened
NAMES = tuple(p.name for p in PARAMETERS) + ("config", "run_dir")


def parameters_cell() -> str:
    """The source of every notebook's parameters cell."""
    head = ("# Parameters (papermill: -p NAME VALUE). None keeps the run's setting (its run.json; a new run's "
            "default); a value you set changes the run's, and the steps it makes stale are named.")
    return "\n".join([head, *(parameter_line(p) for p in PARAMETERS), *OTHER_PARAMETERS])


def start(namespace: dict[str, Any], step: str | None = None) -> tuple[RunConfig, RunRecord]:
    """Validate the notebook's parameters (its globals) and open the run; print which run, the settings it holds
    apart from the defaults (and who set them), what this notebook changed and what that made stale.

    The run: `run_dir`; else `interactive-<model>/` under the outputs root when `model` is set; else the run the
    last notebook opened, so the notebooks of one model continue one run.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    first_to_go()  # the kernel holds the model: where memory runs out, it goes before the CLI or JupyterLab
    quiet_known_warnings()
    papermill = injected_cell(namespace.get("In")) is not None
    use_text_bars()  # a saved notebook keeps a text bar's last state; a widget's would be lost on reopening
    refuse_unknown_injected(namespace.get("In"))
    folder = run_folder(namespace)
    recorded = RunRecord.load(folder).settings if (folder / RECORD_NAME).is_file() else None
    cfg = config_from(namespace, recorded)
    by = f"{registry.fact(step).notebook}" if step else "a notebook"
    before = recorded_steps(folder)
    record = RunRecord.open(folder, cfg, by=by)
    if not papermill:
        remember_run(folder)
        if "In" in namespace:  # a kernel JupyterLab runs: advice names the notebooks to run
            speak_notebooks()
    print(opening(record, recorded, before))
    return cfg, record


def run_folder(namespace: Mapping[str, object]) -> Path:
    """The run a notebook opens (see `start`)."""
    if namespace.get("run_dir"):
        return Path(str(namespace["run_dir"]))
    if namespace.get("model"):
        return outputs_root() / f"interactive-{RunConfig(model=str(namespace['model'])).model_slug}"
    last = outputs_root() / LAST_RUN
    if last.is_file() and (Path(last.read_text(encoding="utf-8").strip()) / RECORD_NAME).is_file():
        return Path(last.read_text(encoding="utf-8").strip())
    return outputs_root() / f"interactive-{RunConfig().model_slug}"


def remember_run(folder: Path) -> None:
    """Let the next notebook opened without `run_dir` or `model` continue `folder`."""
    outputs_root().mkdir(parents=True, exist_ok=True)
    (outputs_root() / LAST_RUN).write_text(str(folder.resolve()), encoding="utf-8")


def recorded_steps(folder: Path) -> dict[str, str]:
    """The status of each step run.json in `folder` holds ({} for a new run)."""
    if not (folder / RECORD_NAME).is_file():
        return {}
    return {entry.name: str(entry.status) for entry in RunRecord.load(folder).step_entries()}


def opening(record: RunRecord, recorded: Tree | None, before: dict[str, str]) -> str:
    """`run X (new | steps done): settings: sequence.max 128 (01_export.ipynb); changed here: ...; now stale: ...`."""
    done = [name for name, status in before.items() if status == "ok"]
    lines = [f"run {record.run_dir.name} ({'new' if recorded is None else 'done: ' + (', '.join(done) or 'none')})"]
    lines.append("settings apart from the defaults: " + (", ".join(record.own_settings()) or "none"))
    changed = settings_changes(RunConfig().to_params() if recorded is None else recorded, record.settings)
    lines.append(f"changed here: {described(changed) if changed else 'nothing'}")
    if recorded is not None:
        stale = [f"{name} ({entry.detail})" for name in done
                 if (entry := record.step_entry(name)).status == "stale"]
        if stale:
            lines.append("now stale, run their notebooks again: " + "; ".join(stale))
    return "\n".join(lines)


def config_from(namespace: dict[str, Any], recorded: Tree | None = None) -> RunConfig:
    """The run's recorded configuration (defaults for a new run), then `config` (a dict, or a YAML/JSON string),
    then each named parameter that is not None."""
    data = _mapping(namespace.get("config"))
    for parameter in PARAMETERS:
        if namespace.get(parameter.name) is None:
            continue
        dotted.put(data, parameter.setting, _typed(parameter, namespace[parameter.name]))
    return RunConfig.load(base=recorded, values=dotted.flat(data))  # a dotted key in config works too


def injected_cell(history: list[str] | None) -> str | None:
    """The cell papermill injected, when it is the one run just before `start` (its first line is INJECTED_MARK)."""
    if not history or len(history) < 2 or history[-2].split("\n", 1)[0].strip() != INJECTED_MARK:
        return None
    return history[-2]


def refuse_unknown_injected(history: list[str] | None) -> None:
    """Refuse a parameter papermill injected that no notebook knows (papermill itself only warns)."""
    injected = injected_cell(history)
    if injected is None:
        return
    assigned = [t.id for node in ast.parse(injected).body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)]
    unknown = [name for name in assigned if name not in NAMES]
    if unknown:
        hints = "".join(f" ({name!r}: did you mean {close[0]!r}?)" for name in unknown
                        if (close := difflib.get_close_matches(name, NAMES, n=1)))
        raise ConfigError(f"unknown notebook parameter(s) {unknown}{hints}",
                          f"parameters are: {', '.join(NAMES)}; any other setting goes in -p config "
                          "'{...}' or -y 'config: {...}'")


def _mapping(config: Any) -> dict[str, Any]:
    if config is None or config == "":
        return {}
    if isinstance(config, str):
        try:
            config = yaml.safe_load(config)
        except yaml.YAMLError as exc:
            raise ConfigError(f"parameter config is not valid YAML/JSON: {exc}",
                              "pass a mapping, e.g. -p config '{\"opset\": 18}'") from None
    if not isinstance(config, dict):
        raise ConfigError(f"parameter config holds a {type(config).__name__} ({config!r}), not a mapping",
                          "pass a mapping, e.g. -p config '{\"opset\": 18}' or -y 'config: {opset: 18}'")
    return json.loads(json.dumps(config))  # a deep copy the merge may change


def as_options(lines: list[str]) -> list[str]:
    """The `-p setting=value` options saying what parameter-cell lines (`sequence_max = 64`) set; lines that are not
    an assignment of a literal to a known parameter give none."""
    named = {parameter.name: parameter.setting for parameter in PARAMETERS}
    options = []
    for line in lines:
        try:
            statement = ast.parse(line).body[0]
            if isinstance(statement, ast.Assign) and isinstance(target := statement.targets[0], ast.Name) and \
                    target.id in named:
                value = ast.literal_eval(statement.value)
                if value is not None:
                    shown = value if isinstance(value, str) else json.dumps(value)
                    options.append(f"-p {named[target.id]}={shown}")
        except (SyntaxError, ValueError, IndexError):
            continue
    return options


def _typed(parameter: Parameter, value: Any) -> Any:
    """papermill's -p passes '[fp32]' as a string: read a string given for a non-string setting as YAML."""
    if isinstance(value, str) and parameter.type_name != "str":
        try:
            return yaml.safe_load(value)
        except yaml.YAMLError:
            return value
    return value


def write_parameter_cells(folder: Path = NOTEBOOKS_DIR) -> list[Path]:
    """Rewrite the parameters cell of every notebook in `folder` from PARAMETERS; returns the notebooks changed."""
    import nbformat

    changed = []
    for path in sorted(folder.glob("[0-9][0-9]_*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        cell = next(c for c in notebook.cells if "parameters" in c.metadata.get("tags", []))
        if cell.source != parameters_cell():
            cell.source = parameters_cell()
            nbformat.write(notebook, path)
            changed.append(path)
    return changed



def report_inline(report: Path, height: int = 1000) -> HTML:
    """report.html in the notebook: a link and a frame by a path relative to the notebook's folder (the kernel's),
    which JupyterLab serves from its own server, so they work when the Lab runs on another machine."""
    relative = Path(os.path.relpath(report.resolve(), Path.cwd()))
    link = html.escape(relative.as_posix())
    return HTML(f'<p><a href="{link}" target="_blank">{html.escape(report.name)}</a> (opens in a new tab; on this '
                f'machine: <code>{html.escape(str(report.resolve()))}</code>)</p>'
                f'<iframe src="{link}" width="100%" height="{height}" style="border: 1px solid #ccc"></iframe>')

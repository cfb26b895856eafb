"""What every step notebook does first: turn its parameters into a config and an open record.

The parameters cell of every notebook is written from `PARAMETERS` (`workbench steps --write-parameter-cells` rewrites
it), so papermill's `--help-notebook` lists typed, commented settings, and a value a user or papermill passes is
checked here.
"""
from __future__ import annotations

import ast
import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from workbench.core import dotted
from workbench.core.config import RunConfig, outputs_root
from workbench.core.errors import ConfigError
from workbench.core.memory import first_to_go
from workbench.core.progress import use_text_bars
from workbench.core.quiet import quiet_known_warnings
from workbench.core.record import RunRecord
from workbench.core.tasks import TASKS

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
INJECTED_MARK = "# Parameters"  # the whole first line of the cell papermill injects after the parameters cell


@dataclass(frozen=True)
class Parameter:
    """One notebook parameter: its name, the run-configuration setting it sets, and a help line."""

    name: str
    setting: str
    type_name: str
    help: str

    @property
    def default(self) -> Any:
        return dotted.get(RunConfig().to_params(), self.setting)

    def line(self) -> str:
        """`name: type = default  # help`; a type in words (e.g. `int or auto`) quoted, as papermill reads it."""
        annotation = f'"{self.type_name}"' if " " in self.type_name else self.type_name
        return f"{self.name}: {annotation} = {self.default!r}  # {self.help}"


PARAMETERS = (
    Parameter("model", "model", "str", "HF model id or local folder; the default is embedded in a pip package"),
    Parameter("task", "task", "str", ", ".join(TASKS)),
    Parameter("pooling", "pooling", "str", "feature-extraction: auto (the model's sentence-transformers files, else "
              "mean), mean, cls, max, lasttoken, ... or none"),
    Parameter("precisions", "precisions", "list or auto", "ONNX variants to build and check: a list of fp32, fp16, "
              "bf16, int8; auto: fp32, and fp16/bf16/int8 where the deployment's target serves them faster"),
    Parameter("batch_min", "batch.min", "int", "batch sizes served: smallest"),
    Parameter("batch_opt", "batch.opt", "int", "most frequent"),
    Parameter("batch_max", "batch.max", "int", "largest"),
    Parameter("sequence_min", "sequence.min", "int", "tokens per text: fewest"),
    Parameter("sequence_opt", "sequence.opt", "int or auto", "most frequent; auto: the smaller of 128 and max"),
    Parameter("sequence_max", "sequence.max", "int or auto", "most; auto: the model's own limit (where its library "
              "cuts texts)"),
    Parameter("corpus", "corpus", "str", "UTF-8 text file, one text per line; None: the shipped corpus"),
    Parameter("device", "device", "str", "auto, cpu or cuda"),
    Parameter("threads", "threads", "int", "intra-op threads for PyTorch and ONNX Runtime; None: all cores"),
)
OTHER_PARAMETERS = (
    'config: dict = {}  # any other setting (`workbench config` lists them), as a dict or a YAML/JSON string, '
    'e.g. {"opset": 18, "triton": {"layout": "fused"}}',
    "run_dir: str = None  # run folder; None: interactive-<model> under $WORKBENCH_OUTPUTS (default ./outputs)",
)
NAMES = tuple(p.name for p in PARAMETERS) + ("config", "run_dir")


def parameters_cell() -> str:
    """The source of every notebook's parameters cell."""
    head = ("# Parameters (papermill: -p NAME VALUE). A setting left at its default keeps what `config` says; "
            "one you change wins over it.")
    return "\n".join([head, *(p.line() for p in PARAMETERS), *OTHER_PARAMETERS])


def start(namespace: dict[str, Any]) -> tuple[RunConfig, RunRecord]:
    """Validate the notebook's parameters (its globals) and open the run.

    Without `run_dir`, runs go to `interactive-<model>/` under the outputs root, so the notebooks of one model
    continue one run.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    first_to_go()  # the kernel holds the model: where memory runs out, it goes before the CLI or JupyterLab
    quiet_known_warnings()
    if injected_cell(namespace.get("In")) is not None:
        use_text_bars()  # papermill: the saved notebook keeps a text bar's last state, not a widget's
    refuse_unknown_injected(namespace.get("In"))
    cfg = config_from(namespace)
    run_dir = namespace.get("run_dir")
    folder = Path(run_dir) if run_dir else outputs_root() / f"interactive-{cfg.model_slug}"
    return cfg, RunRecord.open(folder, cfg)


def config_from(namespace: dict[str, Any]) -> RunConfig:
    """`config` (a dict, or a YAML/JSON string), then each named parameter that differs from its default."""
    data = _mapping(namespace.get("config"))
    for parameter in PARAMETERS:
        if parameter.name not in namespace:
            continue
        value = _typed(parameter, namespace[parameter.name])
        if value != parameter.default:
            dotted.put(data, parameter.setting, value)
    return RunConfig.load(base=data)


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


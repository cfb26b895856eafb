"""The house in rooms: each room of the package imports only itself and the rooms below it (README, "Architecture")."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "workbench"
# Bottom to top. The top holds the commands (cli, pipeline, preflight, doctor, serve, sweep, lab) and what they
# share (interrupt: signals and partial files; lock: one run per folder).
ROOMS = ("tasks", "core", "models", "graphs", "runners", "precision", "serving", "measure", "report", "steps", "top")


def room_of(module: str) -> str:
    """`workbench.serving.plan` -> serving; a top-level module (workbench.cli) -> top."""
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in ROOMS else "top"


def imports(path: Path) -> set[str]:
    """Every workbench module `path` imports, inside functions too."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("workbench"):
            found.update(f"{node.module}.{a.name}" if node.module == "workbench" else node.module for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("workbench"))
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_room_imports_only_itself_and_the_rooms_below():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "backend" in path.parts:  # Python-backend sources run inside tritonserver: they import no workbench
            assert not imports(path), path
            continue
        importer = module_name(path)
        for imported in imports(path):
            if ROOMS.index(room_of(imported)) > ROOMS.index(room_of(importer)):
                upward.append(f"{importer} -> {imported}")
    assert not upward, "imports that reach up a room:\n" + "\n".join(sorted(upward))


def test_every_room_is_a_package_that_says_what_it_holds():
    for room in ROOMS[:-1]:
        init = PACKAGE / room / "__init__.py"
        assert init.is_file() and ast.get_docstring(ast.parse(init.read_text())), room
    top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "__main__"}
    assert top == {"cli", "pipeline", "preflight", "doctor", "serve", "sweep", "lab", "interrupt", "lock"}, top


def test_core_reads_the_steps_from_the_registry_they_register_into():
    """No exception to the rooms: the configuration and the record know the steps by the registry alone."""
    from workbench.core import registry
    from workbench.steps import discover

    assert [s.name for s in registry.facts()] == [s.name for s in discover()]
    assert not any(room_of(imported) == "steps" for path in (PACKAGE / "core").rglob("*.py") for imported in
                   imports(path))


def metric_calls(source: str) -> int:
    """Calls of `<anything>.metric(...)` in Python source."""
    return sum(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "metric"
               for node in ast.walk(ast.parse(source)))


def test_only_the_record_reads_metrics_by_dotted_key():
    """Steps, report and notebooks read a step's typed metrics (`record.results_as`, `record.needed`,
    `record.current`, a step's own reader), never `record.metric("dotted.key")`."""
    import json

    found = [str(path.relative_to(PACKAGE.parent)) for path in sorted(PACKAGE.rglob("*.py"))
             if path != PACKAGE / "core" / "record.py" and metric_calls(path.read_text(encoding="utf-8"))]
    for path in sorted((PACKAGE.parent / "notebooks").rglob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        if metric_calls("\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!")))):
            found.append(str(path.relative_to(PACKAGE.parent)))
    assert not found, f"dotted metric reads outside the record: {found}"
    assert metric_calls('record.metric("bench.served")') == 1, "the count sees a call"



JSON = "reads or writes run.json's tables (record() / from_record(), the record itself)"
# Modules that may spell `dict[str, Any]`, at most so many times, and why: each reads or writes JSON or YAML (no
# module builds a table of its own as a dict). A new module, or a new use in a listed one, fails; a count that falls
# is lowered.
UNTYPED_ALLOWED: dict[str, tuple[int, str]] = {
    "core/config.py": (10, "YAML files, -p settings and a run record's configuration before validation"),
    "core/dotted.py": (3, "dotted keys into JSON mappings"),
    "core/machine.py": (2, "the host's facts as run.json records them"),
    "core/record.py": (8, JSON),
    "fleet/deployments.py": (3, "Kubernetes manifests read and written as YAML"),
    "fleet/kuberay.py": (4, "KubeRay manifests written as YAML"),
    "core/metrics.py": (1, "the Json alias: a nested table as recorded"),
    "graphs/engines.py": (1, JSON),
    "measure/load.py": (1, "Triton's statistics JSON"),
    "measure/precisions.py": (1, JSON),
    "models/loading.py": (2, "config.json's auto_map"),
    "models/sentence.py": (1, "the library's JSON files (modules.json, sentence_bert_config.json)"),
    "report/compare.py": (1, "compare.json's rows"),
    "report/notebook.py": (3, "papermill's parameters, a notebook's namespace"),
    "runners/__init__.py": (1, JSON),
    "runners/onnxruntime.py": (2, JSON),
    "serving/batching.py": (1, "Triton's statistics JSON"),
    "serving/client.py": (6, "Triton's HTTP/JSON answers"),
    "serving/deploy.py": (5, "Kubernetes manifests written as YAML"),
    "serving/repository.py": (3, f"{JSON}; a repository read back as JSON"),
    "sweep.py": (6, "sweep YAML settings and the Kubernetes Job it writes"),
}


def test_dict_of_any_only_where_json_is_read_or_written():
    found = {str(path.relative_to(PACKAGE)): path.read_text(encoding="utf-8").count("dict[str, Any]")
             for path in sorted(PACKAGE.rglob("*.py"))}
    beyond = {name: (count, UNTYPED_ALLOWED.get(name, (0, ""))[0]) for name, count in found.items()
              if count > UNTYPED_ALLOWED.get(name, (0, ""))[0]}
    assert not beyond, f"dict[str, Any] beyond the allow-list (found, allowed): {beyond}; type the value instead"
    fallen = {name: (found.get(name, 0), allowed) for name, (allowed, _) in UNTYPED_ALLOWED.items()
              if found.get(name, 0) < allowed}
    assert not fallen, f"fewer dict[str, Any] than allowed (found, allowed): {fallen}; lower UNTYPED_ALLOWED"


def test_tables_refuse_undeclared_keys_and_values_resolved_once_are_read_not_derived():
    """Issue #67's ratchets, counted as benchmarks/structure.py prints them: no model keeps undeclared keys, no
    import circle at runtime, the sequence range resolved once (by loading, for export), no library room reading
    the run record (the steps read it and pass the tables down), and a variant's own name spelled only in
    `graphs.names.VariantName`."""
    from structure import counts

    found = counts()
    assert found["Metrics models keeping undeclared keys"] == 0
    assert found["circles at runtime"] == 0
    assert found["config.sequence.resolve( calls"] == 1
    assert str(found["library modules that read the run record"]).startswith("0 ")
    assert found["literals of names only a variant has (files)"] == "0 (0)"

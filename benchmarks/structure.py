"""Counts of how the code is organised around its steps (issue #42's before/after numbers), read from the sources
with `ast`; nothing is imported or run:

    .venv/bin/python benchmarks/structure.py [--json]

- places a step reaches: per step, the files outside its own module and notebook that name it (a string equal to
  the step's name, or an import of its module); the deploy step's count is what adding a step touched;
- upward imports: imports from a room to a room above it (tests/test_architecture.py's order), inside functions too;
- circles: groups of modules that import each other round (strongly connected, inside functions too) and their files;
  counted again at runtime, without the type-only imports under `if TYPE_CHECKING:`;
- `dict[str, Any]` annotations, and parameters annotated with a bare `Any`;
- raw key reads in report/ and the notebooks: subscripts and `.get` with a string key;
- `record.metric(` calls outside the record, and step-status literals ("ok", "failed", "skipped", ...) compared or
  passed in the package;
- where the tables live and what is derived twice (issue #67): core's share of the package's lines (and each room's
  lines) and its pydantic
  tables (Metrics models), the largest step file, functions with 8 or more parameters, library rooms (models to
  measure) that read the run record, settings resolved again after export (`config.sequence.resolve(`,
  `choose_flavor(`), variant names written as string literals (all, and those no precision, runtime or step
  shares), Metrics models that keep undeclared keys, and the figures in report/ that serve one step;
- settings (issue #81): the settings model each step's SPEC declares and the module it lives in, and the step
  settings models left in core/ (the run-wide TargetSettings and PreflightSettings are no step's)."""
from __future__ import annotations

import argparse
import ast
import json
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "workbench"
ROOMS = ("tasks", "core", "models", "graphs", "runners", "precision", "serving", "measure", "report", "steps", "top")
STATUSES = {"ok", "failed", "skipped", "interrupted", "running"}
LIBRARY_ROOMS = ("tasks", "models", "graphs", "runners", "precision", "serving", "measure")
VARIANT_NAMES = {"fp16", "int8", "int8_repaired", "fp16_repaired", "openvino", "openvino_bf16", "openvino_int8",
                 "openvino_int8_repaired", "tensorrt"}  # fp32 left out: it is also a precision's name
# The names no precision, runtime or step shares: a literal of one is a variant's name spelled again.
VARIANT_ONLY = {"int8_repaired", "fp16_repaired", "openvino_bf16", "openvino_int8", "openvino_int8_repaired",
                "trt_fp16", "trt_fp32"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in ROOMS else "top"


def sources() -> dict[str, ast.Module]:
    """The package's modules by dotted name (the Python-backend sources that run inside tritonserver left out)."""
    return {module_name(path): ast.parse(path.read_text(encoding="utf-8"))
            for path in sorted(PACKAGE.rglob("*.py")) if "backend" not in path.parts}


def notebook_cells() -> dict[str, ast.Module]:
    """Each notebook's code cells as one module (IPython magics dropped)."""
    found = {}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        code = "\n".join(line for cell in cells if cell["cell_type"] == "code"
                         for line in "".join(cell["source"]).splitlines() if not line.lstrip().startswith(("%", "!")))
        found[path.name] = ast.parse(code)
    return found


def metrics_classes(trees: dict[str, ast.Module]) -> set[str]:
    """The classes in `trees` that derive from `Metrics` (run.json's tables), through any of their other classes."""
    bases = {node.name: {ast.unparse(b) for b in node.bases} for tree in trees.values() for node in tree.body
             if isinstance(node, ast.ClassDef)}
    found: set[str] = set()
    while True:
        more = {name for name, named in bases.items() if name not in found and named & (found | {"Metrics"})}
        if not more:
            return found
        found |= more


def type_only(tree: ast.Module) -> set[int]:
    """The ids of the nodes under `if TYPE_CHECKING:` (imported for annotations only)."""
    return {id(inner) for node in ast.walk(tree) if isinstance(node, ast.If) and ast.unparse(node.test).endswith(
        "TYPE_CHECKING") for statement in node.body for inner in ast.walk(statement)}


def imported(tree: ast.Module, modules: set[str], runtime: bool = False) -> set[str]:
    """The package modules `tree` imports anywhere (`from workbench.x import y` counts y where y is a module);
    `runtime`: not those imported for annotations only."""
    found = set()
    skipped = type_only(tree) if runtime else set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("workbench"):
            for alias in node.names:
                found.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("workbench"))
    return found & modules


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def strings(tree: ast.Module) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value


def key_reads(tree: ast.Module) -> int:
    """Subscripts with a string key and `.get("key", ...)` calls."""
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(
                node.slice.value, str):
            count += 1
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and \
                node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            count += 1
    return count


def is_any(annotation: ast.expr | None) -> bool:
    return isinstance(annotation, ast.Name) and annotation.id == "Any" or (
        isinstance(annotation, ast.Constant) and annotation.value == "Any")


def counts() -> dict[str, object]:
    trees = sources()
    modules = set(trees)
    graph = {name: imported(tree, modules) - {name} for name, tree in trees.items()}
    steps = sorted(name.rsplit(".", 1)[-1] for name in modules
                   if name.startswith("workbench.steps.") and name.count(".") == 2)
    notebooks = notebook_cells()
    reach = {}
    for step in steps:
        own = f"workbench.steps.{step}"
        places = [name for name, tree in trees.items() if name != own and not name.startswith(f"{own}.") and (
            own in graph[name] or step in set(strings(tree)))]
        places += [name for name, tree in notebooks.items() if not name.endswith(f"_{step}.ipynb") and (
            step in set(strings(tree)) or own in imported(tree, modules))]
        reach[step] = len(places)
    upward = sorted(f"{a} -> {b}" for a, found in graph.items() for b in found
                    if ROOMS.index(room_of(b)) > ROOMS.index(room_of(a)))
    groups = circles(graph)
    runtime_groups = circles({name: imported(tree, modules, runtime=True) - {name} for name, tree in trees.items()})
    text = {name: ast.unparse(tree) for name, tree in trees.items()}
    dict_any = {name: body.count("dict[str, Any]") for name, body in text.items() if "dict[str, Any]" in body}
    any_params = sum(is_any(arg.annotation) for tree in trees.values() for node in ast.walk(tree)
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                     for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs])
    metric_calls = sum(body.count(".metric(") for name, body in text.items() if name != "workbench.core.record")
    status_literals = sum(1 for name, tree in trees.items() for node in ast.walk(tree)
                          if isinstance(node, ast.Compare) and any(
                              isinstance(c, ast.Constant) and c.value in STATUSES for c in node.comparators))
    return {
        "places a step reaches (outside its module and notebook)": reach,
        "upward imports": len(upward),
        "upward import list": upward,
        "circles": len(groups),
        "files in circles": sum(len(group) for group in groups),
        "circles at runtime": len(runtime_groups),
        "dict[str, Any]": sum(dict_any.values()),
        "files with dict[str, Any]": len(dict_any),
        "parameters annotated Any": any_params,
        "raw key reads in report/": sum(key_reads(tree) for name, tree in trees.items()
                                        if room_of(name) == "report"),
        "raw key reads in notebooks": sum(key_reads(tree) for tree in notebooks.values()),
        "record.metric( calls outside the record": metric_calls,
        "step-status literals compared": status_literals,
        **tables_and_derivations(trees),
    }


def lines_of(name: str) -> int:
    path = PACKAGE.parent / Path(*name.split("."))
    file = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    return len(file.read_text(encoding="utf-8").splitlines())


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    names = [a.arg for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]]
    return len([n for n in names if n not in ("self", "cls")])


def tables_and_derivations(trees: dict[str, ast.Module]) -> dict[str, object]:
    """Issue #67's figures: where the tables live and what is derived more than once."""
    sizes = {name: lines_of(name) for name in trees}
    core = sum(size for name, size in sizes.items() if room_of(name) == "core")
    steps = {name: size for name, size in sizes.items() if room_of(name) == "steps"}
    text = {name: ast.unparse(tree) for name, tree in trees.items()}
    core_tables = len(metrics_classes({name: tree for name, tree in trees.items() if room_of(name) == "core"}))
    readers = sorted(name for name, tree in trees.items() if room_of(name) in LIBRARY_ROOMS and any(
        isinstance(node, ast.ImportFrom) and node.module == "workbench.core.record" and any(
            alias.name == "RunRecord" for alias in node.names) for node in ast.walk(tree)))
    spelled = {name: tree for name, tree in trees.items() if name != "workbench.graphs.names"}  # the one place
    literals = {name: sum(1 for value in strings(tree) if value in VARIANT_NAMES) for name, tree in spelled.items()}
    only = {name: sum(1 for value in strings(tree) if value in VARIANT_ONLY) for name, tree in spelled.items()}
    figures = trees.get("workbench.report.figures")
    drawn = [node.name for node in figures.body if isinstance(node, ast.FunctionDef) and not node.name.startswith(
        "_")] if figures else []
    users = {fn: {name for name, body in text.items() if room_of(name) == "steps" and (
        f"figures.{fn}(" in body or f" {fn}(" in body)} for fn in drawn}
    return {
        "lines in core/ (share of the package)": f"{core} of {sum(sizes.values())} "
                                                 f"({100 * core / sum(sizes.values()):.0f}%)",
        "lines per room, bottom to top": {room: sum(size for name, size in sizes.items() if room_of(name) == room)
                                          for room in ROOMS},
        "pydantic tables (Metrics models) in core/": core_tables,
        "largest step file (lines)": f"{max(steps, key=lambda n: steps[n])} {max(steps.values())}",
        "functions with 8+ parameters": sum(1 for tree in trees.values() for node in ast.walk(tree) if isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef)) and parameters(node) >= 8),
        "library modules that read the run record": f"{len(readers)} ({', '.join(readers)})",
        "config.sequence.resolve( calls": sum(body.count("config.sequence.resolve(") for body in text.values()),
        "choose_flavor( calls": sum(body.count("choose_flavor(") for body in text.values()),
        "variant-name literals (files)": f"{sum(literals.values())} ({sum(1 for n in literals.values() if n)})",
        "literals of names only a variant has (files)": f"{sum(only.values())} ({sum(1 for n in only.values() if n)})",
        "Metrics models keeping undeclared keys": sum(body.count("extra='allow'") for body in text.values()),
        "report figures serving exactly one step": f"{sum(1 for u in users.values() if len(u) == 1)} of "
                                                   f"{len(drawn)}",
        "settings model per step (its module)": step_settings(trees),
        "step settings models in core/": sum(1 for name, tree in trees.items() if room_of(name) == "core" for node in
                                             tree.body if isinstance(node, ast.ClassDef) and node.name.endswith(
                                                 "Settings") and node.name not in ("Settings", "StepSettings",
                                                                                   "TargetSettings",
                                                                                   "PreflightSettings")),
    }


def step_settings(trees: dict[str, ast.Module]) -> dict[str, str]:
    """Per step, the settings model its SPEC declares (`settings=`) and the module that defines it ("-": none)."""
    defined = {node.name: name for name, tree in trees.items() for node in tree.body if isinstance(node, ast.ClassDef)}
    found = {}
    for name, tree in trees.items():
        if room_of(name) != "steps" or name.count(".") != 2:
            continue
        call = next((node.value for node in tree.body if isinstance(node, ast.Assign) and isinstance(
            node.value, ast.Call) and any(isinstance(t, ast.Name) and t.id == "SPEC" for t in node.targets)), None)
        model = next((ast.unparse(k.value) for k in call.keywords if k.arg == "settings"), None) if call else None
        found[name.rsplit(".", 1)[-1]] = f"{model} ({defined.get(model, '?')})" if model else "-"
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")
    found = counts()
    if parser.parse_args().json:
        print(json.dumps(found, indent=2))
        return
    for key, value in found.items():
        if key != "upward import list":
            print(f"{key}: {value}")
    for line in found["upward import list"]:
        print(f"  {line}")


if __name__ == "__main__":
    main()

"""The import graph of ``vitcompress`` has no cycles, read statically from the source with ``ast``.

Every import counts, also one inside a function: a lazy import that goes back up the layers
(loading -> artifact -> api -> loading) is still a cycle, only hidden from the interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vitcompress"

# The layers, bottom up (docs/architecture.md): a package imports only packages of lower layers.
# The data flows up: model source -> captured graph -> model map -> plan -> rewritten model ->
# measurements -> report.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "version", "status", "torch_output", "model_args", "model_copy", "method", "zoo"),
    ("kernels", "modules", "data", "loading", "analysis"),
    ("variants",),  # a method: its scorer, fuse and reducers; knows no plan
    ("compilation",),  # plan, rewrite, compress(): asks the method
    ("artifacts",),
    ("api",),
    ("vitcompress", "measure"),  # the package's public face; measurements of built models
    ("training", "search"),
    ("workflows",),
    ("cli",),
)

# Cycles tolerated while another change removes them, each a set of units (see ``_unit``);
# empty since the plan moved into vitcompress/graph/ (it was {graph, plan}).
KNOWN_CYCLES: list[frozenset[str]] = []


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The vitcompress modules ``name`` imports (``from a import b`` counts ``a.b`` if it is a
    module, else ``a``). A package's ``__init__`` that Python runs on the way to a submodule
    is not counted: it is the package's public face, not a dependency of its own modules."""

    def known(candidate: str) -> str | None:
        while candidate and candidate not in modules:
            candidate = candidate.rpartition(".")[0]
        return candidate or None

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package holding this module
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.append(full if full in modules else base)
        for target in targets:
            if target.split(".")[0] == "vitcompress":
                resolved = known(target)
                if resolved is not None and resolved != name:
                    found.add(resolved)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return components


def _unit(module: str) -> str:
    """The package a module belongs to: ``vitcompress.compilation.rewrite`` ->
    ``vitcompress.compilation``."""
    return ".".join(module.split(".")[:2])


# Sizes the code is held to: a module over MAX_MODULE_LINES is split; a function of a workflow
# (workflows, and the fine-tuning loop and search they drive) or of a pass (analysis,
# compilation) over MAX_FUNCTION_LINES is split into named steps.
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
FUNCTION_LIMIT_PACKAGES = ("workflows", "training", "search", "analysis", "compilation")
# Functions over the limit, each with why it stands; an entry whose function shrank fails too.
LONG_FUNCTIONS: dict[str, str] = {}


def _long_functions(path: Path, module: str, limit: int) -> dict[str, int]:
    """``module.function`` (methods and nested functions too, by their qualified path) -> its
    lines, for each function of ``path`` longer than ``limit`` lines (decorators not counted)."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}.{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = (child.end_lineno or child.lineno) - child.lineno + 1
                    if lines > limit:
                        found[name] = lines
                visit(child, name)
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), filename=str(path)), module)
    return found


def test_every_module_is_at_most_the_line_limit() -> None:
    long = {
        name: lines
        for name, path in _modules().items()
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_no_function_of_a_workflow_or_a_pass_is_over_the_line_limit() -> None:
    found: dict[str, int] = {}
    for name, path in _modules().items():
        if name.split(".")[1:2] and name.split(".")[1] in FUNCTION_LIMIT_PACKAGES:
            found |= _long_functions(path, name, MAX_FUNCTION_LINES)
    assert sorted(set(found) - set(LONG_FUNCTIONS)) == []
    assert sorted(set(LONG_FUNCTIONS) - set(found)) == []  # shrank: take it off the list


def test_the_function_limit_finds_a_long_method_and_a_nested_function(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(5))
    source = f"class A:\n    def m(self):\n{body.replace('    ', '        ')}\n"
    source += f"def f():\n    def inner():\n{body.replace('    ', '        ')}\n    return 1\n"
    (tmp_path / "m.py").write_text(source)
    assert _long_functions(tmp_path / "m.py", "m", 4) == {"m.A.m": 6, "m.f": 9, "m.f.inner": 6}
    assert _long_functions(tmp_path / "m.py", "m", 9) == {}


def _module_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _unexpected(cycles: list[set[str]]) -> list[list[str]]:
    return [sorted(c) for c in cycles if not any(c <= known for known in KNOWN_CYCLES)]


def test_cycle_finder_finds_a_lazy_cycle(tmp_path: Path) -> None:
    # The finder itself: a lazy import back up the layers is a cycle, a one-way chain is not.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [{"a", "b", "c"}]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    (tmp_path / "low.py").write_text("def f():\n    from vitcompress.high import g\n")
    modules = {"vitcompress.low": tmp_path / "low.py", "vitcompress.high": tmp_path / "x.py"}
    assert _imports("vitcompress.low", tmp_path / "low.py", modules) == {"vitcompress.high"}


def test_no_import_cycle_between_modules() -> None:
    assert _unexpected(_cycles(_module_graph())) == []


def test_no_import_cycle_between_layers() -> None:
    assert _unexpected(_cycles(_units())) == []


def test_loading_builds_on_nothing_above_it() -> None:
    graph = _module_graph()
    above = {
        "vitcompress.api",
        "vitcompress.artifacts.artifact",
        "vitcompress.compilation.compression",
        "vitcompress.cli",
        "vitcompress.workflows",
    }
    for module, imported in graph.items():
        if module.startswith("vitcompress.loading"):
            assert not {_unit(m) for m in imported} & above, module


def test_every_module_imports_in_a_fresh_interpreter() -> None:
    # One process, every module in sorted order: a name left behind by a move fails here.
    names = sorted(_module_graph())
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    result = subprocess.run(
        [sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_only_the_naming_module_spells_the_reducer_prefix() -> None:
    # The reducers live under ``model.<REDUCER_PREFIX>``; whoever looks them up imports the name.
    from vitcompress.compilation.naming import REDUCER_PREFIX

    spelled = []
    for name, path in _modules().items():
        if name == "vitcompress.compilation.naming":  # where it is defined
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and (node.value == REDUCER_PREFIX or node.value.startswith(REDUCER_PREFIX + "."))
            ):
                spelled.append(f"{name}:{node.lineno}")
    assert spelled == []


def _layer_of() -> dict[str, int]:
    return {f"vitcompress.{name}" if name != "vitcompress" else name: rank
            for rank, names in enumerate(LAYERS) for name in names}  # fmt: skip


def _units() -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for module, imported in _module_graph().items():
        units.setdefault(_unit(module), set()).update(
            _unit(other) for other in imported if _unit(other) != _unit(module)
        )
    return units


def _imports_up(units: dict[str, set[str]], layer_of: dict[str, int]) -> list[str]:
    return sorted(
        f"{unit} imports {other}"
        for unit, imported in units.items()
        for other in imported
        if layer_of[other] >= layer_of[unit]
    )


def test_every_package_has_a_declared_layer() -> None:
    assert sorted(set(_units()) - set(_layer_of())) == []


def test_imports_go_down_the_layers() -> None:
    assert _imports_up(_units(), _layer_of()) == []


def test_the_layer_check_finds_an_import_up_and_one_within_a_layer() -> None:
    layer_of = _layer_of()
    units = {
        "vitcompress.analysis": {"vitcompress.variants"},  # analysis must know no method
        "vitcompress.search": {"vitcompress.training"},  # one layer: neither imports the other
        "vitcompress.cli": {"vitcompress.workflows"},
    }
    assert _imports_up(units, layer_of) == [
        "vitcompress.analysis imports vitcompress.variants",
        "vitcompress.search imports vitcompress.training",
    ]

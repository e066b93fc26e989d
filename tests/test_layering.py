"""The package's layering, checked from the source with ast (no import, single process, fast).

- every module belongs to a layer of ``LAYERS``, and imports only its own layer and what ``MAY_IMPORT`` (the
  written table of who may import whom) lists for it: a whole layer (``"x.*"``) or one interface module
  (``hvdlite.core.frontend`` for the frontends, ``hvdlite.core.launch`` for the launcher);
- no layer imports a framework it does not serve (``MUST_NOT_IMPORT``), and exactly one module imports mpi4py;
- no import cycle among hvdlite modules (imports inside functions count: see CYCLES_COUNT_LAZY_IMPORTS);
- every module is under 390 lines, the package and the top-level benchmarks under their line budgets (budgets
  that only go down);
- the benchmarks outside benchmarks/lab/ use hvdlite as a user does: no import of (or reach into) the engine
  or the runtime, so no patching of either.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

PACKAGE = Path(__file__).resolve().parent.parent / "hvdlite"
BENCHMARKS = PACKAGE.parent / "benchmarks"
#: What only benchmarks/lab/ may use: the engine and the runtime that drives it.
LAB_ONLY = ("hvdlite.core.engine", "hvdlite.core.runtime")
#: The only module allowed to import mpi4py.
MPI_MODULE = "hvdlite.core.engine.mpi"
#: The layers, most specific first: a module belongs to the first whose name prefixes its own.
LAYERS = ("hvdlite.core.engine", "hvdlite.core.elastic", "hvdlite.core", "hvdlite.torch", "hvdlite.lightning",
          "hvdlite.tensorflow.keras", "hvdlite.tensorflow", "hvdlite.keras", "hvdlite.run.elastic", "hvdlite.run",
          "hvdlite")
#: What the frontends may use of the core: the public core package (``hvdlite.core``'s __init__), its
#: documented frontend interface (``frontend``, and ``basics``: the runtime names they re-export), and the
#: public elastic package (``hvd.elastic``).
FRONTEND_INTERFACE = {"hvdlite.core", "hvdlite.core.frontend", "hvdlite.core.basics", "hvdlite.core.elastic.*"}
#: Who may import whom, besides its own layer: ``"layer.*"`` is any module of that layer, a plain name is
#: that one module.
MAY_IMPORT: dict[str, set[str]] = {
    # the top package re-exports the public core; ``hvdlite.run(fn)`` loads the launcher lazily
    "hvdlite": {"hvdlite.core", "hvdlite.core.elastic.*", "hvdlite.run.*"},
    # the core's runtime and API drive the engine; nothing else may
    "hvdlite.core": {"hvdlite.core.engine.*"},
    # the engine stands on the core's leaf modules only (never on the runtime or the API above it)
    "hvdlite.core.engine": {"hvdlite.core.config", "hvdlite.core.errors", "hvdlite.core.log",
                            "hvdlite.core.process_sets", "hvdlite.core.reduce_ops"},
    "hvdlite.core.elastic": {"hvdlite.core.*"},
    "hvdlite.torch": FRONTEND_INTERFACE,
    "hvdlite.tensorflow": FRONTEND_INTERFACE | {"hvdlite.tensorflow.keras.*"},
    "hvdlite.tensorflow.keras": FRONTEND_INTERFACE | {"hvdlite.tensorflow.*"},
    "hvdlite.keras": {"hvdlite.tensorflow.keras.*"},
    # the Lightning strategy is a user of the torch frontend, as a training script is
    "hvdlite.lightning": {"hvdlite.torch.*"},
    # the launcher sees the core only through its documented surface (and the package's version)
    "hvdlite.run": {"hvdlite", "hvdlite.core.launch", "hvdlite.run.elastic.*"},
    "hvdlite.run.elastic": {"hvdlite.run.*", "hvdlite.core.launch"},
}
#: Outside packages a layer must not import: a frontend never loads the other framework, the core none.
MUST_NOT_IMPORT: dict[str, tuple[str, ...]] = {
    "hvdlite.core": ("torch", "tensorflow", "keras", "tf_keras"),
    "hvdlite.core.engine": ("torch", "tensorflow", "keras", "tf_keras"),
    "hvdlite.core.elastic": ("torch", "tensorflow", "keras", "tf_keras"),
    "hvdlite.torch": ("tensorflow", "keras", "tf_keras"),
    "hvdlite.tensorflow": ("torch",),
    "hvdlite.tensorflow.keras": ("torch",),
    "hvdlite.keras": ("torch",),
    "hvdlite.lightning": ("tensorflow", "keras", "tf_keras"),
    "hvdlite.run": ("torch", "tensorflow", "keras", "tf_keras"),
    "hvdlite.run.elastic": ("torch", "tensorflow", "keras", "tf_keras"),
}
#: A module has fewer lines than this (a module at the cap wants a simplification, not a split made to fit it).
MAX_LINES = 390
#: Modules still at or over the cap, at most the lines given: the list only shrinks (a module that drops under
#: the cap leaves it, one that grows fails).
OVER_CAP: dict[str, int] = {}
#: Lines of the whole package (hvdlite/**/*.py) and of the top-level benchmarks (benchmarks/*.py, the tool; the
#: lab's one-question scripts are not counted). Lower them as code goes; never raise them to fit (their history
#: is in HISTORY.md).
PACKAGE_BUDGET = 15_939
BENCHMARKS_BUDGET = 2_560
#: Whether an import inside a function counts as an edge of the import graph for the cycle check. A lazy
#: import that closes a loop (runtime -> api -> runtime) hides a cycle from Python, not from the reader.
CYCLES_COUNT_LAZY_IMPORTS = True


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package is named by its __init__.py)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (relative levels resolved against ``module``)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not _is_package(module):
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, lazy: bool) -> list[tuple[str, int]]:
    """(imported module, line) for the imports in ``module``, deduplicated; ``from pkg import name`` gives
    ``pkg.name`` when that is a module of the package, else ``pkg``. ``lazy`` includes the imports inside
    functions; imports under ``if TYPE_CHECKING:`` never count (they do not run)."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    found: dict[tuple[str, int], None] = {}
    for node in _statements(tree.body, lazy):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found[alias.name, node.lineno] = None
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            for alias in node.names:
                child = f"{source}.{alias.name}"
                found[(child if child in MODULES else source), node.lineno] = None
    return list(found)


def _statements(body: list[ast.stmt], lazy: bool) -> Iterator[ast.stmt]:
    """Every statement of ``body``, recursively, except ``if TYPE_CHECKING:`` blocks and, unless ``lazy``,
    function bodies."""
    for node in body:
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _statements(node.orelse, lazy)
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and not lazy:
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            children = getattr(node, field, None)
            if isinstance(children, list):
                yield from _statements([c for c in children if isinstance(c, (ast.stmt, ast.excepthandler))],
                                       lazy)
        for case in getattr(node, "cases", []):  # match statements
            yield from _statements(case.body, lazy)


def _package_dependency(imported: str) -> str | None:
    """The hvdlite module an import loads, or None for outside modules."""
    while imported and imported not in MODULES:
        imported = imported.rpartition(".")[0]
    return imported or None


def layer(module: str) -> str:
    """The layer of an hvdlite module (the first of LAYERS that is it or a package above it)."""
    return next(name for name in LAYERS if module == name or module.startswith(name + "."))


def _allowed(importer: str, target: str) -> bool:
    """Whether module ``importer`` may import hvdlite module ``target`` under MAY_IMPORT."""
    own = layer(importer)
    if layer(target) == own:
        return True
    return any(target == entry or (entry.endswith(".*") and layer(target) == entry[:-2])
               for entry in MAY_IMPORT[own])


def test_every_import_follows_the_table() -> None:
    leaks = []
    for module in MODULES:
        for imported, line in _imports(module, lazy=True):
            target = _package_dependency(imported)
            if target is not None and not _allowed(module, target):
                leaks.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line}: {layer(module)} imports "
                             f"{target}; it may import {sorted(MAY_IMPORT[layer(module)])} (see MAY_IMPORT; the "
                             f"frontends' needs go in hvdlite.core.frontend, the launcher's in hvdlite.core.launch)")
    assert not leaks, "imports against the layering table:\n" + "\n".join(leaks)


def test_no_layer_loads_a_framework_it_does_not_serve() -> None:
    leaks = [f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} imports {imported}"
             for module in MODULES for imported, line in _imports(module, lazy=True)
             if imported.split(".")[0] in MUST_NOT_IMPORT.get(layer(module), ())]
    assert not leaks, "\n".join(leaks)


def test_the_table_covers_every_package_and_names_real_modules() -> None:
    """Every package is a layer with a row in the table, and every entry names a module or layer that exists
    (a stale row would allow what nobody checks)."""
    packages = {module for module in MODULES if _is_package(module)}
    assert packages <= set(MAY_IMPORT), sorted(packages - set(MAY_IMPORT))
    assert set(MAY_IMPORT) == set(LAYERS) and set(MUST_NOT_IMPORT) <= set(LAYERS)
    for entries in MAY_IMPORT.values():
        for entry in entries:
            assert (entry[:-2] in LAYERS) if entry.endswith(".*") else entry in MODULES, entry
    # the rules can fail: a frontend reaching into the engine, the launcher into the runtime
    assert not _allowed("hvdlite.torch.async_ops", "hvdlite.core.engine.handles")
    assert not _allowed("hvdlite.run.task", "hvdlite.core.runtime")
    assert not _allowed("hvdlite.core.engine.loop", "hvdlite.core.runtime")
    assert not _allowed("hvdlite.torch.optimizer", "hvdlite.tensorflow.reduction")
    assert _allowed("hvdlite.tensorflow.keras.optimizer", "hvdlite.tensorflow.reduction")


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module in MODULES:
        for imported, _ in _imports(module, lazy=CYCLES_COUNT_LAZY_IMPORTS):
            target = _package_dependency(imported)
            if target and target != module:
                graph[module].add(target)
                # importing a.b.c runs a and a.b first
                parent = target.rpartition(".")[0]
                while parent and parent != module and not module.startswith(parent + "."):
                    graph[module].add(parent)
                    parent = parent.rpartition(".")[0]
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """One shortest cycle per strongly connected component of more than one module (Tarjan), with the
    component's modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(set(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [(_path_through(graph, sorted(c)[0], c), sorted(c)) for c in components]


def _path_through(graph: dict[str, set[str]], start: str, component: set[str]) -> list[str]:
    """A shortest cycle from ``start`` back to itself inside ``component`` (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return path[::-1] + [start]
                if w not in previous:
                    previous[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # unreachable for a strongly connected component


def test_no_import_cycles() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles among hvdlite modules:\n" + "\n".join(
        f"{' -> '.join(path)} (modules in this loop: {', '.join(members)})" for path, members in cycles)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_every_module_is_under_the_line_cap() -> None:
    long = {str(p.relative_to(PACKAGE.parent)): n for p in MODULES.values() if (n := _lines(p)) >= MAX_LINES}
    over = {m: n for m, n in long.items() if n > OVER_CAP.get(m, MAX_LINES - 1)}
    assert not over, f"modules of {MAX_LINES} lines or more (simplify them): {over}"
    fixed = sorted(set(OVER_CAP) - set(long))
    assert not fixed, f"{fixed} are under {MAX_LINES} lines now: take them out of OVER_CAP"


def test_the_package_and_the_benchmarks_stay_within_their_line_budgets() -> None:
    package = sum(_lines(p) for p in MODULES.values())
    benchmarks = sum(_lines(p) for p in BENCHMARKS.glob("*.py"))
    assert package > 10_000 and benchmarks > 1_000  # the counts see the trees
    assert package <= PACKAGE_BUDGET, f"hvdlite/ has {package} lines, over its budget of {PACKAGE_BUDGET}: subtract"
    assert benchmarks <= BENCHMARKS_BUDGET, \
        f"benchmarks/*.py have {benchmarks} lines, over their budget of {BENCHMARKS_BUDGET} (lab/ aside): subtract"


def test_only_the_mpi_module_imports_mpi4py() -> None:
    importers = sorted({m for m in MODULES for imported, _ in _imports(m, lazy=True)
                        if imported == "mpi4py" or imported.startswith("mpi4py.")})
    assert importers == [MPI_MODULE], (f"only {MPI_MODULE} may import mpi4py; importers: {importers}")


def test_the_checks_see_the_package() -> None:
    """Guards the checks above against passing vacuously (a moved package, a broken walk)."""
    assert {"hvdlite", "hvdlite.core", "hvdlite.torch", "hvdlite.tensorflow", "hvdlite.keras"} <= set(MODULES)
    graph = _graph()
    assert "hvdlite.core" in graph["hvdlite"] and sum(map(len, graph.values())) > 50
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [(["a", "b", "c", "a"], ["a", "b", "c"])]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _private_uses(path: Path) -> list[str]:
    """``line: name`` of each import or attribute chain of ``path`` that reaches LAB_ONLY (``hvd.core.runtime``
    counts as much as ``import hvdlite.core.runtime``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute):
            names = [ast.unparse(node).replace("hvd.", "hvdlite.", 1)]
        found += [f"{node.lineno}: {name}" for name in names
                  if any(name == p or name.startswith(p + ".") or f".{p[8:]}." in f".{name}." for p in LAB_ONLY)]
    return sorted(set(found))


def test_benchmarks_outside_the_lab_use_no_engine_internals() -> None:
    """The tool's benchmarks measure what a user gets; what needs the engine's inside is a lab script."""
    scripts = sorted(BENCHMARKS.glob("*.py"))
    assert len(scripts) > 5 and _private_uses(BENCHMARKS / "lab" / "latency_breakdown.py")  # the check sees
    offending = {p.name: uses for p in scripts if (uses := _private_uses(p))}
    assert not offending, f"benchmarks/ scripts reaching into the engine or runtime (move them to lab/): {offending}"

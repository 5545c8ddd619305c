"""The package's shape: imports point down the floors, no import cycles, ``magi_core.bench`` only reached from
the CLI, small rooms, short files.

The import graph is read from the source with :mod:`ast` (nothing is imported): every ``import`` and
``from ... import`` statement of a module, at module level or inside functions, except those under
``if TYPE_CHECKING:`` (they never run). Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b``, so
those are edges too, except the importer's own parent packages: they are necessarily already being
imported when the importer runs. Naming a package itself (``import a.b``, or ``from a.b import name`` where
``name`` is not a submodule) is always an edge, so a submodule that takes names from its own package's
``__init__`` while that ``__init__`` imports the submodule is a cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import pytest

import magi_core

PACKAGE = "magi_core"
ROOT = Path(magi_core.__file__).resolve().parent
#: Modules outside ``magi_core.bench`` allowed to import it (the CLI dispatches ``magi demo`` / ``magi bench``).
BENCH_IMPORTERS = {"magi_core.cli", "magi_core.__main__"}
MAX_TOP_LEVEL_MODULES = 8
MAX_PACKAGE_MODULES = 10
MAX_FILE_LINES = 500

#: The floors of ``docs/architecture.md``, lowest first: a module imports only from its own room or from a room
#: on a lower floor (rooms on one floor never import each other). A module's room is the longest name here that
#: is a prefix of it (``magi_core.host.shm`` -> ``magi_core.host``; ``magi_core`` alone is the package's
#: ``__init__``).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("magi_core.errors", "magi_core._once"),
    ("magi_core._env",),
    ("magi_core.plugin",),
    ("magi_core.config",),
    ("magi_core.passes", "magi_core.plan", "magi_core.host"),
    ("magi_core.execute", "magi_core.testing"),
    ("magi_core.compile",),
    ("magi_core.api",),
    ("magi_core",),
    ("magi_core.bench",),
    ("magi_core.cli",),
    ("magi_core.__main__",),
)

#: Files over :data:`MAX_FILE_LINES` lines that hold one idea each (path under ``magi_core/`` -> the idea).
LONG_FILES: dict[str, str] = {
    "compile/runtime.py": "the lifecycle of one compiled graph: warm-up, profiling, planning, installing the plan",
    "config.py": "OffloadConfig: its fields, their validation on construction and their resolution (code, options, "
                 "environment)",
    "plugin/manager.py": "the backend registry: each installed backend's record (loaded, validated, probed) and the "
                         "choice among them",
    "testing/conformance.py": "the conformance suite: one test per hook contract, one module for pytest --pyargs",
}

Graph = Mapping[str, Iterable[str]]


# -- the import graph -----------------------------------------------------------------------------------------
def module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file for every module of the package at ``root`` (packages as their ``__init__``)."""
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = rel.parts
        if any(not (root.joinpath(*parts[:i]) / "__init__.py").exists() for i in range(len(parts))):
            continue  # not inside a package (a stray script or data directory)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((package, *parts))] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, skipping the bodies of ``if TYPE_CHECKING:`` (not their ``else``).

    ``importlib.import_module("a.b")`` with a literal name counts as ``import a.b``.
    """
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
        return
    if (
        isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        yield ast.Import(names=[ast.alias(name=node.args[0].value)])
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        for statement in node.orelse:
            yield from _import_nodes(statement)
        return
    for child in ast.iter_child_nodes(node):
        yield from _import_nodes(child)


def _ancestors(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def module_imports(module: str, path: Path, modules: Mapping[str, Path]) -> set[str]:
    """The modules of ``modules`` that running ``module`` (at ``path``) imports; see the module docstring."""
    is_package = path.name == "__init__.py"
    parents = _ancestors(module)
    edges: set[str] = set()

    def implied(target: str) -> None:
        """The packages above ``target`` that importing it runs (not the importer's own parents)."""
        edges.update(p for p in _prefixes(target)[:-1] if p in modules and p not in parents)

    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                implied(alias.name)
                if alias.name in modules:
                    edges.add(alias.name)
            continue
        if node.level:
            base = module if is_package else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            source = f"{base}.{node.module}" if node.module else base
        else:
            source = node.module or ""
        if source not in modules:
            continue
        implied(source)
        names = [alias.name for alias in node.names]
        submodules = {f"{source}.{n}" for n in names if f"{source}.{n}" in modules}
        edges |= submodules
        if source not in parents or len(submodules) < len(names):
            edges.add(source)  # the package itself runs, or names are taken from its __init__
    edges.discard(module)
    return edges


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    modules = module_files(root, package)
    return {name: module_imports(name, path, modules) for name, path in modules.items()}


# -- cycles ----------------------------------------------------------------------------------------------------
def _components(graph: Graph) -> list[list[str]]:
    """Strongly connected components (Tarjan, iterative), each in discovery order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    nodes = sorted(set(graph) | {t for ts in graph.values() for t in ts})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
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
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                out.append(component[::-1])
    return out


def _cycle_through(graph: Graph, start: str, within: set[str]) -> list[str]:
    """A shortest cycle from ``start`` back to itself using only ``within`` (breadth-first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for child in sorted(graph.get(node, ())):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child in within and child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # unreachable for a strongly connected component


def find_cycles(graph: Graph) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component that has one, sorted."""
    cycles = []
    for component in _components(graph):
        members = set(component)
        if len(component) > 1 or component[0] in graph.get(component[0], ()):
            cycles.append(_cycle_through(graph, min(component), members))
    return sorted(cycles)


# -- the checks ------------------------------------------------------------------------------------------------
def test_no_import_cycles() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles in magi_core:\n" + "\n".join(" -> ".join(c) for c in cycles)


def room_of(module: str, floors: tuple[tuple[str, ...], ...] = FLOORS) -> tuple[str, int]:
    """The room (longest matching name of ``floors``) holding ``module``, and its floor (0 = lowest)."""
    best: tuple[str, int] | None = None
    for level, rooms in enumerate(floors):
        for room in rooms:
            if (module == room or module.startswith(room + ".")) and (best is None or len(room) > len(best[0])):
                best = (room, level)
    if best is None:
        raise AssertionError(f"{module} is in no room of FLOORS: give its package a floor")
    return best


def upward_imports(graph: Graph, floors: tuple[tuple[str, ...], ...] = FLOORS) -> list[str]:
    """Every import from one room into another room that is not on a lower floor, as readable lines, sorted."""
    bad = []
    for module, targets in graph.items():
        room, level = room_of(module, floors)
        for target in targets:
            to_room, to_level = room_of(target, floors)
            if to_room != room and to_level >= level:
                way = "up" if to_level > level else "sideways"
                bad.append(f"{module} (floor {level}) imports {target} (floor {to_level}, {way})")
    return sorted(bad)


def test_imports_point_down() -> None:
    bad = upward_imports(import_graph())
    assert not bad, "imports that do not point down the floors (FLOORS, docs/architecture.md):\n" + "\n".join(bad)


def long_files(root: Path = ROOT, limit: int = MAX_FILE_LINES) -> dict[str, int]:
    """Relative path -> line count of every module under ``root`` longer than ``limit`` lines."""
    counts = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in sorted(root.rglob("*.py"))}
    return {path: n for path, n in counts.items() if n > limit}


def test_files_stay_short() -> None:
    """One idea per file: a file over the limit is split, or named in LONG_FILES with the one idea it holds."""
    found = long_files()
    unlisted = {path: n for path, n in found.items() if path not in LONG_FILES}
    assert not unlisted, (f"files over {MAX_FILE_LINES} lines: {unlisted}; split them by idea, or add one that is "
                          "a single idea to LONG_FILES saying which")
    stale = sorted(set(LONG_FILES) - set(found))
    assert not stale, f"LONG_FILES names files that are not over {MAX_FILE_LINES} lines (any more): {stale}"
    assert all(idea.strip() for idea in LONG_FILES.values()), "every LONG_FILES entry names its idea"


def _in_bench(module: str) -> bool:
    return module == "magi_core.bench" or module.startswith("magi_core.bench.")


def test_bench_is_reached_only_from_the_cli() -> None:
    bad = sorted(
        f"{module} imports {', '.join(sorted(filter(_in_bench, targets)))}"
        for module, targets in import_graph().items()
        if not (_in_bench(module) or module in BENCH_IMPORTERS) and any(map(_in_bench, targets))
    )
    assert not bad, "only the CLI may import magi_core.bench:\n" + "\n".join(bad)


def test_rooms_stay_small() -> None:
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"magi_core/ holds {len(top)} modules (max {MAX_TOP_LEVEL_MODULES})"
    counts = {str(init.parent.relative_to(ROOT.parent)): len(list(init.parent.glob("*.py")))
              for init in ROOT.rglob("__init__.py")}
    crowded = {k: n for k, n in counts.items() if n > MAX_PACKAGE_MODULES}
    assert not crowded, f"packages with more than {MAX_PACKAGE_MODULES} modules: {crowded}"


#: Test folders that are no subpackage: ``api`` tests the top-level modules (api, config, cli); the rest hold what
#: the tests share (helpers, fake packages, worker scripts, the mutation runner).
TEST_FOLDERS_OF_NO_PACKAGE = {"api", "helpers", "fakes", "host_workers", "mutations", "recording_backend"}


def test_tests_mirror_the_package() -> None:
    """A test module lives in ``tests/<room>/`` for the room of ``magi_core`` it tests (repository-wide rules at the
    top), and its name is unique: pytest imports test modules by name, with no package around them."""
    tests = Path(__file__).resolve().parent
    modules = sorted(tests.rglob("test_*.py"))
    rooms = {p.relative_to(tests).parts[0] for p in modules if len(p.relative_to(tests).parts) > 1}
    packages = {init.parent.name for init in ROOT.glob("*/__init__.py")}
    stray = sorted(rooms - packages - TEST_FOLDERS_OF_NO_PACKAGE)
    assert not stray, f"test folders that mirror no package of magi_core: {stray}; move their tests to the room tested"
    names = [p.name for p in modules if p.relative_to(tests).parts[0] not in {"fakes", "recording_backend"}]
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, f"test module names used twice: {twice}; name each after what it tests"


def test_graph_sees_real_imports() -> None:
    """Sanity: known edges of the real package are found, TYPE_CHECKING-only ones are not."""
    graph = import_graph()
    assert "magi_core.api" in graph["magi_core"]  # package __init__ -> submodule
    assert "magi_core.plan.contract" in graph["magi_core.plan.registry"]
    assert "magi_core.plan" not in graph["magi_core.plan.registry"]  # own parent package: not an edge
    assert "magi_core.plan" in graph["magi_core.compile.backend"]  # another package's __init__ runs
    assert "magi_core.config" not in graph["magi_core.plan.heuristic"]  # only under TYPE_CHECKING


# -- the checker can fail ----------------------------------------------------------------------------------------
def test_every_module_has_a_floor() -> None:
    for module in import_graph():
        room_of(module)


def test_upward_imports_on_synthetic_graphs() -> None:
    floors = (("p.low",), ("p.mid", "p.side"), ("p",))
    assert room_of("p.mid.x", floors) == ("p.mid", 1) and room_of("p", floors) == ("p", 2)
    assert upward_imports({"p.mid.x": {"p.low.y", "p.mid.z"}, "p": {"p.mid.x"}}, floors) == []
    assert upward_imports({"p.low.y": {"p.mid.x"}}, floors) == ["p.low.y (floor 0) imports p.mid.x (floor 1, up)"]
    assert upward_imports({"p.mid": {"p.side.k"}}, floors) == ["p.mid (floor 1) imports p.side.k (floor 1, sideways)"]
    with pytest.raises(AssertionError, match="no room"):
        room_of("q.x", floors)


def test_long_files_on_a_synthetic_package(tmp_path: Path) -> None:
    root = _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "x = 1\n" * 5, "pkg/sub/__init__.py": "",
                             "pkg/sub/b.py": "x = 1\n" * 3})
    assert long_files(root, 4) == {"a.py": 5}
    assert long_files(root, 2) == {"a.py": 5, "sub/b.py": 3}


def test_find_cycles_on_synthetic_graphs() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"a"}}) == [["a", "a"]]
    two = find_cycles({"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"c"}, "e": {"a", "c"}})
    assert two == [["a", "b", "a"], ["c", "d", "c"]]
    big = find_cycles({"a": {"b", "x"}, "b": {"c"}, "c": {"d", "a"}, "d": {"b"}, "x": set()})
    assert len(big) == 1 and big[0][0] == big[0][-1] == "a" and set(big[0]) <= {"a", "b", "c", "d"}


def _write(root: Path, files: Mapping[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


@pytest.mark.parametrize(
    ("files", "cycles"),
    [
        # a submodule taking a name from its own package's __init__, which imports it: a cycle
        ({"pkg/__init__.py": "from pkg.sub import f\n", "pkg/sub.py": "def f():\n    from pkg import g\n",
          "pkg/other.py": ""}, [["pkg", "pkg.sub", "pkg"]]),
        # importlib.import_module with a literal name is an import
        ({"pkg/__init__.py": "import pkg.x\n", "pkg/x.py": "import importlib\nimportlib.import_module('pkg')\n"},
         [["pkg", "pkg.x", "pkg"]]),
        # importing a sibling submodule (also with "from pkg import other"): not a cycle
        ({"pkg/__init__.py": "from pkg.sub import f\n", "pkg/sub.py": "from pkg import other\nimport pkg.other\n",
          "pkg/other.py": ""}, []),
        # relative imports resolve; a cycle inside a function still counts; TYPE_CHECKING imports do not
        ({"pkg/__init__.py": "", "pkg/a/__init__.py": "", "pkg/a/x.py": "from ..b import y\n",
          "pkg/b/__init__.py": "", "pkg/b/y.py": "def f():\n    from pkg.a import x\n"},
         [["pkg.a.x", "pkg.b.y", "pkg.a.x"]]),
        ({"pkg/__init__.py": "", "pkg/x.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
          "    from pkg.y import Y\nelse:\n    import os\n", "pkg/y.py": "from . import x\n"}, []),
        # importing a.b.c runs a.b's __init__: a cycle through another package's __init__
        ({"pkg/__init__.py": "", "pkg/a/__init__.py": "from pkg.a.m import M\n", "pkg/a/m.py": "import pkg.b.n\n",
          "pkg/b/__init__.py": "", "pkg/b/n.py": "", "pkg/b/z.py": "", "pkg/a/k.py": "",
          "pkg/b/__main__.py": ""}, []),
        ({"pkg/__init__.py": "", "pkg/a/__init__.py": "from pkg.a.m import M\n", "pkg/a/m.py": "import pkg.b.n\n",
          "pkg/b/__init__.py": "from pkg.a import k\n", "pkg/b/n.py": "", "pkg/a/k.py": ""},
         [["pkg.a", "pkg.a.m", "pkg.b", "pkg.a"]]),
    ],
)
def test_find_cycles_on_synthetic_packages(tmp_path: Path, files: dict[str, str], cycles: list[list[str]]) -> None:
    root = _write(tmp_path, files)
    assert find_cycles(import_graph(root, "pkg")) == cycles

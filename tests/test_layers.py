"""The package's floors, read from the source: which `prodigy_core` module imports which.

Every import statement of every module is parsed with `ast` (function-level and `if TYPE_CHECKING:` imports
included: a lazy import is a dependency all the same), independently of how the package runs. The ground
floor (`paths`, `names`, `registry`, `safe_io`, `seeding`, `progress`, `lab`, the package itself) imports
no other module of the package but the few named in GROUND (the package `progress`, `registry` `names`);
the library's rules (`aggregators`, `attacks`) never reach the run configuration nor what runs it; the
results store never reaches the experiments; and the import graph has no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import prodigy_core

PACKAGE_DIR = Path(prodigy_core.__file__).resolve().parent
PACKAGE = "prodigy_core"
INIT = "__init__"  # the package itself (`import prodigy_core`)

# The ground floor and, per module, the ground-floor modules it is designed to import.
GROUND: dict[str, set[str]] = {
    m: set() for m in (INIT, "paths", "names", "registry", "safe_io", "seeding", "progress", "lab", "streams")
}
GROUND["registry"] = {"names"}  # did-you-mean hints, type words
GROUND["seeding"] = {"names"}  # the precisions
GROUND[INIT] = {"progress"}  # settles tqdm.auto before any module imports it
RULES = ("aggregators", "attacks")
ABOVE_RULES = {"config", "experiments", "results", "training"}
# The floors of docs/library.md: a module imports only modules of its own floor or below.
FLOORS = [
    set(GROUND),
    {"aggregators", "attacks", "models", "data"},  # the library
    {"config"},
    {
        "step_variants",
        "local_training",
        "evaluation",
        "training",
        "groups",
        "results",
        "flower",
    },  # runs (flower: the optional Flower strategy)
    {"experiments", "report", "explorer"},  # grids and outputs
    {"reproduce", "cli"},  # entry points
]


def package_imports(source: str, module: str, modules: set[str]) -> set[str]:
    """The `prodigy_core` modules that `source` (the text of prodigy_core/<module>.py) imports, anywhere in
    the file; `import prodigy_core` and `from prodigy_core import __version__` count as INIT."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `from . import x`, `from .x import y` (prodigy_core is flat)
                base = PACKAGE if node.module is None else f"{PACKAGE}.{node.module}"
            else:
                base = node.module or ""
            # `from prodigy_core import results` imports a module; `from prodigy_core import __version__`
            # the package; `from prodigy_core.config import X` the module config.
            names = [f"{base}.{a.name}" if base == PACKAGE and a.name in modules else base
                     for a in node.names]  # fmt: skip
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] != PACKAGE:
                continue
            found.add(parts[1] if len(parts) > 1 and parts[1] in modules else INIT)
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {p.stem: p for p in PACKAGE_DIR.glob("*.py")}
    modules = set(files)
    return {m: package_imports(p.read_text(encoding="utf-8"), m, modules) for m, p in files.items()}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module that importing `start` may import, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], by depth-first search (grey: on the current path)."""
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(graph, white)
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = grey
        path.append(node)
        for nxt in sorted(graph[node]):
            if colour[nxt] == grey:
                return path[path.index(nxt) :] + [nxt]
            if colour[nxt] == white and (cycle := visit(nxt)) is not None:
                return cycle
        colour[node] = black
        path.pop()
        return None

    for node in sorted(graph):
        if colour[node] == white and (cycle := visit(node)) is not None:
            return cycle
    return None


GRAPH = import_graph()


# ------------------------------------------------------------------------------ the method itself


def test_the_parser_sees_every_form_of_import():
    source = """
import os
import prodigy_core
from prodigy_core import paths, results as store, __version__
import prodigy_core.names as n
from prodigy_core.config import RunConfig
from . import seeding
from .safe_io import atomic_write
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from prodigy_core.experiments import Experiment

def f():
    from prodigy_core.training import run

class C:
    def g(self):
        import prodigy_core.report
"""
    modules = {"paths", "results", "names", "config", "seeding", "safe_io", "experiments", "training",
               "report", "data", "me"}  # fmt: skip
    assert package_imports(source, "me", modules) == modules - {"data", "me"} | {INIT}


def test_the_dfs_finds_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"b", "c"}}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) is None  # a diamond is no cycle
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_the_graph_covers_the_package():
    assert set(GROUND) | set(RULES) | ABOVE_RULES <= set(GRAPH)
    # edges every reader of the code can see, so an empty graph cannot pass the tests below
    assert {"aggregators", "attacks", "config", "safe_io"} <= GRAPH["training"]
    assert "experiments" in GRAPH["reproduce"] and "report" in GRAPH["explorer"]


# ------------------------------------------------------------------------------ the floors


@pytest.mark.parametrize("module", sorted(GROUND))
def test_ground_floor_imports_no_other_module_of_the_package(module):
    assert GRAPH[module] <= GROUND[module], f"{module} imports {sorted(GRAPH[module] - GROUND[module])}"


@pytest.mark.parametrize("rule", RULES)
def test_the_rules_never_reach_the_run_configuration_nor_what_runs(rule):
    assert not reachable(GRAPH, rule) & ABOVE_RULES, f"{rule} reaches {sorted(reachable(GRAPH, rule))}"


def test_the_results_store_never_reaches_the_experiments():
    assert "experiments" not in reachable(GRAPH, "results"), sorted(reachable(GRAPH, "results"))


def test_every_module_imports_only_its_own_floor_or_below():
    floor = {m: i for i, modules in enumerate(FLOORS) for m in modules}
    unplaced = sorted(set(GRAPH) - set(floor))
    assert not unplaced, f"place {unplaced} on a floor of FLOORS here and in docs/library.md's floors"
    upward = sorted((m, n) for m, imported in GRAPH.items() for n in imported if floor[n] > floor[m])
    assert not upward, f"imports from a higher floor: {upward}"


def test_no_import_cycle():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_every_module_opens_with_what_it_owns(module):
    doc = ast.get_docstring(ast.parse((PACKAGE_DIR / f"{module}.py").read_text(encoding="utf-8")))
    assert doc and len(doc.split()) >= 8, f"prodigy_core/{module}.py: no docstring saying what it owns"

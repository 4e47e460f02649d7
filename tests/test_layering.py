"""The packages of dsinfer import downward only: every import (at module level, under ``TYPE_CHECKING`` or inside a
function) goes from a floor to the same floor or one below it, and no top-level package or module imports itself
back through others.

The floors, top to bottom: the command line; the tools (benchmarks, evaluation, training); the front end (the
server, the offline ``LLM``); the chat protocol both front ends share (``chat``); ranks (``parallel``); the engine;
speculative decoding; sampling; the models; their layers; the KV caches; Engram; kernels; ops; and the base every
floor reads (config, settings, tokenizer, ...).
"""

from __future__ import annotations

import ast
from pathlib import Path

import dsinfer

FLOORS: tuple[frozenset[str], ...] = (
    frozenset({"cli", "chat_cli", "__main__"}),
    frozenset({"bench", "eval", "training"}),
    frozenset({"server", "llm", "offline_chat", "plan_cli"}),
    frozenset({"chat"}),
    frozenset({"parallel"}),
    frozenset({"engine"}),
    frozenset({"speculative"}),
    frozenset({"sampling"}),
    frozenset({"offload", "memory_plan"}),
    frozenset({"models"}),
    frozenset({"layers"}),
    frozenset({"kv"}),
    frozenset({"engram"}),
    frozenset({"kernels"}),
    frozenset({"ops"}),
    frozenset(
        {
            "config",
            "envs",
            "arg_types",
            "cpu_threads",
            "hub",
            "graph_capture",
            "images",
            "tokenizer",
            "grammar",
            "sampling_params",
        }
    ),  # fmt: skip
)

ROOT = Path(dsinfer.__file__).parent


def _unit(module: str) -> str | None:
    """The top-level package or module of ``dsinfer.<unit>...``; None outside dsinfer or for the root itself."""
    parts = module.split(".")
    return parts[1] if parts[0] == "dsinfer" and len(parts) > 1 else None


def _imported(tree: ast.AST) -> set[str]:
    """Every dsinfer module (or name of the root package) a file imports, wherever the import statement is."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "dsinfer":
                found.update(f"dsinfer.{alias.name}" for alias in node.names)
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def import_edges() -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> the importing modules, over every file of the package."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(("dsinfer", *(parts[:-1] if parts[-1] == "__init__" else parts)))
        source = _unit(module)
        if source is None:
            continue
        for imported in _imported(ast.parse(path.read_text(), str(path))):
            target = _unit(imported)
            if target is not None and target != source and target != "__version__":
                edges.setdefault((source, target), [])
                if module not in edges[(source, target)]:
                    edges[(source, target)].append(module)
    return edges


def _floor(unit: str) -> int:
    for index, floor in enumerate(FLOORS):
        if unit in floor:
            return index
    raise AssertionError(f"dsinfer.{unit} has no floor in FLOORS: give it one")


def test_every_unit_has_a_floor():
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    modules = {path.stem for path in ROOT.glob("*.py") if path.stem != "__init__"}
    for unit in sorted(packages | modules):
        _floor(unit)


def test_imports_go_downward():
    upward = [
        f"{source} -> {target} ({', '.join(modules)})"
        for (source, target), modules in sorted(import_edges().items())
        if _floor(source) > _floor(target)
    ]
    assert not upward, "imports up the floors:\n" + "\n".join(upward)


def test_no_import_cycle_between_units():
    graph: dict[str, set[str]] = {}
    for source, target in import_edges():
        graph.setdefault(source, set()).add(target)
    cycles = []
    for source, targets in graph.items():
        for target in targets:
            if source in _reachable(graph, target):
                cycles.append(f"{source} -> {target} -> ... -> {source}")
    assert not cycles, "import cycles:\n" + "\n".join(sorted(cycles))


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        unit = stack.pop()
        if unit not in seen:
            seen.add(unit)
            stack.extend(graph.get(unit, ()))
    return seen


def test_speculative_never_imports_the_engine():
    edges = import_edges()
    assert ("speculative", "engine") not in edges, edges.get(("speculative", "engine"))
    assert ("sampling", "engine") not in edges, edges.get(("sampling", "engine"))


IMPORT_TABLE_HEADER = "| floor | unit | imports of dsinfer's |\n| --- | --- | --- |\n"


def import_table() -> str:
    """The floors and what each unit imports, as docs/architecture.md shows them: one row a unit, top floor first
    (numbered from 1), its imports in floor order (``python tests/test_layering.py`` prints it for the page)."""
    edges = import_edges()
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    modules = {path.stem for path in ROOT.glob("*.py") if path.stem != "__init__"}
    order = {unit: (_floor(unit), unit) for unit in packages | modules}
    rows = []
    for unit in sorted(order, key=order.get):
        imported = sorted((target for source, target in edges if source == unit), key=order.get)
        spelled = f"`{unit}/`" if unit in packages else f"`{unit}.py`"
        rows.append(f"| {_floor(unit) + 1} | {spelled} | {', '.join(imported) or 'nothing'} |\n")
    return IMPORT_TABLE_HEADER + "".join(rows)


if __name__ == "__main__":
    print(import_table(), end="")

"""The model contract holds: code outside ``dsinfer/models`` never asks which model (or cache, or config variant) it
holds and never calls another package's private names; and every module imports on its own, with no cycle.

The first two rules are checked on the source (an AST walk of the whole package), so a new type check or private
call anywhere fails here before any behaviour test would notice it. The third imports every module first, in a
fresh set of ``dsinfer`` modules each time: a module that joins an import cycle then meets a partially
initialised module and raises.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dsinfer"

# Class names that say which model family, cache or config variant an object is: only dsinfer/models may ask.
FAMILY_WORDS = ("Deepseek", "V41", "MTP", "DSpark", "Block", "KVCache")
CONFIG_HOME = "config"  # the configs may tell their own variants apart


# Private calls whose move into a public helper belongs to the engine's output path (its own change).
def _trees() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))}


def _subpackage(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else "<top>"


def _class_names(node: ast.AST) -> list[str]:
    names = (n for n in ast.walk(node) if isinstance(n, ast.Name | ast.Attribute))
    return [n.id if isinstance(n, ast.Name) else n.attr for n in names]


def family_checks(trees: dict[Path, ast.Module]) -> list[str]:
    """``isinstance`` / ``issubclass`` against a model, cache or V4.1 config class outside dsinfer/models."""
    found = []
    for path, tree in trees.items():
        home = _subpackage(path)
        if home == "models":
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 2):
                continue
            if node.func.id not in ("isinstance", "issubclass"):
                continue
            for name in _class_names(node.args[1]):
                family = any(word in name for word in FAMILY_WORDS) and not name.startswith("ModelConfig")
                variant = name.startswith("ModelConfigV41") and home != CONFIG_HOME
                if family or variant:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.func.id}(..., {name})")
    return found


def foreign_private_calls(trees: dict[Path, ast.Module]) -> list[str]:
    """Calls ``obj._name(...)`` (obj not self, cls or super()) where every ``def _name`` is in another subpackage."""
    definers: dict[str, set[str]] = defaultdict(set)
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("_"):
                if not node.name.startswith("__"):
                    definers[node.name].add(_subpackage(path))
    found = []
    for path, tree in trees.items():
        here, relative = _subpackage(path), path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name, target = node.func.attr, node.func.value
            if not name.startswith("_") or name.startswith("__"):
                continue
            if isinstance(target, ast.Name) and target.id in ("self", "cls"):
                continue
            if isinstance(target, ast.Call) and isinstance(target.func, ast.Name) and target.func.id == "super":
                continue
            owners = definers.get(name, set())
            if owners and here not in owners:
                found.append(f"{relative}:{node.lineno}: calls {name} defined in {'/'.join(sorted(owners))}")
    return found


def test_no_model_type_checks_outside_models():
    assert family_checks(_trees()) == []


def test_no_calls_into_another_packages_private_names():
    assert foreign_private_calls(_trees()) == []


def test_the_checks_see_what_they_forbid():
    """Each rule finds a planted violation (a rule that finds nothing proves nothing)."""
    planted = textwrap.dedent(
        """
        def run(model, attn):
            if isinstance(model, DeepseekV41) or isinstance(model.config, ModelConfigV41):
                return attn._project_out(model)
        """
    )
    layer = "def _project_out(self, out):\n    return out\n"
    trees = {PACKAGE / "engine" / "planted.py": ast.parse(planted), PACKAGE / "layers" / "planted.py": ast.parse(layer)}
    assert len(family_checks(trees)) == 2
    assert foreign_private_calls(trees) == ["engine/planted.py:4: calls _project_out defined in layers"]


IMPORT_EACH_FIRST = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    import dsinfer
    names = sorted(info.name for info in pkgutil.walk_packages(dsinfer.__path__, "dsinfer."))
    failed = []
    for name in names:
        for loaded in [m for m in sys.modules if m == "dsinfer" or m.startswith("dsinfer.")]:
            del sys.modules[loaded]
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
    print(len(names))
    print("\\n".join(failed))
    """
)


def test_every_module_imports_first_without_a_cycle():
    """Import every module of the package as the first ``dsinfer`` module of its interpreter (as ``python -c
    'import dsinfer.x.y'`` would): one that sits in an import cycle meets a partially initialised module."""
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH_FIRST], capture_output=True, text=True, cwd=PACKAGE.parent, check=False
    )
    assert result.returncode == 0, result.stderr
    count, *failed = result.stdout.strip().split("\n")
    assert int(count) > 200  # every module was tried
    assert [line for line in failed if line] == []

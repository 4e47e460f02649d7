"""``dsinfer.envs``: every ``DSINFER_*`` variable declared once, read nowhere else, a bad value named."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dsinfer import envs

PACKAGE = Path(envs.__file__).parent
FREE_TEXT = ("DSINFER_ENGRAM_SEGMENT", "DSINFER_HUGETLBFS", "DSINFER_RANK_AUTHKEY", "DSINFER_JUDGE_BASE_URL",
             "DSINFER_JUDGE_MODEL", "DSINFER_JUDGE_API_KEY")  # fmt: skip


def test_every_variable_is_declared_once_with_a_reason():
    names = [variable.name for variable in envs.ALL]
    assert len(names) == len(set(names))
    assert all(name.startswith("DSINFER_") for name in names)
    assert all(variable.why and variable.takes for variable in envs.ALL)
    assert len(envs.describe().splitlines()) == len(envs.ALL)


@pytest.mark.parametrize("variable", [v for v in envs.ALL if v.name not in FREE_TEXT], ids=lambda v: v.name)
def test_a_bad_value_is_one_error_naming_the_variable(monkeypatch, variable):
    monkeypatch.setenv(variable.name, "not a value")
    with pytest.raises(ValueError, match=f"^{variable.name} must be .*, got 'not a value'$"):
        variable.get()


def test_values_parse_and_unset_gives_the_default(monkeypatch):
    monkeypatch.delenv("DSINFER_OVERLAP_MAX_TOKENS", raising=False)
    assert envs.OVERLAP_MAX_TOKENS.get() == 256
    monkeypatch.setenv("DSINFER_OVERLAP_MAX_TOKENS", " 12 ")
    assert envs.OVERLAP_MAX_TOKENS.get() == 12
    monkeypatch.setenv("DSINFER_OVERLAP_MAX_TOKENS", "")
    assert envs.OVERLAP_MAX_TOKENS.get() == 256
    monkeypatch.setenv("DSINFER_ENGRAM_HOST_METHOD", "Zero-Copy")
    assert envs.ENGRAM_HOST_METHOD.get() == "zero_copy"
    monkeypatch.setenv("DSINFER_OPS", "routed_moe=reference, attention = triton")
    assert envs.OPS.get() == (("routed_moe", "reference"), ("attention", "triton"))
    monkeypatch.setenv("DSINFER_OPS", "routed_moe")
    with pytest.raises(ValueError, match="DSINFER_OPS must be comma-separated op=backend pairs"):
        envs.OPS.get()


def test_a_value_is_parsed_once_per_setting(monkeypatch):
    parsed = []

    def parse(text: str) -> int:
        parsed.append(text)
        return int(text)

    variable = envs.EnvVar("DSINFER_TEST_ONLY_COUNT", "an integer", parse, 0, "counts parses")
    monkeypatch.setenv(variable.name, "3")
    assert [variable.get() for _ in range(5)] == [3] * 5
    assert parsed == ["3"]
    monkeypatch.setenv(variable.name, "4")  # a changed value is seen at the next read
    assert variable.get() == 4
    assert parsed == ["3", "4"]


def _environment_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """Reads of the environment in ``tree`` whose key is a ``DSINFER_`` string or a name bound to one."""
    bound = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        if isinstance(node.value.value, str) and node.value.value.startswith("DSINFER_")
        for target in node.targets
        if isinstance(target, ast.Name)
    }

    def names_variable(key: ast.AST | None) -> bool:
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return key.value.startswith("DSINFER_")
        return isinstance(key, ast.Name) and key.id in bound

    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if node.func.attr == "getenv" or (node.func.attr in ("get", "pop") and is_environ(node.func.value)):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            key = node.left
        if names_variable(key):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_module_but_envs_reads_a_variable():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == Path(envs.__file__):
            continue
        for line, code in _environment_reads(ast.parse(path.read_text(), filename=str(path))):
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {code}")
    assert offenders == []


def test_the_check_sees_each_way_of_reading():
    source = (
        'import os\nNAME_ENV = "DSINFER_X"\na = os.environ.get("DSINFER_A")\nb = os.getenv(NAME_ENV)\n'
        'c = os.environ["DSINFER_C"]\nd = "DSINFER_D" in os.environ\ne = os.environ.get("HOME")\n'
    )
    assert [line for line, _ in _environment_reads(ast.parse(source))] == [3, 4, 5, 6]


def test_envs_imports_nothing_from_the_package():
    tree = ast.parse(Path(envs.__file__).read_text())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert not [name for name in imported if name.split(".")[0] == "dsinfer"]

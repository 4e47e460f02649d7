"""The README and the pages under docs/ name only what exists: every linked file, every repository path
(``dsinfer/engine/client.py``, ``engine/client.py``, ``benchmarks/indexer_decode.py``), every dotted module
(``dsinfer.server.launch``) and every code name they put in backticks (``ServedModel.verify_forward``,
``LLMEngine``, ``add_request``) is checked against the tree, so a rename that forgets the docs fails here.

docs/perf.md's history is a dated record of what the code was called then; only the part above it is checked.
"""

from __future__ import annotations

import ast
import importlib
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dsinfer"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_DIRS = ("dsinfer", "tests", "benchmarks", "scripts")
HISTORY = "\n## History\n"

# Names in backticks that belong to other projects (torch, Python, vLLM, Hugging Face, xgrammar, the protocol
# library): the check cannot find them in this tree, and that is right.
FOREIGN_NAMES = {
    "DeepseekV4ForCausalLM", "EngineCore", "AsyncOpenAI", "all_to_all_single", "masked_fill_", "set_sync_debug_mode",
    "cudaHostRegister", "cuMemCreate", "cuMemHostAlloc", "shm_open", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_HOME",
    "TRITON_CACHE_DIR", "OMP_NUM_THREADS", "PYTHONPATH", "CUDA_VISIBLE_DEVICES", "OPENAI_API_KEY", "ChatCompletion",
    "StructuralTag", "GrammarMatcher", "TokenizerInfo", "tl.dot", "tl.dot_scaled", "gc.freeze", "torch.argmax",
    "torch.cat", "torch.tensor", "torch._grouped_mm", "torch.compile", "Memset", "prefetch.global.L2",
    "cvt.f32.f16", "model.generate", "from_pretrained", "input_image", "image_url", "max_completion_tokens",
    "chat_template_kwargs", "reasoning_content", "stream_options", "top_logprobs", "tool_choice",
    "parallel_tool_calls", "response_format", "json_schema", "json_object", "reasoning_effort", "stop_token_ids",
    "ignore_eos", "min_tokens", "min_p", "top_k", "top_p", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "structured_outputs", "context_length_exceeded", "model_not_found", "model_path", "port",
    "model_name", "gpu_count", "n_llm_h", "n_llm_w", "tid2eid", "bias_vl", "repetition_penalty",
    "DeepseekV41Attention", "DeepseekV41Indexer", "DeepseekV41Engram", "hash_ids", "Pool",
}  # fmt: skip
# Files of other repositories the pages cite: Hugging Face's V4.1 modeling file, the MLX port's notes and
# modules, and the Hugging Face peer script that benchmarks/gpu_suite.sh runs from outside this tree (PEER=path).
FOREIGN_FILES = {"modeling_deepseek_v41.py", "docs/upstream-notes.md", "fakequant.py", "hf_v4_peer.py"}

BACKTICKED = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH_TOKEN = re.compile(r"^[\w.-]+(?:/[\w.-]*)+$")
FILE_NAME = re.compile(r"^[\w-]+\.(?:py|sh)$")
DOTTED_MODULE = re.compile(r"^dsinfer(?:\.\w+)+$")
CODE_NAME = re.compile(r"^(?:[A-Z]\w*[a-z]\w*|_?[a-z][a-z0-9]*_\w+)(?:\.\w+)*(?:\(\))?$")


def checked_text(page: Path) -> str:
    text = page.read_text()
    return text.split(HISTORY)[0] if page.name == "perf.md" else text


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@cache
def known_roots() -> frozenset[str]:
    """Where a path may start: the repository's top-level folders and the package's own (``engine/...``)."""
    top = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}
    return frozenset(top | {p.name for p in PACKAGE.iterdir() if p.is_dir()})


@cache
def file_names() -> frozenset[str]:
    return frozenset(p.name for folder in CODE_DIRS for p in (ROOT / folder).rglob("*") if p.is_file())


@cache
def defined_names() -> frozenset[str]:
    """Every name the code defines or spells: classes, functions, parameters, assigned names and attributes,
    dataclass and pydantic fields, and identifier-like strings (op names, registry keys, CLI destinations)."""
    names: set[str] = set()
    for folder in CODE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            if path == Path(__file__).resolve():
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(node.name)
                elif isinstance(node, ast.arg):
                    names.add(node.arg)
                elif isinstance(node, ast.Name):
                    names.add(node.id)
                elif isinstance(node, ast.Attribute):
                    names.add(node.attr)
                elif isinstance(node, ast.keyword) and node.arg:
                    names.add(node.arg)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names.update(re.findall(r"[A-Za-z_]\w*", node.value))
    return frozenset(names)


def path_exists(token: str) -> bool:
    token = token.rstrip("/")
    candidates = [ROOT / token, PACKAGE / token]
    return any(c.exists() or c.with_suffix(".py").exists() for c in candidates)


def module_exists(dotted: str) -> bool:
    """``dsinfer.a.b`` or ``dsinfer.a.b.Name``: the longest importable prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


def tokens(page: Path) -> list[str]:
    """The words of every backticked span, without the punctuation around them."""
    words = []
    for span in BACKTICKED.findall(checked_text(page)):
        words += [w.strip(",;:()[]'\"") for w in span.split()]
    return [w for w in words if w]


def unknown_paths(page: Path) -> list[str]:
    missing = []
    for word in tokens(page):
        if any(c in word for c in "<>{}*$=") or word.startswith(("/", ".", "~", "http")) or word in FOREIGN_FILES:
            continue
        if PATH_TOKEN.match(word) and word.split("/")[0] in known_roots():
            if not path_exists(word):
                missing.append(word)
        elif FILE_NAME.match(word) and word not in file_names():
            missing.append(word)
        elif DOTTED_MODULE.match(word) and not module_exists(word):
            missing.append(word)
    for target in LINK.findall(checked_text(page)):
        if target.startswith(("http", "#", "mailto:")):
            continue
        if not (page.parent / target.split("#")[0]).exists():
            missing.append(target)
    return missing


def unknown_names(page: Path) -> list[str]:
    missing = []
    for word in tokens(page):
        name = word.removesuffix("()")
        foreign = bool({name, name.split(".")[0]} & FOREIGN_NAMES) or name in FOREIGN_FILES
        if foreign or "/" in name or name.startswith("dsinfer."):
            continue
        if name.endswith((".py", ".sh", ".md")) or not CODE_NAME.match(word):
            continue
        if not set(name.split(".")) <= defined_names():
            missing.append(word)
    return missing


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_docs_name_only_existing_paths(page):
    assert unknown_paths(page) == []


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_docs_name_only_existing_code_names(page):
    assert unknown_names(page) == []


def test_the_check_finds_a_missing_path_and_name(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("`dsinfer/engine/no_such_file.py`, `engine/client.py`, `ServedModel.no_such_method`, `LLMEngine`")
    assert unknown_paths(page) == ["dsinfer/engine/no_such_file.py"]
    assert unknown_names(page) == ["ServedModel.no_such_method"]


# --- the environment variables' table in docs/configuration.md -------------------------------------------------

CONFIGURATION = ROOT / "docs" / "configuration.md"
ENV_TABLE_HEADER = "| variable | takes | default | why |\n| --- | --- | --- | --- |\n"


def shown_default(value: object) -> str:
    """A default as the environment spells it: flags 1 / 0, unset where the code keeps its own value."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "1" if value else "0"
    if value == ():
        return "none"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def env_table() -> str:
    """The table ``dsinfer.envs`` declares, one row a variable, in its order
    (``python tests/test_docs_paths.py`` prints it for the page)."""
    from dsinfer import envs

    rows = [f"| `{v.name}` | {v.takes} | {shown_default(v.default)} | {v.why} |\n" for v in envs.ALL]
    return ENV_TABLE_HEADER + "".join(rows)


def test_configuration_lists_exactly_the_declared_environment_variables():
    text = CONFIGURATION.read_text()
    start = text.index(ENV_TABLE_HEADER)
    end = text.find("\n\n", start)
    shown = text[start : len(text) if end < 0 else end + 1]
    assert shown == env_table(), "regenerate the table with: python tests/test_docs_paths.py"


# --- the floors and imports table in docs/architecture.md -----------------------------------------------------


def test_architecture_lists_the_floors_and_imports_the_layering_test_computes():
    from test_layering import IMPORT_TABLE_HEADER, import_table

    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index(IMPORT_TABLE_HEADER)
    end = text.find("\n\n", start)
    shown = text[start : len(text) if end < 0 else end + 1]
    assert shown == import_table(), "regenerate the table with: python tests/test_layering.py"


if __name__ == "__main__":
    print(env_table(), end="")

"""README's examples run as written: the curl request against the server ``dsinfer serve`` starts with no
arguments, the offline Python snippet, and the server options it lists exist."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import httpx
import pytest
from server_harness import running_server

from dsinfer.cli import build_parser
from dsinfer.models.tiny import INDEX_FILE, default_model_dir

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


@pytest.fixture
def default_model():
    """The embedded default model ships with the package (no download, nothing built on first use)."""
    directory = default_model_dir()
    assert (directory / INDEX_FILE).is_file() and (directory / "tokenizer.json").is_file()
    return directory


def curl_example() -> tuple[str, dict]:
    """The path and JSON body of README's first curl command."""
    command = re.search(r"^curl .*?(?<!\\)$", README.replace("\\\n", " "), re.MULTILINE).group(0)
    words = shlex.split(command)
    url = next(w for w in words if w.startswith("localhost:"))
    return url.removeprefix("localhost:8000"), json.loads(words[words.index("-d") + 1])


def test_readme_curl_example_works_against_the_default_server(default_model):
    path, body = curl_example()
    assert path == "/v1/chat/completions"
    with running_server(None, served_model_name=None) as (base, _engine):
        models = httpx.get(f"{base}/v1/models").json()["data"]
        assert [m["id"] for m in models] == [body["model"]]
        response = httpx.post(f"{base}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["role"] == "assistant"


def test_readme_python_example_runs(default_model):
    snippet = re.search(r"```python\n(.*?)```", README, re.DOTALL).group(1)
    assert "from dsinfer import LLM, SamplingParams" in snippet
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(snippet, "README.md", "exec"), {})
    assert printed.getvalue().strip()


def test_readme_lists_only_real_serve_options():
    listed = re.search(r"Options \(`dsinfer serve --help`.*?\): (.*?)\. DP x CP", README, re.DOTALL).group(1)
    flags = re.findall(r"--[a-z-]+", listed)
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    known = {flag for action in serve._actions for flag in action.option_strings}
    assert flags and set(flags) <= known, set(flags) - known
    assert {"--max-n", "--drain-timeout", "--api-key"} <= set(flags)

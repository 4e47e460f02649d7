"""Models named as Hugging Face repositories resolve through huggingface_hub: here from a hub cache this test
writes as huggingface_hub lays it out, with HF_HUB_OFFLINE=1 (no network)."""

from __future__ import annotations

import shutil

import httpx
import pytest
from server_harness import running_server

from dsinfer import LLM, SamplingParams
from dsinfer.hub import ModelNotFoundError, is_repo_id, resolve_model_dir

REPO = "tiny-org/tiny-v4"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def hub_cache(tiny_checkpoint, tmp_path, monkeypatch):
    """``models--ORG--NAME/{refs,snapshots}``: ``main`` -> the tiny checkpoint, ``v1`` -> a second snapshot."""
    repo = tmp_path / "hub" / ("models--" + REPO.replace("/", "--"))
    shutil.copytree(tiny_checkpoint, repo / "snapshots" / COMMIT)
    shutil.copytree(tiny_checkpoint, repo / "snapshots" / OTHER_COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v1").write_text(OTHER_COMMIT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hub"


def test_a_repository_id_resolves_to_its_cached_snapshot(hub_cache):
    assert is_repo_id(REPO) and not is_repo_id("not a repo") and not is_repo_id(str(hub_cache))
    assert resolve_model_dir(REPO, download_dir=hub_cache).name == COMMIT
    assert resolve_model_dir(REPO, revision="v1", download_dir=hub_cache).name == OTHER_COMMIT
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE"):
        resolve_model_dir("tiny-org/absent", download_dir=hub_cache)
    assert str(resolve_model_dir("./no/such/dir", download_dir=hub_cache)) == "no/such/dir"  # a path, not an id


def test_llm_and_serve_take_a_repository_id(hub_cache, tiny_checkpoint):
    params = SamplingParams(max_tokens=4, temperature=0)
    with LLM(REPO, download_dir=hub_cache) as from_hub, LLM(tiny_checkpoint) as from_directory:
        assert from_hub.model_dir.name == COMMIT
        hub_tokens = from_hub.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids
        assert hub_tokens == from_directory.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids
    with running_server(REPO, served_model_name=None, download_dir=str(hub_cache), require_model=True) as (base, _):
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == REPO  # served under its repository id
        body = {"model": REPO, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        out = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
        assert out["choices"][0]["text"] and out["usage"]["completion_tokens"] == 4

"""The ``dsinfer`` command line: make-tiny writes a loadable checkpoint, generate decodes greedily."""

from __future__ import annotations

import pytest
import torch

from dsinfer.cli import main
from dsinfer.kv.batch import PackedBatch
from dsinfer.models.loader import load_model
from dsinfer.tokenizer import Tokenizer


def test_make_tiny_then_generate_matches_greedy_decoding(tmp_path, capsys):
    directory = tmp_path / "tiny"
    assert main(["make-tiny", str(directory), "--seed", "5", "--shards", "2"]) == 0
    assert len(list(directory.glob("*.safetensors"))) == 2

    assert main(["generate", str(directory), "--prompt", "Hello world", "--max-tokens", "6", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out

    tokenizer = Tokenizer.from_dir(directory)
    model = load_model(directory, progress=False)
    tokens = [tokenizer.bos_id, *tokenizer.encode("Hello world", allow_special=False)]
    new = []
    for _ in range(6):
        logits = model(PackedBatch.from_sequences([tokens + new]))
        new.append(int(logits[-1].argmax()))
        if new[-1] == tokenizer.eos_id:
            break
    expected = tokenizer.decode(new, skip_special_tokens=True)
    assert f"'Hello world' -> {expected!r}" in printed  # the engine's greedy tokens equal plain recomputation


def test_generate_reports_a_bad_model_directory(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "missing"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "dsinfer generate: error:" in err and "missing" in err and "config.json" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown on machines without a GPU")
def test_generate_rejects_cuda_without_a_gpu(tiny_checkpoint, capsys):
    assert main(["generate", str(tiny_checkpoint), "--device", "cuda"]) == 2
    assert "no CUDA device is available" in capsys.readouterr().err


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("--port PORT port to listen on (default: 8000)", "(default: 127.0.0.1)", "(default: 16)",
                  "--max-n MAX_N", "(default: 128)", "(default: 30.0)", "(default: float32)"):  # fmt: skip
        assert shown in text, shown
    assert "(default: None)" not in text  # options without a default say what happens instead
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "(default: 32)" in " ".join(capsys.readouterr().out.split())


def test_top_level_imports_follow_vllm():
    from dsinfer import LLM, SamplingParams
    from dsinfer.llm import LLM as EngineLLM
    from dsinfer.sampling_params import SamplingParams as Params

    assert LLM is EngineLLM and SamplingParams is Params
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        import dsinfer

        dsinfer.nope  # noqa: B018

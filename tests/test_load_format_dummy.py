"""``--load-format dummy``: a directory's config and tokenizer served with random weights in the release formats."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import openai
import pytest
from server_harness import running_server

from dsinfer.bench.shapes import flash_slice_config
from dsinfer.cli import main
from dsinfer.config import EngineConfig, ModelConfig, QuantizationConfig
from dsinfer.layers.moe import MoE
from dsinfer.llm import LLM
from dsinfer.models.loader import CheckpointError
from dsinfer.models.tiny import tiny_config
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import DEEPSEEK_V4_SPECIAL_TOKENS, Tokenizer


def _config_only(checkpoint: Path, directory: Path) -> Path:
    """A copy of ``checkpoint`` without its weights: config, tokenizer."""
    directory.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (checkpoint / name).exists():
            shutil.copy(checkpoint / name, directory / name)
    return directory


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_a_config_without_weights_generates_with_random_packed_experts(arch, tiny_checkpoint, tiny_v41_checkpoint,
                                                                        tmp_path):  # fmt: skip
    source = tiny_checkpoint if arch == "v4" else tiny_v41_checkpoint
    directory = _config_only(Path(source), tmp_path / "shape")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    options = {"max_num_seqs": 2, "max_model_len": 128}
    runs = []
    for _ in range(2):
        with LLM(directory, load_format="dummy", **options) as llm:
            packed = [m.is_packed for m in llm.model.modules() if isinstance(m, MoE)]
            runs.append([o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [9] * 20], params, use_tqdm=False)])
    assert runs[0] == runs[1] and all(len(tokens) == 6 for tokens in runs[0])  # seeded: the same weights each time
    assert packed and all(packed)  # routed experts in the release format (FP4 codes and scales)
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        LLM(directory, **options)  # the default load format reads the (missing) weights


def test_dummy_runs_one_rank_and_names_the_formats(tiny_checkpoint):
    with pytest.raises(ValueError, match="load_format: expected one of auto, dummy"):
        LLM(tiny_checkpoint, load_format="random")
    with pytest.raises(ValueError, match="runs one rank"):
        LLM(tiny_checkpoint, load_format="dummy", data_parallel_size=2, expert_parallel_size=2)


def test_make_slice_writes_the_flash_widths_and_a_whole_vocabulary(tmp_path, capsys):
    assert main(["make-slice", str(tmp_path / "slice"), "--flash-layers", "3"]) == 0
    assert "--load-format dummy" in capsys.readouterr().out
    declared = replace(flash_slice_config(3), quantization=QuantizationConfig())  # what the dummy weights draw
    assert ModelConfig.from_file(tmp_path / "slice") == declared
    assert Tokenizer.from_dir(tmp_path / "slice").vocab_size == flash_slice_config(3).vocab_size
    assert not list((tmp_path / "slice").glob("*.safetensors"))
    assert json.loads((tmp_path / "slice" / "config.json").read_text())["num_hidden_layers"] == 3


def test_make_slice_declares_an_mtp_layer_when_asked(tmp_path, capsys):
    assert main(["make-slice", str(tmp_path / "slice"), "--flash-layers", "2", "--nextn", "1"]) == 0
    assert "1 MTP layer" in capsys.readouterr().out
    assert ModelConfig.from_file(tmp_path / "slice").num_nextn_predict_layers == 1
    assert flash_slice_config(2).num_nextn_predict_layers == 0  # the default slice drafts nothing


def test_the_server_serves_a_dummy_model(tiny_checkpoint, tmp_path):
    directory = _config_only(Path(tiny_checkpoint), tmp_path / "shape")
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128)
    with running_server(directory, config, load_format="dummy") as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        reply = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4 and reply.usage.prompt_tokens == 4


def test_a_slice_with_random_weights_streams_a_text_chunk_per_token(tmp_path):
    """What ``dsinfer bench serve`` times on a slice: every generated token must arrive as a chunk with text, or
    TTFT is the first visible token and ITL the gap between rare ones. The slice's tokenizer at its full vocabulary
    (the Flash widths do not fit a test's memory, so the layers are the tiny ones)."""
    directory = tmp_path / "slice"
    assert main(["make-slice", str(directory), "--flash-layers", "1"]) == 0
    tokenizer = Tokenizer.from_dir(directory)
    assert set(tokenizer.special_tokens) <= set(DEEPSEEK_V4_SPECIAL_TOKENS)  # added tokens are control tokens only
    small = tiny_config(vocab_size=tokenizer.vocab_size, num_nextn_predict_layers=0)
    (directory / "config.json").write_text(json.dumps(small.to_dict()))
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=128, max_model_len=256)
    with running_server(directory, config, load_format="dummy") as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Count the words."}], max_tokens=48, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        texts, usage = [], None
        for chunk in stream:
            usage = chunk.usage or usage
            texts += [choice.delta.content for choice in chunk.choices if choice.delta.content]
    assert usage is not None and usage.completion_tokens == 48
    assert len(texts) >= 46  # random weights may pick a control token or two; before, most replies showed none

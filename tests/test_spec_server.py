"""Speculative decoding at the edges: the CLI flag, /metrics counters, and `dsinfer bench serve`'s acceptance."""

from __future__ import annotations

import json

import httpx
import pytest
from server_harness import running_server

from dsinfer.bench import serving
from dsinfer.bench.spec_metrics import acceptance, parse_spec_counters
from dsinfer.cli import main
from dsinfer.config import EngineConfig

SPEC = '{"method": "mtp", "num_speculative_tokens": 3}'
DSPARK = '{"method": "dspark", "num_speculative_tokens": 3}'
# Each method on a checkpoint that drafts with it: V4's MTP layer, the tiny V4.1's DSpark stages (a block of 3).
CHECKPOINTS = [("tiny_checkpoint", SPEC), ("tiny_v41_checkpoint", DSPARK)]


@pytest.mark.parametrize(("checkpoint", "spec"), [*CHECKPOINTS, (None, DSPARK)], ids=["mtp", "dspark", "default"])
def test_generate_prints_the_acceptance_rate(request, capsys, checkpoint, spec):
    model = [] if checkpoint is None else [str(request.getfixturevalue(checkpoint))]  # None: the embedded default
    argv = ["generate", *model, "--prompt", "Hello world", "--max-tokens", "5", "--device", "cpu",
            "--speculative-config", spec]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "speculative decoding: " in out and " drafts accepted (" in out and "tokens per verify step" in out
    assert " of 0 drafts" not in out


@pytest.mark.parametrize(("command", "checkpoint", "spec", "message"), [
    ("generate", "tiny_checkpoint", "{bad", "speculative_config: not valid JSON"),
    ("serve", "tiny_checkpoint", '{"method": "mtp", "num_speculative_tokens": 8}',
     "'num_speculative_tokens': expected an integer from 1"),
    ("serve", "tiny_checkpoint", '{"method": "dspark", "num_speculative_tokens": 2}',
     "'dspark' drafts with DeepSeek-V4.1's DSpark"),
    ("serve", "tiny_v41_checkpoint", '{"method": "dspark", "num_speculative_tokens": 4}',
     "'num_speculative_tokens': 4 exceeds the checkpoint's DSpark block size (3)"),
    ("generate", "tiny_v41_checkpoint", '{"method": "mtp", "num_speculative_tokens": 2}',
     "'mtp' needs V4's MTP layers; a V4.1 checkpoint drafts with DSpark stages"),
])  # fmt: skip
def test_bad_speculative_configs_fail_before_serving(request, capsys, command, checkpoint, spec, message):
    model = request.getfixturevalue(checkpoint)
    argv = [command, str(model), "--device", "cpu", "--speculative-config", spec]
    if command == "serve":
        argv += ["--port", "1"]  # never reached: the check comes first
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"dsinfer {command}: error: " in err and message in err


@pytest.mark.parametrize(("checkpoint", "spec"), CHECKPOINTS, ids=["mtp", "dspark"])
def test_metrics_and_bench_serve_report_acceptance(request, tmp_path, checkpoint, spec):
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=256, speculative_config=spec)
    with running_server(request.getfixturevalue(checkpoint), config) as (base, engine):
        out = tmp_path / "result.json"
        argv = ["--base-url", base, "--model", "tiny", "--endpoint", "completions", "--input-len", "16",
                "--output-len", "6", "--num-prompts", "3", "--disable-tqdm", "--out", str(out)]  # fmt: skip
        code = serving.main(argv)
        text = httpx.get(f"{base}/metrics", timeout=5).text
    assert code == 0
    counters = parse_spec_counters(text)
    assert counters["spec_decode_num_drafts"] > 0
    assert counters["spec_decode_num_draft_tokens"] >= counters["spec_decode_num_drafts"]
    assert 'dsinfer:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="2"}' in text
    result = json.loads(out.read_text())
    stats = engine.engine.spec_stats
    assert result["spec_decode_num_drafts"] == stats.num_drafts > 0
    assert result["spec_decode_acceptance_length"] == pytest.approx(1 + stats.num_accepted_tokens / stats.num_drafts)


def test_acceptance_from_counters():
    text = """# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{model_name="m"} 10.0
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{model_name="m"} 30.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 15.0
"""
    after = parse_spec_counters(text)
    fields = acceptance({"spec_decode_num_drafts": 2, "spec_decode_num_draft_tokens": 6,
                         "spec_decode_num_accepted_tokens": 3}, after)  # fmt: skip
    assert fields["spec_decode_acceptance_length"] == pytest.approx(1 + 12 / 8)
    assert fields["spec_decode_acceptance_rate"] == pytest.approx(12 / 24)
    assert acceptance(None, after)["spec_decode_acceptance_length"] is None
    assert parse_spec_counters("# TYPE other counter\nother_total 1.0\n") is None

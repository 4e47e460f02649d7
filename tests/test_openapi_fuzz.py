"""Schemathesis against /openapi.json: the server does what its schema says, for generated valid and invalid
requests (every check: no 5xx, documented statuses and content types, response bodies and stream events
matching their schemas, invalid data refused with a 4xx, valid data accepted).

Bounded for CI: ten examples per operation and phase, a fixed seed, a context of 24 tokens and n <= 2 so each
generation is short (a request without max_tokens fills the context; the generated prompts that reach the engine are
at most 10 tokens long, and a context of 24 lets the same ones through as one of 48 did). The chat, text-completion,
Responses, Messages and tokenize routes may also answer a schema-valid body with 400: there validity depends on what
no JSON schema can say (the prompt's length in tokens, the order of the conversation's turns, whether a
response_format schema compiles, what the protocol library accepts); those 400s are still checked to be error JSON.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from server_harness import running_server

from dsinfer.config import EngineConfig

CONFIG = """
seed = 1
workers = 1

[generation]
max-examples = 10
database = "none"

[[operations]]
include-path-regex = "^/(tokenize|v1/chat/completions|v1/completions|v1/responses|v1/messages)$"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "404"]
"""


@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=24)
    with running_server(tiny_checkpoint, config, max_n=2) as (url, _engine):
        yield url


def test_schemathesis_finds_no_failures(base, tmp_path: Path):
    (tmp_path / "schemathesis.toml").write_text(CONFIG)
    schemathesis = Path(sys.executable).with_name("schemathesis")
    command = [str(schemathesis), "--config-file", "schemathesis.toml", "run", f"{base}/openapi.json",
               "--checks", "all", "--no-color", "--output-sanitize", "false"]  # fmt: skip
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    report = run.stdout + run.stderr
    assert run.returncode == 0, report
    generated = re.search(r"(\d+) generated, (\d+) passed", report)
    assert generated and generated.group(1) == generated.group(2) and int(generated.group(1)) > 500, report
    assert re.search(r"Tested: 10\b", report), report  # every operation: chat, completions, responses, messages,
    # models (list and one), tokenize, detokenize, health, metrics

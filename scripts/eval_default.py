"""Evaluate a trained default model on the held-out synthetic sets, through `dsinfer serve` and its APIs.

    python scripts/eval_default.py --model ./default-v41 --out ./eval-default

Starts `dsinfer serve MODEL` on loopback, then:

* arithmetic: the held-out problems (operand pairs never trained on) written as an AIME-format JSONL file and run
  through `dsinfer eval run aime` (greedy, one sample) and graded by the rule judge;
* tools: held-out entities (names never trained on); a call counts when it names the right function with
  exactly the expected arguments (the entity copied character for character);
* extraction: held-out sentences; the JSON content must equal the expected object;
* thinking mode: the share of thinking-mode replies that carry ``reasoning_content``.

Writes ``results.json`` (every reply beside what was expected) and prints the summary.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai

from dsinfer.eval.datasets import AIME_INSTRUCTION
from dsinfer.eval.grade import grade_run
from dsinfer.training import corpus


def _serve(model: str, port: int, log: Path, v41_prefill: str | None) -> subprocess.Popen:
    command = [sys.executable, "-m", "dsinfer.cli", "serve", model, "--port", str(port), "--device", "cpu"]
    if v41_prefill is not None:
        command += ["--v41-prefill", v41_prefill]
    server = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"dsinfer serve exited with {server.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return server
        except OSError:
            time.sleep(1)
    server.kill()
    raise SystemExit(f"dsinfer serve did not answer /health in 300 s; see {log}")


def _arithmetic(base_url: str, count: int, out: Path) -> dict:
    data = out / "arithmetic.jsonl"
    with data.open("w") as handle:
        for index, sample in enumerate(corpus.held_out("arithmetic", count)):
            problem = sample.body["messages"][0]["content"].removesuffix(f"\n\n{AIME_INSTRUCTION}")
            handle.write(json.dumps({"id": index, "problem": problem, "answer": sample.expected}) + "\n")
    run = out / "arithmetic"
    subprocess.run([sys.executable, "-m", "dsinfer.cli", "eval", "run", "aime", "--data", str(data), "--out", str(run),
                    "--base-url", base_url, "--samples", "1", "--temperature", "0", "--max-tokens", "400",
                    "--concurrency", "8", "--no-progress"], check=True)  # fmt: skip
    summary = grade_run(run, "rule", progress=False)
    return {"questions": summary["questions"], "correct": summary["correct_samples"],
            "accuracy": summary["accuracy_over_graded"]}  # fmt: skip


def _chat(client: openai.OpenAI, model: str, sample: corpus.Sample):
    reply = client.chat.completions.create(model=model, max_tokens=300, temperature=0, **sample.chat_arguments())
    return reply.choices[0].message


def _tools_and_extraction(client: openai.OpenAI, model: str, tools: int, extraction: int) -> tuple[dict, list]:
    records, scores = [], {"tools": [0, 0], "extraction": [0, 0], "reasoning": [0, 0]}
    samples = [*corpus.held_out("tools", tools), *corpus.held_out("extraction", extraction)]
    samples += [*corpus.held_out("tools", tools // 2, seed=99, thinking=False),
                *corpus.held_out("extraction", extraction // 2, seed=99, thinking=False)]  # fmt: skip
    for sample in samples:
        message = _chat(client, model, sample)
        if sample.skill == "tools":
            calls = [(c.function.name, json.loads(c.function.arguments)) for c in (message.tool_calls or [])]
            got = calls[0] if len(calls) == 1 else calls
            correct = got == (sample.expected["name"], sample.expected["arguments"])
        else:
            try:
                got = json.loads(message.content or "")
            except json.JSONDecodeError:
                got = message.content
            correct = got == sample.expected
        scores[sample.skill][0] += bool(correct)
        scores[sample.skill][1] += 1
        thinking = sample.thinking
        if thinking:
            scores["reasoning"][0] += bool(getattr(message, "reasoning_content", None))
            scores["reasoning"][1] += 1
        records.append({"skill": sample.skill, "thinking": thinking, "expected": sample.expected,
                        "got": got, "correct": bool(correct),
                        "reasoning_content": getattr(message, "reasoning_content", None)})  # fmt: skip
    return {name: {"correct": c, "of": n} for name, (c, n) in scores.items()}, records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default)")
    parser.add_argument("--out", required=True, help="directory for the eval files and results.json")
    parser.add_argument("--port", type=int, default=8471)
    parser.add_argument("--v41-prefill", choices=("bounded", "exact"), default=None,
                        help="how the server prefills prompts (default: the server default, bounded)")  # fmt: skip
    parser.add_argument("--arithmetic", type=int, default=50, help="held-out arithmetic problems")
    parser.add_argument(
        "--tools", type=int, default=20, help="held-out tool questions (thinking mode; half again in chat mode)"
    )
    parser.add_argument("--extraction", type=int, default=12, help="held-out extraction sentences (likewise)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        from dsinfer.models.tiny import default_model_dir

        args.model = str(default_model_dir())
    server = _serve(args.model, args.port, out / "serve.log", args.v41_prefill)
    try:
        base_url = f"http://127.0.0.1:{args.port}"
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        results = {"model": args.model, "arithmetic": _arithmetic(base_url, args.arithmetic, out)}
        scores, records = _tools_and_extraction(client, model, args.tools, args.extraction)
        results.update(scores)
    finally:
        server.terminate()
        server.wait(timeout=60)
    (out / "results.json").write_text(json.dumps({**results, "replies": records}, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

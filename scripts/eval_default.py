"""Evaluate a trained default model on the held-out synthetic sets, through `dsinfer serve` and its APIs.

    python scripts/eval_default.py --model ./default-v41 --out ./eval-default

Starts `dsinfer serve MODEL` on loopback, then:

* arithmetic: the held-out problems (operand pairs never trained on) written as an AIME-format JSONL file and run
  through `dsinfer eval run aime` (greedy, one sample) and graded by the rule judge;
* tools: held-out entities (names never trained on); a call counts when it names the right function with
  exactly the expected arguments (the entity copied character for character);
* extraction: held-out sentences; the JSON content must equal the expected object;
* copy_world, cities_world, extraction_world: the same for names of many scripts, lengths and shapes
  (:mod:`dsinfer.training.world_names`; held out like the others): a name repeated back character for
  character, a weather / population call for a city, a person's name and city as JSON;
* subtraction: held-out operand pairs asked plainly, about half with the larger number second (a negative
  result); the number after the answer's last ``=`` must be the difference;
* thinking mode: the share of thinking-mode replies that carry ``reasoning_content``.

Every chat set is asked in thinking mode and half as many again in chat mode. Writes ``results.json`` (every
reply beside what was expected) and prints the summary.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
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


_FINAL_NUMBER = re.compile(r"=\s*(-?\d+)\.?\s*$")


def _json_or_text(text: str):
    """The JSON value of ``text``, or the text itself when it is not JSON (then it matches nothing expected)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _score(eval_set: str, sample: corpus.Sample, message) -> tuple[object, bool]:
    """(what the reply gave, whether it is what the sample expects) for one chat reply."""
    if eval_set in ("tools", "cities_world"):
        calls = [(c.function.name, _json_or_text(c.function.arguments)) for c in (message.tool_calls or [])]
        got = calls[0] if len(calls) == 1 else calls
        return got, got == (sample.expected["name"], sample.expected["arguments"])
    if eval_set in ("extraction", "extraction_world"):
        got = _json_or_text(message.content or "")
        return got, got == sample.expected
    if eval_set == "subtraction":  # the answer line: "a - b = value."
        found = _FINAL_NUMBER.search((message.content or "").strip())
        got = int(found.group(1)) if found else message.content
        return got, got == sample.expected
    return message.content, message.content == sample.expected  # copy: character for character


def _chat_sets(client: openai.OpenAI, model: str, sizes: dict[str, int], workers: int) -> tuple[dict, list]:
    """Each set's held-out samples in thinking mode, and half as many again in chat mode (another seed), asked
    ``workers`` at a time (the server batches them); the reasoning count covers every thinking-mode reply."""
    jobs = [(name, sample) for name, count in sizes.items() for sample in
            [*corpus.held_out(name, count), *corpus.held_out(name, count // 2, seed=99, thinking=False)]]  # fmt: skip
    with ThreadPoolExecutor(workers) as pool:
        messages = list(pool.map(lambda job: _chat(client, model, job[1]), jobs))
    scores = {name: [0, 0] for name in [*sizes, "reasoning"]}
    records = []
    for (name, sample), message in zip(jobs, messages, strict=True):
        got, correct = _score(name, sample, message)
        scores[name][0] += bool(correct)
        scores[name][1] += 1
        reasoning = getattr(message, "reasoning_content", None)
        if sample.thinking:
            scores["reasoning"][0] += bool(reasoning)
            scores["reasoning"][1] += 1
        records.append({"set": name, "thinking": sample.thinking, "expected": sample.expected, "got": got,
                        "correct": bool(correct), "reasoning_content": reasoning})  # fmt: skip
    return {
        name: {"correct": c, "of": n, "accuracy": round(c / max(n, 1), 3)} for name, (c, n) in scores.items()
    }, records


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
    parser.add_argument("--copy-world", type=int, default=20, help="held-out names of many scripts and lengths to copy")
    parser.add_argument("--cities-world", type=int, default=20, help="tool calls for held-out cities of many scripts")
    parser.add_argument("--extraction-world", type=int, default=12, help="extraction of held-out world names")
    parser.add_argument("--subtraction", type=int, default=40, help="held-out subtractions, results -999 to 999")
    parser.add_argument("--concurrency", type=int, default=8, help="chat requests in flight at once")
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
        sizes = {"tools": args.tools, "extraction": args.extraction, "copy_world": args.copy_world,
                 "cities_world": args.cities_world, "extraction_world": args.extraction_world,
                 "subtraction": args.subtraction}  # fmt: skip
        scores, records = _chat_sets(client, model, sizes, args.concurrency)
        results.update(scores)
    finally:
        server.terminate()
        server.wait(timeout=60)
    (out / "results.json").write_text(json.dumps({**results, "replies": records}, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Host time of an engine step: the model's forward replaced by constant logits, so only the host's work is left.

    python benchmarks/host_step.py --requests 1 16                # LLMEngine.step, decode, per batch size
    python benchmarks/host_step.py --requests 16 --serve          # the same engine behind the real HTTP server

The engine part runs decode steps of ``--requests`` greedy requests on the tiny checkpoint (CPU) and reports the
median ms per ``step()``: scheduling, batch preparation, sampling, token bookkeeping and detokenization, the
work a GPU step's host side does besides launching the forward. ``--serve`` starts ``dsinfer serve``'s app on
loopback around such an engine, streams ``--requests`` chat completions with ``dsinfer bench serve`` and reports
the median ``engine.step`` time beside the wall time per step; profile it (``py-spy record -- python
benchmarks/host_step.py --serve``) to see where a serving step's host time goes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.models.loader import load_model
from dsinfer.models.tiny import make_tiny_checkpoint
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer


def constant_forward(model) -> None:
    """Replace the model's forward (for every instance of its class) by one that returns fixed logits."""
    vocab = model.config.vocab_size
    logits = torch.full((vocab,), -5.0)
    logits[300] = 5.0

    def forward(self, batch, *args, logits_for=None, **kwargs):
        rows = logits_for.shape[0] if logits_for is not None else len(batch.spans)
        return logits.expand(rows, vocab).clone()

    type(model).forward = forward


def engine_host_ms(model, tokenizer, requests: int, steps: int) -> float:
    config = EngineConfig(max_num_seqs=max(requests, 1), async_scheduling=False)
    engine = LLMEngine(model, tokenizer, config)
    for i in range(requests):
        engine.add_request(
            list(range(5 + i, 40 + i)), SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
        )
    for _ in range(4):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.close()
    return statistics.median(times) * 1e3


def serve_host_ms(directory: str, requests: int, output_len: int, port: int) -> dict:
    import uvicorn

    from dsinfer.server.launch import ServeOptions, build_server

    options = ServeOptions(model=directory, port=port, served_model_name="tiny", log_level="warning")
    app, engine = build_server(options, EngineConfig(max_num_seqs=max(requests, 1), max_model_len=1024))
    constant_forward(engine.engine.model)
    steps, step = [], engine.engine.step

    def timed_step():
        start = time.perf_counter()
        out = step()
        steps.append(time.perf_counter() - start)
        return out

    engine.engine.step = timed_step
    engine.start()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "serve.json"
        subprocess.run(
            [sys.executable, "-m", "dsinfer.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
             "--model", "tiny", "--dataset", "random", "--input-len", "32", "--output-len", str(output_len),
             "--num-prompts", str(requests), "--max-concurrency", str(requests), "--seed", "0", "--disable-tqdm",
             "--out", str(out)],
            check=True, capture_output=True,
        )  # fmt: skip
        result = json.loads(out.read_text())
    server.should_exit = True
    engine.stop()
    return {"requests": requests, "engine_step_ms": statistics.median(steps) * 1e3,
            "wall_ms_per_step": result["duration"] / max(len(steps), 1) * 1e3,
            "output_tokens_per_s": result["output_throughput"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=200, help="timed engine steps (engine mode)")
    parser.add_argument("--serve", action="store_true", help="behind the HTTP server instead")
    parser.add_argument("--output-len", type=int, default=256, help="tokens per request (--serve)")
    parser.add_argument("--port", type=int, default=18555)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as directory:
        make_tiny_checkpoint(directory, arch="v4")
        if args.serve:
            for requests in args.requests:
                print(json.dumps(serve_host_ms(directory, requests, args.output_len, args.port)), flush=True)
            return
        model = load_model(directory, progress=False)
        constant_forward(model)
        tokenizer = Tokenizer.from_dir(directory)
        for requests in args.requests:
            step_ms = engine_host_ms(model, tokenizer, requests, args.steps)
            print(json.dumps({"requests": requests, "engine_step_ms": step_ms}), flush=True)


if __name__ == "__main__":
    main()

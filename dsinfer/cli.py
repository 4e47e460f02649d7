"""The ``dsinfer`` command line: ``generate`` and ``make-tiny`` (serve, bench and eval arrive with their issues)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dsinfer.config import ConfigError
from dsinfer.models.batch import PackedBatch
from dsinfer.models.loader import CheckpointError, load_model
from dsinfer.models.tiny import default_model_dir, make_tiny_checkpoint
from dsinfer.tokenizer import Tokenizer, TokenizerLoadError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsinfer", description="DeepSeek-V4 inference engine")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="greedy text completion with the reference model")
    generate.add_argument("model", nargs="?", help="checkpoint directory (default: the embedded tiny model)")
    generate.add_argument("--prompt", action="append", help="prompt text; repeat for several prompts")
    generate.add_argument("--max-tokens", type=_positive_int, default=32, help="new tokens per prompt")
    generate.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    generate.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")

    tiny = commands.add_parser("make-tiny", help="write a tiny random V4 checkpoint directory")
    tiny.add_argument("directory", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--shards", type=_positive_int, default=3)
    tiny.add_argument("--no-quant", action="store_true", help="store bf16 weights instead of FP8 / FP4")
    return parser


def run_generate(args: argparse.Namespace) -> int:
    """Greedy decoding by full recomputation: the simplest correct loop, until the engine takes over."""
    model_dir = Path(args.model) if args.model else default_model_dir()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    model = load_model(model_dir, dtype=DTYPES[args.dtype], device=device)
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = args.prompt or ["The quick brown fox"]
    sequences = [[tokenizer.bos_id, *tokenizer.encode(p, allow_special=False)] for p in prompts]
    generated: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        for _ in tqdm(range(args.max_tokens), desc="Generating", unit="step"):
            active = [i for i, done in enumerate(finished) if not done]
            if not active:
                break
            batch = PackedBatch.from_sequences([sequences[i] + generated[i] for i in active], device=device)
            next_tokens = model(batch, logits_for=batch.last_token_indices()).argmax(-1).tolist()
            for i, token in zip(active, next_tokens, strict=True):
                generated[i].append(token)
                finished[i] = token == tokenizer.eos_id
    elapsed = time.perf_counter() - start
    for prompt, tokens in zip(prompts, generated, strict=True):
        print(f"{prompt!r} -> {tokenizer.decode(tokens, skip_special_tokens=True)!r}")
    total = sum(len(g) for g in generated)
    print(f"{total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tokens/s, full recompute per step)")
    return 0


def run_make_tiny(args: argparse.Namespace) -> int:
    path = make_tiny_checkpoint(args.directory, seed=args.seed, num_shards=args.shards, quantized=not args.no_quant)
    print(f"wrote a tiny DeepSeek-V4 checkpoint to {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"generate": run_generate, "make-tiny": run_make_tiny}
    try:
        return handlers[args.command](args)
    except (CheckpointError, ConfigError, TokenizerLoadError, ValueError) as exc:
        print(f"dsinfer {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

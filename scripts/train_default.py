"""Train the embedded default model (a small DeepSeek-V4.1) and write it in the release formats.

    python scripts/train_default.py --out ./default-v41                 # the shipped default, one H200
    python scripts/train_default.py --out ./toy --preset toy --device cpu   # seconds on a CPU
    python scripts/train_default.py --out ./ft --preset finetune --init-from dsinfer/models/default_v41 \
        --minutes 5.3 --time-limit-minutes 5.6                             # a fine-tune of the shipped default

See docs/default-model.md for the architecture, the data and the results.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

from dsinfer.training.loss_curve import plot_loss_curve
from dsinfer.training.trainer import PRESETS, train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=None, help="override the preset's step count")
    parser.add_argument("--batch-tokens", type=int, default=None)
    parser.add_argument("--sequence-tokens", type=int, default=None, help="chats are packed into sequences this long")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="fit the run into this many minutes (the step count is derived from the first steps)",
    )
    parser.add_argument(
        "--time-limit-minutes", type=float, default=None, help="stop early and export (and write resume.pt)"
    )
    parser.add_argument("--resume", action="store_true", help="continue the run stopped in --out (its resume.pt)")
    parser.add_argument(
        "--init-from", default=None, help="start from this checkpoint's weights and tokenizer (a fine-tune)"
    )
    parser.add_argument("--data-workers", type=int, default=None, help="processes rendering the training chats")
    parser.add_argument("--no-plot", action="store_true", help="skip the loss-curve PNG (needs matplotlib)")
    args = parser.parse_args(argv)
    settings = PRESETS[args.preset]
    overrides = {"steps": args.steps, "batch_tokens": args.batch_tokens,
                 "sequence_tokens": args.sequence_tokens, "seed": args.seed, "minutes": args.minutes,
                 "init_from": args.init_from, "data_workers": args.data_workers,
                 "time_limit_s": None if args.time_limit_minutes is None else args.time_limit_minutes * 60}  # fmt: skip
    settings = replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    result = train(Path(args.out), settings, device=args.device, resume=args.resume)
    if not args.no_plot:
        plot_loss_curve(result.directory / "training.json", result.directory / "loss_curve.png")
    print(f"wrote {result.directory} after {result.seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

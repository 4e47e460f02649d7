"""A ``draft_token_map`` for MTP drafting: the ``--size`` token ids most frequent in a sample of your traffic.

    python scripts/make_token_map.py --model ./DeepSeek-V4-Flash --corpus requests.txt --size 32768 --out map.json
    dsinfer serve ./DeepSeek-V4-Flash --speculative-config \\
        '{"method": "mtp", "num_speculative_tokens": 3, "draft_token_map": "map.json"}'

The corpus is text files (UTF-8), tokenized with the model's tokenizer as a whole; the ids are written most
frequent first, ties by id, then the tokenizer's special tokens (so an end of turn can be drafted). An id the
corpus never shows is left out, so a small corpus gives a shorter map. Drafts outside the map are never proposed;
the target still produces them, so the output is the same with any map: only how many drafts are accepted (and
how many head rows a draft reads) changes.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from dsinfer.tokenizer import Tokenizer


def token_map(tokenizer: Tokenizer, texts: list[str], size: int) -> list[int]:
    """The ``size`` most frequent ids of ``texts`` (ties by id), then the special tokens not among them."""
    counts = Counter()
    for text in texts:
        counts.update(tokenizer.encode(text))
    ranked = sorted(counts, key=lambda token: (-counts[token], token))[:size]
    chosen = set(ranked)
    return ranked + sorted(i for i in tokenizer.special_ids if i not in chosen)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model directory (its tokenizer is read)")
    parser.add_argument("--corpus", nargs="+", required=True, help="UTF-8 text files of typical traffic")
    parser.add_argument("--size", type=int, default=32768, help="ids kept before the special tokens (default 32768)")
    parser.add_argument("--out", required=True, help="the JSON array of token ids to write")
    args = parser.parse_args(argv)
    if args.size < 1:
        parser.error("--size must be at least 1")
    tokenizer = Tokenizer.from_dir(args.model)
    ids = token_map(tokenizer, [Path(path).read_text(encoding="utf-8") for path in args.corpus], args.size)
    Path(args.out).write_text(json.dumps(ids))
    print(f"{len(ids)} token ids of {tokenizer.vocab_size} written to {args.out}")


if __name__ == "__main__":
    main()

"""The indexer's top-k selection (``index_topk_decode``, Triton) at the shapes a long context gives it.

    python benchmarks/index_topk.py                          # prefill slice and decode batches at 131,072 tokens
    python benchmarks/index_topk.py --cases 4096x32768:causal 64x32768
    python benchmarks/index_topk.py --cases 4096x32768:causal 2048x65536:causal --chunk-sizes 2048 4096 8192
    python benchmarks/index_topk.py --cases 4096x32768:causal 256x131072 --register-caps 0 72 64
    python benchmarks/index_topk.py --cases 8192x65536:causal 8192x8192:causal --torch-topk
    python benchmarks/index_topk.py --cases 256x131072 64x131072 --candidates 2048:8

A case is ``ROWSxWIDTH`` of float32 scores (random, a tenth of them exact zeros as the indexer's ReLU gives), with
``:causal`` the -inf tail of a prefill's rows: the rows are the last queries of a chunk whose newest sees all
``width`` entries, each earlier one an entry fewer every 4 positions (ratio 4). For each case: the median of
CUDA-event timings, and whether the choice of the first 64 rows is the reference's, bit for bit; with
``--chunk-sizes`` a row each for those widest chunks a program takes (``CHUNK``, the wider rows' split), and
with ``--register-caps`` for those registers a thread (``REGISTER_CAP``; 0: the compiler's); with
``--torch-topk`` also torch's own top-k of the case (``topk_indices``: packed int64 keys, best first); with
``--candidates`` also ``candidate_block_mask`` (Triton against the torch reference).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from fast_path_checks import cuda_ms  # the benchmarks' one CUDA-event timer (same folder)

from dsinfer.ops.index_select import triton as backend
from dsinfer.ops.index_select.reference import candidate_block_mask_reference, index_topk_decode_reference
from dsinfer.ops.topk import topk_indices

RATIO = 4  # compressed entries a query position adds (V4's CSA): a prefill row sees one more entry every 4 tokens
DEFAULT_CASES = ["4096x32768:causal", "4096x16384:causal", "64x32768", "256x32768"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES)
    parser.add_argument("--k", type=int, default=512)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--register-caps", type=int, nargs="+", default=None, metavar="REGISTERS",
                        help=f"time each as the selections' register cap (default {backend.REGISTER_CAP})")  # fmt: skip
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=None, metavar="KEYS",
                        help=f"time each as the widest chunk a program takes (default {backend.CHUNK})")  # fmt: skip
    parser.add_argument(
        "--torch-topk",
        action="store_true",
        help="also time torch's top-k of the same scores (the packed-key topk_indices, best first)",
    )
    parser.add_argument("--candidates", metavar="BLOCKS:SIZE", default=None,
                        help="also time candidate_block_mask (the best BLOCKS blocks of SIZE entries, as V4.1's "
                             "candidate source keeps 2048:8), Triton against the torch reference")  # fmt: skip
    return parser.parse_args(argv)


def make_scores(case: str, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    shape, _, kind = case.partition(":")
    rows, width = (int(n) for n in shape.split("x"))
    scores = torch.randn(rows, width, generator=generator)
    scores[torch.rand(rows, width, generator=generator) < 0.1] = 0.0
    if kind == "causal":  # rows are the chunk's last queries: each sees one entry fewer every RATIO rows back
        visible = width - torch.arange(rows - 1, -1, -1) // RATIO
        scores = scores.masked_fill(torch.arange(width) >= visible[:, None], float("-inf"))
    elif kind:
        raise ValueError(f"case {case!r}: the kind after ':' must be 'causal'")
    return scores.to(device)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(args.seed)
    print(f"{torch.cuda.get_device_name()}; k = {args.k}")
    chosen_chunk, chosen_cap = backend.CHUNK, backend.REGISTER_CAP
    for case in args.cases:
        scores = make_scores(case, device, generator)
        # the reference on a few rows (it materialises int64 keys of the whole case)
        expected = index_topk_decode_reference(scores[:64], args.k)
        for chunk in args.chunk_sizes or [chosen_chunk]:
            for cap in args.register_caps or [chosen_cap]:
                backend.CHUNK, backend.REGISTER_CAP = chunk, cap
                try:
                    choose = lambda s=scores: backend.index_topk_decode_triton(s, args.k)  # noqa: E731
                    same = torch.equal(choose()[:64], expected)
                    ms = statistics.median(cuda_ms(choose, args.iters))
                finally:
                    backend.CHUNK, backend.REGISTER_CAP = chosen_chunk, chosen_cap
                print(f"{case:>20}  chunk {chunk:>6}  registers {cap:>3}  {ms:8.3f} ms  same choice: {same}")
        if args.torch_topk:
            by_torch = lambda s=scores: topk_indices(s, min(args.k, s.shape[-1]))  # noqa: E731
            same = torch.equal(by_torch()[:64].sort(-1).values, expected.sort(-1).values)  # rows with k finite scores
            ms = statistics.median(cuda_ms(by_torch, args.iters))
            print(f"{case:>20}  torch topk_indices          {ms:8.3f} ms  same entries: {same}")
        if args.candidates:
            time_candidates(case, scores, args.candidates, args.iters)
    return 0


def time_candidates(case: str, scores: torch.Tensor, spec: str, iters: int) -> None:
    """``candidate_block_mask`` of the case's scores (each row's visible count: its finite scores), the Triton op
    against the torch reference, and whether their masks agree."""
    blocks, size = (int(n) for n in spec.split(":"))
    visible = torch.isfinite(scores).sum(dim=-1)
    timings = {}
    for name, op in (("triton", backend.candidate_block_mask_triton), ("torch", candidate_block_mask_reference)):
        timings[name] = statistics.median(cuda_ms(lambda op=op: op(scores, visible, blocks, size), iters))
    same = torch.equal(backend.candidate_block_mask_triton(scores, visible, blocks, size),
                       candidate_block_mask_reference(scores, visible, blocks, size))  # fmt: skip
    print(f"{case:>20}  candidates {spec}: triton {timings['triton']:8.3f} ms, torch {timings['torch']:8.3f} ms"
          f"  same mask: {same}")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())

"""float32 linears of few rows on one GPU: cuBLAS against cuBLASLt at the embedded default's weight shapes.

    python benchmarks/fp32_linear_blas.py                    # the 8 commonest 2-D weight shapes, 1 to 64 rows

The embedded default runs in float32; a plain decode step multiplies one row a sequence, a verify step K + 1.
Each ``F.linear`` is timed inside a CUDA graph of 20 calls (microseconds a call, median of 10 replays) with
``torch.backends.cuda.preferred_blas_library`` set to each library in turn, then once more under cuBLAS with a
zero bias (``+bias``: torch's addmm with a 1-D bias may take cuBLASLt's bias epilogue for that call alone, which
would choose the library per call instead of per process); ``max diff`` is the largest difference from the plain
cuBLAS product of the same rows. The engine records its float32 graphs of 2 to 16 rows under cuBLASLt and the
rest under cuBLAS (``dsinfer.graph_capture.blas_for_rows``), from these figures.
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch
from cold_copies import graph_ms  # the benchmarks' graph timer (same folder)
from safetensors import safe_open

from dsinfer.graph_capture import preferred_blas
from dsinfer.models.tiny import default_model_dir

CALLS_A_REPLAY = 20
REPLAYS = 10


def weight_shapes(directory, count: int) -> list[tuple[tuple[int, int], int]]:
    """The ``count`` commonest (out, in) shapes of the checkpoint's 2-D weights (embeddings left out)."""
    shapes: collections.Counter = collections.Counter()
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():
                shape = tuple(handle.get_slice(name).get_shape())
                if len(shape) == 2 and name.endswith("weight") and min(shape) >= 8 and "embed" not in name:
                    shapes[shape] += 1
    return shapes.most_common(count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 5, 16, 20, 64])
    parser.add_argument("--shapes", type=int, default=8, help="how many of the commonest weight shapes")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp32_linear_blas: needs a CUDA device", file=sys.stderr)
        return 1
    shapes = weight_shapes(default_model_dir(), args.shapes)
    print(torch.cuda.get_device_name(), "; us a call:", flush=True)
    for library, with_bias in (("cublas", False), ("cublaslt", False), ("cublas", True)):
        for (out_features, in_features), count in shapes:
            weight = torch.randn(out_features, in_features, device="cuda")
            bias = torch.zeros(out_features, device="cuda") if with_bias else None
            cells = []
            for rows in args.rows:
                x = torch.randn(rows, in_features, device="cuda")
                with preferred_blas("cublas"):
                    expected = torch.nn.functional.linear(x, weight)
                call = lambda x=x, w=weight, b=bias: torch.nn.functional.linear(x, w, b)  # noqa: E731
                with preferred_blas(library):
                    diff = (call() - expected).abs().max().item()
                    us = 1e3 * graph_ms(call, CALLS_A_REPLAY, REPLAYS, warmup=10)
                cells.append(f"{rows} rows {us:6.2f} (max diff {diff:.1e})")
            label = library + ("+bias" if with_bias else "")
            print(f"{label:12} ({out_features}, {in_features}) x {count}: " + ", ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

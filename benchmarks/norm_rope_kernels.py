"""The norm and RoPE kernels at a prefill chunk's shapes, each timed alone in a CUDA graph (H200 numbers in
docs/perf.md, pass 5).

    python benchmarks/norm_rope_kernels.py                 # 4,096 tokens
    python benchmarks/norm_rope_kernels.py --tokens 1 32   # decode steps

For each shape: a copy of the whole tensor (the floor a pass over it costs), ``rope`` in place and out of place,
``rms_normalize`` on contiguous rows and on a column slice of a wider GEMM output, and the fused
``rms_normalize_rope``; each kernel's result is checked against its reference first.
"""

from __future__ import annotations

import argparse

import torch

from dsinfer.ops.norm_rope.reference import rms_normalize_reference, rope_reference
from dsinfer.ops.norm_rope.rms_norm_triton import rms_normalize_triton
from dsinfer.ops.norm_rope.rope_triton import rope_launch
from dsinfer.ops.norm_rope.row_chain_triton import rms_normalize_rope_triton

SHAPES = ((64, 512), (1, 512), (64, 128))  # (heads, dim): V4 queries, keys, indexer queries; rope_dim 64


def microseconds(fn) -> float:
    import triton

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=40) * 1e3


def time_shape(tokens: int, heads: int, dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Check each kernel against its reference at [tokens, heads, dim], then print its time."""
    label = f"[{tokens}, {heads}, {dim}]"
    x = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
    wide = torch.randn(tokens, heads * dim + 1024, device="cuda", dtype=torch.bfloat16)
    columns = wide[:, : heads * dim].view(tokens, heads, dim)  # a joined GEMM's slice
    assert torch.equal(rope_launch(x.clone(), cos, sin, False, True), rope_reference(x, cos, sin))
    fused = rms_normalize_rope_triton(columns, 1e-6, cos, sin)
    assert torch.equal(fused, rope_launch(rms_normalize_triton(columns, 1e-6), cos, sin, False, True))
    reference = rope_reference(rms_normalize_reference(columns, 1e-6), cos, sin)
    assert (fused.float() - reference.float()).abs().max() < 0.1
    owned = x.clone()  # in place repeatedly: the values drift, the timing does not
    rows = {
        "copy": lambda: x.clone(),
        "rope in place": lambda: rope_launch(owned, cos, sin, False, True),
        "rope out of place": lambda: rope_launch(x, cos, sin, False, False),
        "rms_normalize, contiguous": lambda: rms_normalize_triton(x, 1e-6),
        "rms_normalize, column slice": lambda: rms_normalize_triton(columns, 1e-6),
        "rms_normalize_rope, column slice": lambda: rms_normalize_rope_triton(columns, 1e-6, cos, sin),
    }
    for name, fn in rows.items():
        print(f"{label:18s} {name:34s} {microseconds(fn):9.1f} us", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("norm_rope_kernels needs a CUDA device")
    torch.manual_seed(0)
    for tokens in args.tokens:
        angles = torch.rand(tokens, 32, device="cuda") * 2e3
        for heads, dim in SHAPES:
            time_shape(tokens, heads, dim, angles.cos(), angles.sin())


if __name__ == "__main__":
    main()

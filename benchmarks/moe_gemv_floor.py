"""How far the routed experts' gate/up GEMV (one token, packed FP4) is from reading its bytes, and from tensor cores.

    python benchmarks/moe_gemv_floor.py

At V4-Flash widths (256 experts, hidden 4096, intermediate 2048, top-6), cold: each timed replay runs the kernel
once on each of ``--calls`` sets of six random experts (different experts each call, 50 MB of codes and scales
a call against the H200's 50 MB L2). Three things are timed per call:

* the gate/up kernel of :mod:`dsinfer.ops.moe.decode_triton` at its default launch;
* a kernel that only reads the same bytes in the same tiles (XORs the code words and scale bytes): the floor of
  that access pattern, with no decode and no arithmetic;
* the same GEMV through ``tl.dot_scaled`` (bf16 activations in row 0 of a 16-row tile, e2m1 weights with ue8m0
  scales, Triton's own FP4 decode and tensor cores), at a few tile shapes, with its error against the exact
  dequantisation.

It needs a CUDA device. The kernels here are measuring probes, not a backend.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from cold_copies import graph_ms  # same folder
from moe_kernel import random_fp4_experts

from dsinfer.ops.moe import decode_triton
from dsinfer.ops.moe.weights import dequantize_expert

DOT_SCALED_TILES = ((32, 256, 4), (16, 512, 4), (32, 512, 4), (64, 256, 4), (16, 256, 2), (32, 128, 4))
"""(rows, inputs per step, warps) of the ``tl.dot_scaled`` launches timed."""
READ_TILES = ((8, 128), (16, 64), (4, 256), (8, 64))
"""(rows, code words per step) of the read-only launches timed (two warps each)."""


@triton.jit
def _dot_scaled_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, out_ptr, K, N2, w_es, w_rs, s_es, s_rs,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M: tl.constexpr):  # fmt: skip
    """``out[slot, rows] = x @ w13[expert]^T`` in fp32 for one slot and tile of rows; ``x`` is row 0 of M."""
    n_tile = tl.program_id(0)
    slot = tl.program_id(1)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    rows = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M)
    acc = tl.zeros((M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None] * 0 + kk[None, :], mask=(m[:, None] == 0), other=0.0)
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        w = tl.load(w_ptr + expert * w_es + rows[None, :] * w_rs + kb[:, None])  # [BLOCK_K / 2, BLOCK_N] codes
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        s = tl.load(s_ptr + expert * s_es + rows[:, None] * s_rs + ks[None, :])  # [BLOCK_N, BLOCK_K / 32]
        acc = tl.dot_scaled(x, None, "bf16", w, s, "e2m1", acc)
    tl.store(out_ptr + slot * N2 + rows[None, :] + m[:, None] * 0, acc, mask=m[:, None] == 0)


@triton.jit
def _read_kernel(w_ptr, s_ptr, ids_ptr, out_ptr, K8, w_es, w_rs, s_es, s_rs,
                 BLOCK_N: tl.constexpr, WORDS: tl.constexpr):  # fmt: skip
    """Reads one slot's tile of code words (int32, eight codes each) and scale bytes, K step by K step."""
    n_tile = tl.program_id(0)
    slot = tl.program_id(1)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    rows = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    codes = tl.zeros((BLOCK_N, WORDS), tl.int32)
    scales = tl.zeros((BLOCK_N, WORDS // 4), tl.int32)
    for q0 in range(0, K8, WORDS):
        q = q0 + tl.arange(0, WORDS)
        codes ^= tl.load(w_ptr + expert * w_es + rows[:, None] * w_rs + q[None, :])
        g = q0 // 4 + tl.arange(0, WORDS // 4)
        scales ^= tl.load(s_ptr + expert * s_es + rows[:, None] * s_rs + g[None, :]).to(tl.int32)
    tl.store(out_ptr + rows, tl.sum(codes, 1) + tl.sum(scales, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--inter", type=int, default=2048)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--calls", type=int, default=40, help="expert sets a replay cycles through")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    if args.hidden % 2048 or args.inter % 32 or not 1 <= args.top_k <= args.experts or args.calls < 1:
        parser.error("--hidden must be a multiple of 2048 and --inter of 32 (the tiles timed), 1 <= --top-k <= "
                     "--experts, --calls >= 1")  # fmt: skip
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    E, H, inter, k = args.experts, args.hidden, args.inter, args.top_k
    weights = random_fp4_experts(E, H, inter, device, gen)
    x = torch.randn(1, H, device=device, generator=gen).bfloat16()
    id_sets = [torch.randperm(E, device=device, generator=gen)[:k].contiguous() for _ in range(args.calls)]
    words, scales = weights.w13.view(torch.int32), weights.w13_scale
    gigabytes = k * 2 * inter * (H // 2 + H // 32) / 1e9

    def report(name: str, replay: float, extra: str = "") -> None:
        per_call = replay / args.calls
        print(f"{name}: {per_call * 1e3:.1f} us a call, {gigabytes / per_call:.2f} TB/s{extra}", flush=True)

    h = torch.empty(k, inter, dtype=torch.bfloat16, device=device)
    gate_up = decode_triton.DECODE_GEMV_CONFIG.gate_up

    def current():
        for ids in id_sets:
            decode_triton._gate_up_gemv_kernel[(triton.cdiv(inter, gate_up.block_n), k)](
                x, words, scales, ids, h, k, H, inter, E, 10.0, x.stride(0), words.stride(0), words.stride(1),
                scales.stride(0), scales.stride(1), BLOCK_N=gate_up.block_n, BLOCK_K=gate_up.block_k,
                EVEN=inter % gate_up.block_n == 0 and H % gate_up.block_k == 0, PDL=False, PTX=True,
                num_warps=gate_up.num_warps, num_stages=gate_up.num_stages,
            )  # fmt: skip

    report(f"gate/up GEMV kernel {tuple(gate_up)}", graph_ms(current, 1, 3))
    sink = torch.empty(2 * inter, dtype=torch.int32, device=device)
    for rows, step in READ_TILES:

        def read(rows=rows, step=step):
            for ids in id_sets:
                _read_kernel[(2 * inter // rows, k)](
                    words, scales, ids, sink, H // 8, words.stride(0), words.stride(1), scales.stride(0),
                    scales.stride(1), BLOCK_N=rows, WORDS=step, num_warps=2,
                )  # fmt: skip

        report(f"read only, {rows} rows x {step} words", graph_ms(read, 1, 3))
    out = torch.empty(k, 2 * inter, dtype=torch.float32, device=device)
    first = id_sets[0].tolist()
    exact = torch.stack([x.float() @ dequantize_expert(weights, int(e), torch.float32)[0].T for e in first])
    for rows, step, warps in DOT_SCALED_TILES:

        def dot_scaled(sets=id_sets, rows=rows, step=step, warps=warps):
            for ids in sets:
                _dot_scaled_kernel[(2 * inter // rows, k)](
                    x, weights.w13, scales, ids, out, H, 2 * inter, weights.w13.stride(0), weights.w13.stride(1),
                    scales.stride(0), scales.stride(1), BLOCK_N=rows, BLOCK_K=step, M=16, num_warps=warps,
                )  # fmt: skip

        dot_scaled(id_sets[:1])
        error = ((out - exact.squeeze(1)).abs().max() / exact.abs().max()).item()
        report(f"tl.dot_scaled, {rows} rows x {step} inputs, {warps} warps", graph_ms(dot_scaled, 1, 3),
               f", relative error {error:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()

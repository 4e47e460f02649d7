"""The ``sharded`` Engram placement over NCCL: every rank gets exactly the reference rows, and how fast.

    torchrun --nproc-per-node 2 benchmarks/engram_sharded_check.py --rows 4194304 --ids 65536

Each rank builds the same random FP8 table (same seed), keeps its shard, asks for its own random ids
(rows owned by every rank) and compares what comes back with a gather from the whole table. Rank 0 prints
one line per size: bit-exact or not, and the exchange time (median of repeats, CUDA events).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

from dsinfer.engram.fetch import ShardedEngramFetcher
from dsinfer.kernels.engram_gather import gather_dequantize_reference

ROW_BYTES, SCALE_BYTES = 256, 8


def random_table(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, ROW_BYTES), dtype=torch.uint8, generator=generator)
    codes[(codes & 0x7F) == 0x7F] ^= 1  # 0x7f / 0xff are NaN in e4m3fn
    scales = torch.randint(110, 135, (rows, SCALE_BYTES), dtype=torch.uint8, generator=generator)
    return codes, scales


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1 << 22)
    parser.add_argument("--ids", type=int, nargs="+", default=[4096, 65536, 524288])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    weight, scale = random_table(args.rows, seed=0)
    fetcher = ShardedEngramFetcher.from_tables({1: (weight, scale)}, device=device, out_dtype=torch.bfloat16)
    for count in args.ids:
        generator = torch.Generator().manual_seed(1000 + rank)
        ids = torch.randint(0, args.rows, (count,), generator=generator)
        expected = gather_dequantize_reference(weight, scale, ids, torch.bfloat16)
        got = fetcher.fetch(ids.to(device), 1)
        exact = torch.equal(got.cpu().view(torch.int16), expected.view(torch.int16))
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fetcher.fetch(ids.to(device), 1)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        flags = torch.tensor([int(exact)], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        if rank == 0:
            ms = statistics.median(times)
            gbps = count * (ROW_BYTES + SCALE_BYTES) / (ms / 1e3) / 1e9
            print(f"world {world}, {count:>7} ids per rank from {args.rows:,} rows: "
                  f"{'bit-exact on every rank' if flags.item() else 'MISMATCH'}, {ms:.2f} ms, {gbps:.1f} GB/s per rank",
                  flush=True)  # fmt: skip
    fetcher.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

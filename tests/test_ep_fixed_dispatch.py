"""The fixed-capacity EP dispatch (the decode graphs' path) gives the variable-size dispatch's result.

Real gloo process groups of 2 ranks and of 1, fp32 experts on the CPU: random routing, routing that sends
every token of every rank to rank 1's experts (rank 0 receives no row, rank 1 a full block), a token that
sends as many slots to one rank as its capacity bound allows, and a redundant placement. Each rank also
checks its rows against the single-rank op over every expert, and that padding rows change nothing.
"""

from __future__ import annotations

import multiprocessing
import traceback
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from dsinfer.ops.moe import stack_experts
from dsinfer.ops.registry import resolve
from dsinfer.parallel.config import free_port
from dsinfer.parallel.ep import ExpertParallel, ExpertPlacement
from dsinfer.parallel.ep_fixed import block_capacity, dispatch_fixed

EXPERTS, HIDDEN, INTER, TOKENS, LIMIT = 8, 32, 16, 6, 7.0
REDUNDANT = ((0, 1, 2, 3, 4, 5), (2, 3, 4, 5, 6, 7))


def _experts():
    generator = torch.Generator().manual_seed(0)
    return [
        [torch.randn(shape, generator=generator) * 0.3 for _ in range(EXPERTS)]
        for shape in ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))
    ]


def _layer(rank_experts):
    w1, w3, w2 = _experts()
    weights = stack_experts([w1[e] for e in rank_experts], [w3[e] for e in rank_experts], [w2[e] for e in rank_experts])
    return SimpleNamespace(ops=resolve(torch.device("cpu"), torch.float32), swiglu_limit=LIMIT,
                           routed_weights=lambda: weights)  # fmt: skip


def _routing(case: str, rank: int, top_k: int):
    """Expert ids [T, k] (distinct per token) and positive mixing weights for one rank's tokens."""
    generator = torch.Generator().manual_seed(100 + rank)
    scores = torch.rand(TOKENS, EXPERTS, generator=generator)
    if case == "to_rank_1":  # rank 1 holds experts 4..7 (contiguous over two ranks)
        scores[:, :4] -= 2.0
    if case == "capacity":  # every token fills rank 1's block: all four of its experts, one more of rank 0's
        scores[:, 4:] += 2.0
    ids = scores.topk(top_k, dim=1).indices
    return ids, torch.rand(TOKENS, top_k, generator=generator) + 0.1


def _run_rank(rank: int, world: int, port: int, cases, results) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        torch.manual_seed(rank)
        out = {}
        for case, top_k in cases:
            if case == "redundant":
                placement = ExpertPlacement(EXPERTS, REDUNDANT[:world] if world == 2 else ((*range(EXPERTS),),))
            else:
                placement = ExpertPlacement.contiguous(EXPERTS, world)
            ep = ExpertParallel(placement, rank, dist.group.WORLD, "cpu")
            layer = _layer(placement.rank_experts[rank])
            x = torch.randn(TOKENS, HIDDEN)
            ids, weights = _routing(case, rank, top_k)
            variable = ep(layer, x, ids, weights)
            with ep.fixed_capacity():
                fixed = ep(layer, x, ids, weights)
            whole = _layer(range(EXPERTS))
            single = whole.ops.routed_moe(x, whole.routed_weights(), ids, weights, LIMIT)
            out[case] = (variable.tolist(), fixed.tolist(), single.tolist(), ep.calls)  # plain data: no shared fds
        results.put((rank, out))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, traceback.format_exc()))


CASES = [("random", 3), ("to_rank_1", 3), ("capacity", 5), ("redundant", 3)]


@pytest.mark.parametrize("world", [2, 1])
def test_fixed_capacity_dispatch_equals_the_variable_size_one(world):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_run_rank, args=(r, world, port, CASES, results)) for r in range(world)]
    for process in processes:
        process.start()
    got = dict(results.get(timeout=240) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    for rank, out in got.items():
        assert not isinstance(out, str), f"rank {rank}:\n{out}"
        for case, (*tensors, calls) in out.items():
            variable, fixed, single = (torch.tensor(t) for t in tensors)
            assert calls == 2, case
            torch.testing.assert_close(fixed, variable, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {case}")
            torch.testing.assert_close(fixed, single, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {case}")


def test_capacity_bound_and_padding_rows_change_nothing():
    """The block is ``T * min(k, L)`` rows; at one rank it holds exactly the slots. Rows of zeros with weight 0
    on a real expert (the padding) return zeros and leave the other rows' outputs as they were."""
    assert block_capacity(4, 6, 32) == 24 and block_capacity(4, 6, 4) == 16
    layer = _layer(range(EXPERTS))
    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(5, HIDDEN, generator=generator)
    ids = torch.randint(0, EXPERTS, (5, 1), generator=generator)
    weights = torch.rand(5, 1, generator=generator)
    alone = layer.ops.routed_moe(rows, layer.routed_weights(), ids, weights, LIMIT)
    padded = layer.ops.routed_moe(
        torch.cat([rows, torch.zeros(7, HIDDEN)]), layer.routed_weights(),
        torch.cat([ids, torch.zeros(7, 1, dtype=torch.long)]), torch.cat([weights, torch.zeros(7, 1)]), LIMIT,
    )  # fmt: skip
    torch.testing.assert_close(padded[:5], alone, rtol=0, atol=0)
    assert torch.equal(padded[5:], torch.zeros(7, HIDDEN))


def test_one_rank_without_a_group_is_the_same_dispatch():
    """``group=None`` (no torch.distributed) replaces the exchange by the identity: the same rows as gloo."""
    placement = ExpertPlacement.contiguous(EXPERTS, 1)
    ep = ExpertParallel(placement, 0, None, "cpu")
    layer = _layer(range(EXPERTS))
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(5))
    ids, weights = _routing("random", 0, 3)
    fixed = dispatch_fixed(ep, layer, x, ids.reshape(-1), weights)
    single = layer.ops.routed_moe(x, layer.routed_weights(), ids, weights, LIMIT)
    torch.testing.assert_close(fixed, single, rtol=1e-5, atol=1e-5)


def _capture_rank(port: int, results) -> None:
    """One NCCL rank: the fixed dispatch captured in a CUDA graph, replayed on new inputs, equals it run eagerly."""
    try:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        placement = ExpertPlacement.contiguous(EXPERTS, 1)
        ep = ExpertParallel(placement, 0, dist.group.WORLD, device, dist.new_group(backend="nccl"))
        w1, w3, w2 = ([w.to(device, torch.bfloat16) for w in ws] for ws in _experts())
        weights = stack_experts(w1, w3, w2)
        layer = SimpleNamespace(ops=resolve(device, torch.bfloat16), swiglu_limit=LIMIT, routed_weights=lambda: weights)
        x = torch.randn(TOKENS, HIDDEN, device=device, dtype=torch.bfloat16)
        ids = torch.rand(TOKENS, EXPERTS, device=device).topk(3, dim=1).indices
        mix = torch.rand(TOKENS, 3, device=device) + 0.1
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with ep.fixed_capacity(), torch.cuda.stream(stream):
            for _ in range(2):
                ep(layer, x, ids, mix)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with ep.fixed_capacity(), torch.cuda.graph(graph):
            captured = ep(layer, x, ids, mix)
        x.copy_(torch.randn_like(x))
        ids.copy_(torch.rand(TOKENS, EXPERTS, device=device).topk(3, dim=1).indices)
        graph.replay()
        with ep.fixed_capacity():
            eager = ep(layer, x, ids, mix)
        single = layer.ops.routed_moe(x, weights, ids, mix, LIMIT)
        results.put((captured.float().cpu().tolist(), eager.float().cpu().tolist(), single.float().cpu().tolist()))
        dist.destroy_process_group()
    except BaseException:
        results.put(traceback.format_exc())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL, CUDA graphs)")
def test_fixed_dispatch_over_nccl_replays_from_a_cuda_graph():
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_capture_rank, args=(free_port(), results))
    process.start()
    got = results.get(timeout=300)
    process.join(timeout=60)
    assert not isinstance(got, str), got
    captured, eager, single = (torch.tensor(t) for t in got)
    torch.testing.assert_close(captured, eager, rtol=0, atol=0)  # the replay used the new inputs
    torch.testing.assert_close(captured, single)  # at one rank: the single-rank op's values (bf16 tolerance)

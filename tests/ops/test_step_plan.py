"""A fixed-width step's index plans (``step_entry_index``, ``step_ring_rows``, ``step_pending_plan``): the Triton
kernels (in Triton's CPU interpreter; compiled on CUDA) against the torch references, equal to the last integer and
dtype, and the references against the plans' definitions on hand-worked steps."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hopper_build import compile_for_hopper
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops.engram_rows import ENGRAM_DEAD
from dsinfer.ops.step_plan import (
    step_engram_lookback_reference,
    step_entry_index_reference,
    step_pending_plan_reference,
    step_ring_rows_reference,
)

CASES = [  # (sequences, width, ratio, per_block, table width, starts dtype, slots dtype)
    (1, 4, 4, 32, 6, torch.int64, torch.int64),
    (3, 4, 2, 64, 4, torch.int64, torch.int32),
    (5, 2, 1, 128, 3, torch.int64, torch.int64),  # ratio 1: an entry a position
    (7, 6, 128, 1, 5, torch.int32, torch.int64),  # HCA's ratio: a window wider than the step
    (33, 4, 4, 2, 8, torch.int64, torch.int32),  # entries past the table's width read its last column
    (300, 5, 4, 32, 4, torch.int64, torch.int64),  # more sequences than one program takes at ratio 128
    (300, 5, 128, 1, 2, torch.int64, torch.int64),
]
TRASH, SPARE = 1000, 77
WINDOW, LAYERS = 8, 3  # the ring stack: rows of 8 positions a slot, 3 layers


def make_inputs(index: int, device: str) -> dict:
    sequences, width, ratio, per_block, table_width, starts_dtype, slots_dtype = CASES[index]
    gen = torch.Generator().manual_seed(index)
    starts = torch.randint(0, ratio * per_block * table_width, (sequences,), generator=gen)
    starts[0] = 0  # a first step at position 0
    accepted = torch.randint(0, width, (sequences,), generator=gen)
    kept_end = starts + accepted + 1
    tensors = {
        "starts": starts.to(starts_dtype), "kept_end": kept_end, "cut": accepted + 1 < width, "kept": accepted + 1,
        "positions": (starts[:, None] + torch.arange(width)).to(starts_dtype),
        "slots": torch.randperm(sequences + 3, generator=gen)[:sequences].to(slots_dtype),
        "tables": torch.randint(0, 500, (sequences, table_width), generator=gen).to(torch.int32),
    }  # fmt: skip
    return {**{name: t.to(device) for name, t in tensors.items()}, "width": width, "ratio": ratio,
            "per_block": per_block}  # fmt: skip


def _differences(name: str, got, want) -> list[str]:
    failures = []
    fields = [] if isinstance(want, torch.Tensor) else [field.name for field in dataclasses.fields(want)]
    pairs = [(f"{name}.{field}", getattr(got, field), getattr(want, field)) for field in fields] or [(name, got, want)]
    for label, mine, theirs in pairs:
        if (mine is None) != (theirs is None):
            failures.append(f"{label}: {mine} != {theirs}")
        elif mine is not None and (mine.dtype != theirs.dtype or not torch.equal(mine.cpu(), theirs.cpu())):
            failures.append(f"{label}: {mine.dtype} {mine.tolist()} != {theirs.dtype} {theirs.tolist()}")
    return failures


def check(device: str) -> list[str]:
    from dsinfer.ops.step_plan import triton as backend

    failures = []
    for index in range(len(CASES)):
        x = make_inputs(index, device)
        entry = (x["starts"], x["tables"], x["width"], x["ratio"], x["per_block"], TRASH)
        rings = (x["positions"], x["slots"], x["kept"], SPARE, WINDOW, LAYERS, (x["slots"].shape[0] + 3) * WINDOW)
        calls = [  # (name, the Triton op, the reference, arguments)
            ("entry_index", backend.step_entry_index_triton, step_entry_index_reference, entry),
            ("entry_index+undo", backend.step_entry_index_triton, step_entry_index_reference, (*entry, x["kept_end"])),
            ("ring_rows", backend.step_ring_rows_triton, step_ring_rows_reference, (*rings[:2], None, *rings[3:])),
            ("ring_rows+kept", backend.step_ring_rows_triton, step_ring_rows_reference, rings),
            ("pending_plan", backend.step_pending_plan_triton, step_pending_plan_reference,
             (x["starts"], x["slots"], x["kept_end"], x["cut"], SPARE, x["ratio"], x["width"])),
        ]  # fmt: skip
        for name, fast, reference, args in calls:
            failures += [f"case {index}: {message}" for message in _differences(name, fast(*args), reference(*args))]
        for image_token in (None, IMAGE_TOKEN):
            failures += [f"case {index}: {message}" for message in _lookback_differences(x, image_token, backend)]
    return failures


IMAGE_TOKEN, LOOKBACK, VOCABULARY = 5, 3, 40


def _lookback_differences(x: dict, image_token: int | None, backend) -> list[str]:
    """``step_engram_lookback``'s history after the Triton op and after the reference, from the same start."""
    sequences, width = x["positions"].shape
    gen = torch.Generator().manual_seed(sequences * 7 + width)
    device = x["slots"].device
    history = torch.randint(0, 1000, (sequences + 3, LOOKBACK), generator=gen).to(device)
    context = torch.randint(0, 1000, (sequences, LOOKBACK), generator=gen).to(device)
    ids = torch.randint(0, VOCABULARY, (sequences, width), generator=gen).to(device)
    vocabulary = torch.randint(0, 500, (VOCABULARY,), generator=gen).to(device)
    args = (context, ids, vocabulary, image_token, x["kept"], x["cut"], x["slots"].long())
    got, want = history.clone(), history.clone()
    backend.step_engram_lookback_triton(got, *args)
    step_engram_lookback_reference(want, *args)
    return [] if torch.equal(got, want) else [f"engram look-back ({image_token}): {int((got != want).sum())} differ"]


def run_interpreted_cases() -> list[str]:
    return check("cpu")


def test_triton_kernels_match_the_references_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_step_plan")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA")
def test_triton_kernels_match_the_references_on_cuda():
    assert check("cuda") == []


def test_the_entry_index_of_steps_on_both_sides_of_an_entry_edge():
    """Ratio 4, width 2, 2 entries a block: positions 6-7 complete entry 1 (positions 4-7: the first block's
    second row); positions 8-9 start entry 2 (8-11) without completing it, so its write goes to the trash."""
    index = step_entry_index_reference(torch.tensor([6, 8]), torch.tensor([[40, 41], [50, 51]]), 2, 4, 2, TRASH)
    assert index.entry_ids.tolist() == [[1], [2]] and index.owned.tolist() == [[True], [False]]
    assert index.blocks.tolist() == [[40], [TRASH]] and index.offsets.tolist() == [[1], [0]]


def test_a_rollbacks_undo_blocks_keep_only_entries_rejected_positions_completed():
    """Ratio 2, width 4, from position 4 (entries 2 and 3 completed at 5 and 7): keeping 2 positions (kept end 6)
    undoes entry 3 only; keeping all 4 undoes nothing."""
    index = step_entry_index_reference(torch.tensor([4, 4]), torch.tensor([[10, 11], [20, 21]]), 4, 2, 4, TRASH,
                                       torch.tensor([6, 8]))  # fmt: skip
    assert index.entry_ids.tolist() == [[2, 3], [2, 3]] and index.blocks.tolist() == [[10, 10], [20, 20]]
    assert index.undo_blocks.tolist() == [[TRASH, 10], [TRASH, TRASH]]


def test_the_ring_rows_of_a_snapshot_and_a_rollback():
    """Window 8, 2 layers of 4 slots (32 rows a layer), one sequence in slot 1 at positions 6..8 (ring rows 6, 7,
    0): the snapshot reads all three in slot 1; a rollback keeping 1 position sends that one to the spare slot 3."""
    positions, slots = torch.tensor([[6, 7, 8]]), torch.tensor([1])
    assert step_ring_rows_reference(positions, slots, None, 3, 8, 2, 32).tolist() == [14, 15, 8, 46, 47, 40]
    rollback = step_ring_rows_reference(positions, slots, torch.tensor([1]), 3, 8, 2, 32)
    assert rollback.tolist() == [30, 15, 8, 62, 47, 40]


def test_the_engram_lookback_after_a_cut_step():
    """Look-back of 3, a step of 3 tokens (image token 5 among them) after context [7, 8, 9]: keeping 2 tokens
    leaves [9, c(a), dead]; the uncut sequence's row stays."""
    history = torch.zeros(3, 3, dtype=torch.long)
    vocabulary = torch.arange(10) + 100
    step_engram_lookback_reference(history, torch.tensor([[7, 8, 9], [1, 2, 3]]), torch.tensor([[4, 5, 6], [4, 4, 4]]),
                                   vocabulary, 5, torch.tensor([2, 3]), torch.tensor([True, False]),
                                   torch.tensor([2, 0]))  # fmt: skip
    assert history.tolist() == [[0, 0, 0], [0, 0, 0], [9, 104, ENGRAM_DEAD]]


def test_the_pending_plan_of_a_cut_and_a_whole_step():
    """Ratio 4, width 4, two sequences from position 6 (window 4-7 unfinished): the first keeps 2 positions (6, 7:
    kept end 8, the window 4-7 just completed inside the accepted ones, so it comes from the record and the new
    window has no row), the second keeps all 4 (not cut: every target the spare slot)."""
    plan = step_pending_plan_reference(torch.tensor([6, 6]), torch.tensor([3, 5]), torch.tensor([8, 10]),
                                       torch.tensor([True, False]), SPARE, 4, 4)  # fmt: skip
    assert plan.rows.tolist() == [0, 1, 2, 3]
    assert plan.pending_targets.tolist() == [[SPARE] * 4, [SPARE] * 4]
    assert plan.pending_source[0].tolist() == [4, 5, 6, 6]  # rows from the record's row 4, clamped to its end
    assert plan.recorded.tolist() == [True, False] and plan.previous_targets.tolist() == [3, SPARE]
    assert plan.previous_source[0].tolist() == [0, 1, 2, 3]


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("kernel", ["entry_index", "ring_rows", "pending_plan", "engram_lookback"])
def test_kernels_compile_for_hopper(kernel):
    """sm_90 cubins (Triton's bundled ptxas, no GPU needed) of the four plans, with the options the rollback uses."""
    pytest.importorskip("triton")
    from dsinfer.ops.step_plan import triton as backend

    builds = {  # kernel, pointer types (the rest of the arguments are int32), constants
        "entry_index": (backend._entry_index_kernel, {"starts_ptr": "*i64", "tables_ptr": "*i32",
                        "kept_end_ptr": "*i64", "ids_ptr": "*i64", "blocks_ptr": "*i32", "offsets_ptr": "*i64",
                        "owned_ptr": "*u8", "undo_ptr": "*i32"}, dict(UNDO=True, BLOCK_B=16, BLOCK_R=4)),
        "ring_rows": (backend._ring_rows_kernel, {"positions_ptr": "*i64", "slots_ptr": "*i64", "kept_ptr": "*i64",
                      "out_ptr": "*i64"}, dict(KEPT=True, BLOCK=1024)),
        "pending_plan": (backend._pending_plan_kernel, {name: "*i64" for name in (
            "starts_ptr", "slots_ptr", "kept_end_ptr", "rows_ptr", "pending_source_ptr", "pending_targets_ptr",
            "previous_source_ptr", "previous_targets_ptr")} | {"cut_ptr": "*u8", "recorded_ptr": "*u8"},
            dict(BLOCK_B=32, BLOCK_R=128)),
        "engram_lookback": (backend._engram_lookback_kernel, {"history_ptr": "*i64", "context_ptr": "*i64",
                            "ids_ptr": "*i64", "vocabulary_ptr": "*i64", "kept_ptr": "*i64", "cut_ptr": "*u8",
                            "slots_ptr": "*i64"}, dict(GATED=True, BLOCK_B=16, BLOCK_R=4)),
    }  # fmt: skip
    fn, pointers, constants = builds[kernel]
    compiled = compile_for_hopper(fn, pointers, constants, dict(num_warps=4, num_stages=1))
    assert compiled.asm["cubin"] and "ld.local" not in compiled.asm["ptx"]

"""What the scores kernels share (:mod:`.triton`'s split-scores kernel and :mod:`.fp4_words`' words kernel): the
query split for the dot and the -inf tail past a sequence's visible entries. Each kernel addresses its tiles
inline: as a shared function returning the rows, the split-scores kernel spills registers on sm_90."""

from __future__ import annotations

from dsinfer.ops.triton_support import tl, triton

if triton is not None:

    @triton.jit
    def split_for_dot(x, SPLIT: tl.constexpr, DOT: tl.constexpr):
        """``x`` in the dot's dtype, and (``SPLIT``) the remainder ``x - high`` in it too (else ``high`` again)."""
        high = x.to(DOT)
        if SPLIT:
            low = (x.to(tl.float32) - high.to(tl.float32)).to(DOT)
        else:
            low = high
        return high, low

    @triton.jit
    def fill_unseen(out, first, n_scored, last, BLOCK_E: tl.constexpr):
        """-inf at the chunk's slots past its scored tiles (past the visible entries: no key is read)."""
        for start in range(first + n_scored * BLOCK_E, last, BLOCK_E):
            entry = start + tl.arange(0, BLOCK_E)
            tl.store(out + entry, tl.full([BLOCK_E], float("-inf"), tl.float32), mask=entry < last)

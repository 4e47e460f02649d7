"""Counter-based sampling noise: a pure function of (seed, sample index, output position, vocab column).

The sampler's exponential race (``argmax(probs / noise)``) needs one Exp(1) value per vocabulary column. Drawing
them from a stateful per-request generator ties the noise to how many draws came before; here every value is
computed from its coordinates alone, so a request's noise at output position ``p`` is the same whatever batch,
row, device or step schedule it is sampled in, and no state has to be carried, copied or rolled back.

The construction is SplitMix64 (Steele, Lea and Flood, 2014; the finaliser is Stafford's "Mix13"):

* a row key: ``seed`` (taken modulo 2**64), then the stream, the sample index and the output position are folded
  in one after the other, each by ``h = mix64((h ^ part) + GOLDEN)``; this runs on the host in Python integers
  (a handful of operations per row, exact uint64 arithmetic), or, for a step captured in a CUDA graph, up to the
  sample index on the host (:func:`stream_key`) and the position on the device (:func:`position_keys`);
* column ``c`` of a row with key ``k`` is the ``c``-th SplitMix64 output from state ``k``:
  ``mix64(k + (c + 1) * GOLDEN)``; this runs on the logits' device in int64 torch ops (wrapping multiply and
  add, logical shifts written as an arithmetic shift and a mask), so CPU and CUDA produce the same bits;
* the uniform is the top 24 bits times ``2**-24``, in ``[0, 1)`` exactly as ``torch.rand`` makes its float32
  values, and the noise is ``-log(u)``. ``u == 0`` gives ``inf``, which only drops that column from this one
  race (``p / inf == 0``). The top 24 bits do not depend on the finaliser's last xor-shift (it moves bits down
  by 31), so the device code skips it.

The integer bits and the uniforms are identical on every device; ``log`` is the device's own, so CPU and CUDA
exponentials can differ in the last unit of float32, as the softmax they are divided into already does.

``stream`` keeps apart the draws made for different purposes at one position: :data:`RACE_STREAM` for the
token race, :data:`ACCEPT_STREAM` for speculative decoding's accept / reject uniforms.
"""

from __future__ import annotations

import torch

from dsinfer.sampling.host_copies import to_device

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, SplitMix64's increment
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
UNIFORM_BITS = 24  # float32 carries 24 significant bits: every value k * 2**-24 is exact
RACE_STREAM = 0
ACCEPT_STREAM = 1


def mix64(value: int) -> int:
    """SplitMix64's finaliser on a Python int taken as uint64: a bijection of 64-bit values."""
    value &= MASK64
    value = ((value ^ (value >> 30)) * MIX1) & MASK64
    value = ((value ^ (value >> 27)) * MIX2) & MASK64
    return value ^ (value >> 31)


def stream_key(seed: int, sample_index: int, stream: int = RACE_STREAM) -> int:
    """One request's key of one stream before the output position is folded in (uint64, as a Python int): a
    device folds positions into it itself (:func:`position_keys`)."""
    key = seed & MASK64
    for part in (stream, sample_index):
        key = mix64((key ^ (part & MASK64)) + GOLDEN)
    return key


def noise_key(seed: int, sample_index: int, position: int, stream: int = RACE_STREAM) -> int:
    """The row key (uint64, as a Python int) of one request's draws at one output position."""
    return mix64((stream_key(seed, sample_index, stream) ^ (position & MASK64)) + GOLDEN)


def as_int64(value: int) -> int:
    """A uint64 held in a Python int, as the int64 with the same bits (what torch stores)."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def key_tensor(keys: list[int], device: torch.device) -> torch.Tensor:
    """Row keys (uint64 Python ints) as an int64 tensor on ``device``, copied without a stream sync."""
    return to_device([as_int64(key) for key in keys], torch.int64, device)


_COLUMN_OFFSETS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _column_offsets(vocab_size: int, device: torch.device) -> torch.Tensor:
    """``(c + 1) * GOLDEN`` for every column, wrapped to int64; built once per device and width."""
    offsets = _COLUMN_OFFSETS.get((device, vocab_size))
    if offsets is None:
        offsets = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=device).mul_(as_int64(GOLDEN))
        _COLUMN_OFFSETS[(device, vocab_size)] = offsets
    return offsets


def _shift_right(values: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 values taken as uint64 (torch shifts arithmetically)."""
    return values.bitwise_right_shift(bits).bitwise_and_((1 << (64 - bits)) - 1)


def mix64_tensor(values: torch.Tensor) -> torch.Tensor:
    """:func:`mix64` on an int64 tensor holding uint64 bits (wrapping multiplies): the same bits as the host's."""
    values = values.bitwise_xor(_shift_right(values, 30)).mul_(as_int64(MIX1))
    values = values.bitwise_xor_(_shift_right(values, 27)).mul_(as_int64(MIX2))
    return values.bitwise_xor_(_shift_right(values, 31))


def position_keys(stream_keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """:func:`noise_key` on the device: each :func:`stream_key` (int64 bits) with its output position (int64,
    non-negative; broadcast together) folded in, so a captured step keys its draws without the host."""
    return mix64_tensor(stream_keys.bitwise_xor(positions).add_(as_int64(GOLDEN)))


def uniform_bits(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The top :data:`UNIFORM_BITS` bits of SplitMix64 output ``c`` from each key, as int64 ``[len(keys), V]``."""
    state = keys[:, None] + _column_offsets(vocab_size, keys.device)[None, :]  # wraps like uint64
    shifted = torch.empty_like(state)
    torch.bitwise_right_shift(state, 30, out=shifted).bitwise_and_((1 << 34) - 1)  # logical shift by 30
    state.bitwise_xor_(shifted).mul_(as_int64(MIX1))
    torch.bitwise_right_shift(state, 27, out=shifted).bitwise_and_((1 << 37) - 1)
    state.bitwise_xor_(shifted).mul_(as_int64(MIX2))
    return state.bitwise_right_shift_(64 - UNIFORM_BITS).bitwise_and_((1 << UNIFORM_BITS) - 1)


def uniforms(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Float32 uniforms in ``[0, 1)``, ``[len(keys), V]``: the bits times ``2**-24`` (exact)."""
    return uniform_bits(keys, vocab_size).to(torch.float32).mul_(2.0**-UNIFORM_BITS)


def exponentials(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise ``-log(u)``, float32 ``[len(keys), V]``; ``u == 0`` gives ``inf``."""
    return uniforms(keys, vocab_size).log_().neg_()


# CPU passes over a few rows at a time stay in cache; on a GPU one pass over the whole batch is fastest.
_CPU_ROWS_PER_CHUNK = 4


def race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``argmax(probs / exponentials(keys))`` per row: a draw from ``probs / sum(probs)`` (lowest id on ties).

    ``probs`` is float32 ``[R, V]``, unnormalised and possibly zero in places; ``keys`` int64 ``[R]`` on the
    same device. Returns int64 ``[R]`` on that device. On the CPU the rows are raced a few at a time so the
    noise never needs the whole batch's memory.
    """
    rows, vocab_size = probs.shape
    if probs.device.type != "cpu" or rows <= _CPU_ROWS_PER_CHUNK:
        return (probs / exponentials(keys, vocab_size)).argmax(dim=-1)
    token_ids = torch.empty(rows, dtype=torch.int64)
    for start in range(0, rows, _CPU_ROWS_PER_CHUNK):
        stop = start + _CPU_ROWS_PER_CHUNK
        token_ids[start:stop] = (probs[start:stop] / exponentials(keys[start:stop], vocab_size)).argmax(dim=-1)
    return token_ids

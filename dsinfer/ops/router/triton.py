"""The router's scores and pick in one Triton kernel after the logits' GEMM: one program per token divides its
logits by the temperature, takes ``sqrt(softplus(.))``, chooses its bias row (``bias``, or ``bias_vl`` for an image
token) or reads its hash-table row, takes the k best experts by repeated arg-max (equal values: the lowest expert,
as the reference's packed-key top-k), gathers their scores, normalises and scales them.

The reference spends about twenty kernels per call (the division, softplus, the square root, the bias's copy and
choice, the packed keys' bit tricks, a top-k, a gather, a sum, a division, a product); at a decode step of a few
tokens each is a launch for almost no work. Expert counts of the models (256 for V4, 384 for V4.1) fit one block;
k is small (6), so k passes over the block in registers cost nothing next to a launch.

On CUDA the scores are computed as torch's CUDA kernels compute them: the temperature as a product with its
float32 reciprocal (torch's division by a host scalar), ``log1p(exp(x))`` through libdevice (the functions torch's
softplus calls), a correctly rounded square root; so a decode step picks what the reference picks on the same
device. Triton's CPU interpreter has no libdevice: there the kernel divides and builds ``log1p`` from ``log``, as
close as float32 allows to the CPU reference. The weights' sum adds the k picks in pick order, which may differ
from torch's in the last float32 bit.
"""

from __future__ import annotations

import struct

import torch

from dsinfer.ops.registry import register
from dsinfer.ops.router.reference import MoeRouteInputs, moe_route_reference
from dsinfer.ops.triton_support import interpreted, tl, triton, triton_available

if triton is not None:
    from triton.language.extra import libdevice
else:  # pragma: no cover - depends on the install
    libdevice = None

MAX_EXPERTS = 4096


if triton is not None:

    @triton.jit
    def _log1p(y):
        """``log(1 + y)`` to a few float32 ulps without libdevice: ``log(u) * y / (u - 1)`` with ``u = 1 + y``."""
        u = 1.0 + y
        shift = tl.where(u == 1.0, 1.0, u - 1.0)
        return tl.where(u == 1.0, y, tl.log(u) * (y / shift))

    @triton.jit
    def _route_kernel(
        logits_ptr,
        bias_ptr,
        bias_vl_ptr,
        image_ptr,
        table_ptr,
        ids_ptr,
        experts_ptr,
        weights_ptr,
        num_experts,
        stride_l,
        stride_image,
        stride_table,
        stride_ids,
        gate_temp,
        inv_temp,
        scaling,
        K: tl.constexpr,
        HASH: tl.constexpr,
        IMAGE: tl.constexpr,
        TEMP: tl.constexpr,
        PRECISE: tl.constexpr,  # libdevice (compiled); else the interpreter's stand-ins
        NORMALIZE: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        e_ok = e < num_experts
        x = tl.load(logits_ptr + t * stride_l + e, mask=e_ok, other=0.0)
        if TEMP:
            if PRECISE:
                x = x * inv_temp
            else:
                x = tl.math.div_rn(x, tl.zeros([BLOCK_E], tl.float32) + gate_temp)
        if PRECISE:
            soft = libdevice.log1p(libdevice.exp(x))
        else:
            soft = _log1p(tl.exp(x))
        scores = tl.sqrt_rn(tl.where(x > 20.0, x, soft))  # torch's softplus: threshold 20, beta 1
        slot = tl.arange(0, BLOCK_K)
        picked = tl.zeros([BLOCK_K], tl.int64)
        weights = tl.zeros([BLOCK_K], tl.float32)
        if HASH:
            token = tl.load(ids_ptr + t * stride_ids).to(tl.int64)
            picked = tl.load(table_ptr + token * stride_table + slot, mask=slot < K, other=0).to(tl.int64)
            for i in tl.static_range(K):
                expert = tl.sum(tl.where(slot == i, picked, 0))
                weights = tl.where(slot == i, tl.sum(tl.where(e == expert, scores, 0.0)), weights)
        else:
            bias = tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32)
            if IMAGE:
                image = tl.load(image_ptr + t * stride_image)
                bias_vl = tl.load(bias_vl_ptr + e, mask=e_ok, other=0.0).to(tl.float32)
                bias = tl.where(image != 0, bias_vl, bias)
            keys = scores + bias
            free = e_ok  # experts not picked yet (a -inf key can still be picked, after every finite one)
            for i in tl.static_range(K):
                best = tl.max(tl.where(free, keys, float("-inf")), axis=0)
                expert = tl.min(tl.where(free & (keys == best), e, BLOCK_E), axis=0)
                picked = tl.where(slot == i, expert.to(tl.int64), picked)
                weights = tl.where(slot == i, tl.sum(tl.where(e == expert, scores, 0.0)), weights)
                free = free & (e != expert)
        if NORMALIZE:
            total = 0.0
            for i in tl.static_range(K):
                total += tl.sum(tl.where(slot == i, weights, 0.0))
            weights = tl.math.div_rn(weights, tl.zeros([BLOCK_K], tl.float32) + (total + 1e-20))
        tl.store(experts_ptr + t * K + slot, picked, mask=slot < K)
        tl.store(weights_ptr + t * K + slot, weights * scaling, mask=slot < K)


def _float32(value: float) -> float:
    """``value`` rounded to float32 (a quotient of two float32 values rounded so is their float32 quotient)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _bias_ok(bias: torch.Tensor | None, experts: int) -> bool:
    return bias is not None and bias.is_floating_point() and bias.shape == (experts,) and bias.stride(0) == 1


def serves(inputs: MoeRouteInputs) -> bool:
    """Whether the kernel takes these inputs (else :func:`moe_route_triton` runs the reference)."""
    logits, k, hash_table, token_ids = inputs.logits, inputs.k, inputs.hash_table, inputs.token_ids
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1 or logits.requires_grad:
        return False
    tokens, experts = logits.shape
    if not 0 < k <= experts or experts > MAX_EXPERTS:
        return False
    if hash_table is not None:
        return (
            token_ids is not None
            and token_ids.shape == (tokens,)
            and not token_ids.is_floating_point()
            and hash_table.dim() == 2
            and hash_table.shape[1] == k
            and hash_table.stride(1) == 1
            and not hash_table.is_floating_point()
        )
    if not _bias_ok(inputs.bias, experts):
        return False
    image_mask, bias_vl = inputs.image_mask, inputs.bias_vl
    if image_mask is not None and bias_vl is not None:
        return _bias_ok(bias_vl, experts) and image_mask.shape == (tokens,) and image_mask.dtype == torch.bool
    return True


@register("moe_route", "triton", devices=("cuda",), available=triton_available, priority=10)
def moe_route_triton(inputs: MoeRouteInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``moe_route_reference``."""
    if not serves(inputs):
        return moe_route_reference(inputs)
    logits, gate_temp, k = inputs.logits, inputs.gate_temp, inputs.k
    tokens, num_experts = logits.shape
    experts = torch.empty(tokens, k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(tokens, k, dtype=torch.float32, device=logits.device)
    if tokens == 0:
        return experts, weights
    hashed = inputs.hash_table is not None
    image = not hashed and inputs.image_mask is not None and inputs.bias_vl is not None
    image_arg = inputs.image_mask.view(torch.uint8) if image else logits
    table = inputs.hash_table if hashed else experts
    ids = inputs.token_ids if hashed else experts
    bias_arg = inputs.bias if not hashed else logits
    block_e = triton.next_power_of_2(num_experts)
    _route_kernel[(tokens,)](
        logits, bias_arg, inputs.bias_vl if image else bias_arg, image_arg, table, ids, experts, weights, num_experts,
        logits.stride(0), image_arg.stride(0), table.stride(0), ids.stride(0), float(gate_temp),
        _float32(1.0 / _float32(gate_temp)), float(inputs.scaling), K=k, HASH=hashed, IMAGE=image,
        TEMP=gate_temp != 1.0, PRECISE=not interpreted(), NORMALIZE=bool(inputs.normalize), BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(k), num_warps=4 if block_e <= 512 else 8,
    )  # fmt: skip
    return experts, weights

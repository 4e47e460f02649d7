"""Random models built straight on the device in the release formats: routed experts as packed FP4 with ue8m0
scales, everything else in the compute dtype (the FP8 linears as their bf16 dequantisation, as served on
Hopper, or kept as codes and scales on request). No checkpoint is written and no dequantised copy of an expert
ever exists, so a model of release depth can be measured on one GPU.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from dsinfer.config import ModelConfig, ModelConfigV41, QuantizationConfig
from dsinfer.layers.moe import MoE
from dsinfer.models.deepseek_v4 import DeepseekV4, RopeTables
from dsinfer.models.deepseek_v41 import DeepseekV41
from dsinfer.models.fp8_linears import FP8_LINEAR_POLICIES, keep_as_fp8_
from dsinfer.models.loader import parameter_dtype
from dsinfer.models.tiny import randomize_, randomize_v41_, storage_format, storage_format_v41
from dsinfer.ops.moe import ExpertWeights
from dsinfer.ops.quant import E2M1_VALUES, FP4_GROUP
from dsinfer.ops.registry import resolve

# Root mean square of a uniformly random e2m1 code (16 codes, both signs).
_E2M1_RMS = math.sqrt(sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES))


def fp4_scale_byte(fan_in: int) -> int:
    """The ue8m0 byte whose power of two makes random codes have standard deviation about ``fan_in ** -0.5``."""
    return 127 + round(math.log2(fan_in**-0.5 / _E2M1_RMS))


def random_fp4_experts(
    n_experts: int, hidden: int, intermediate: int, device: torch.device | str, generator: torch.Generator
) -> ExpertWeights:
    """Stacked random routed experts in the checkpoint's FP4 layout (uniform codes, one scale per tensor kind)."""

    def codes(rows: int, inputs: int) -> torch.Tensor:
        shape = (n_experts, rows, inputs // 2)
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=generator)

    def scales(rows: int, inputs: int) -> torch.Tensor:
        shape = (n_experts, rows, inputs // FP4_GROUP)
        return torch.full(shape, fp4_scale_byte(inputs), dtype=torch.uint8, device=device)

    return ExpertWeights(
        codes(2 * intermediate, hidden), scales(2 * intermediate, hidden),
        codes(hidden, intermediate), scales(hidden, intermediate), intermediate, True,
    )  # fmt: skip


def draw_meta_experts(model, device, seed: int = 0, skip=()) -> None:
    """Random routed experts on ``device`` for every MoE of ``model`` still holding shapes only (built with
    ``expert_device="meta"``), except those in ``skip`` (the layers an expert offload draws in place), as
    :func:`build_native_model` draws them."""
    generator = torch.Generator(device=device).manual_seed(seed + 11)
    skipped = {id(moe) for moe in skip}
    for moe in model.modules():
        if not isinstance(moe, MoE) or id(moe) in skipped or not moe.is_packed:
            continue
        like = moe.routed_weights()
        if like.w13.device.type == "meta":
            hidden = 2 * like.w13.shape[-1]  # packed FP4: two codes a byte
            weights = random_fp4_experts(like.num_experts, hidden, like.intermediate_size, device, generator)
            moe.pack(weights, None if like.num_experts == moe.n_experts else like.num_experts)  # an EP rank's own


@torch.no_grad()
def build_native_model(
    config: ModelConfig | ModelConfigV41,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cuda",
    seed: int = 0,
    with_mtp: bool = False,
    fp8_linears: str = "dequantize",
    engram_tables: bool = True,
    expert_device: torch.device | str | None = None,
) -> DeepseekV4 | DeepseekV41:
    """A random model with packed FP4 routed experts, built on ``device`` without any dequantised expert.

    ``with_mtp`` gives a V4 model its ``num_nextn_predict_layers`` MTP layers (to time speculative decoding).
    ``fp8_linears="keep"`` keeps the linears the release stores as FP8 as codes and scales (``Fp8Linear``), as the
    loader's ``keep`` policy does; ``dequantize`` (default) leaves them in ``dtype``, as served on Hopper.
    ``engram_tables=False`` builds a V4.1 model without its Engram tables (they live outside it, as the host
    placement keeps them; attach a fetcher), so a large table is never allocated on ``device``.
    ``expert_device``: where the routed experts are drawn (None: ``device``; ``"cpu"``: host memory, for expert
    offload)."""
    if fp8_linears not in FP8_LINEAR_POLICIES:
        raise ValueError(f"fp8_linears: expected one of {list(FP8_LINEAR_POLICIES)}, got {fp8_linears!r}")
    v41 = isinstance(config, ModelConfigV41)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    ops = resolve(device, dtype)  # once, for the device and dtype the model runs on
    try:
        with torch.device("meta"):
            model = DeepseekV41(config, ops=ops) if v41 else DeepseekV4(config, with_mtp=with_mtp, ops=ops)
    finally:
        torch.set_default_dtype(previous)
    if v41 and not engram_tables:
        model.drop_engram_tables()
    moes = [module for module in model.modules() if isinstance(module, MoE)]
    for moe in moes:
        moe.experts = None
    model.to_empty(device=device)
    for name, param in model.state_dict(keep_vars=True).items():
        param.data = param.data.to(parameter_dtype(name, param, dtype))
    randomize_v41_(model, seed) if v41 else randomize_(model, seed)
    expert_device = device if expert_device is None else expert_device
    meta = torch.device(expert_device).type == "meta"  # shapes only: an offload builder fills the experts in place
    generator = None if meta else torch.Generator(device=expert_device).manual_seed(seed + 7)
    for moe in moes:
        shared = moe.shared_experts
        hidden = shared.w1.weight.shape[1] if shared is not None else config.hidden_size
        inter = config.moe_intermediate_size
        moe.pack(random_fp4_experts(moe.n_experts, hidden, inter, expert_device, generator))
    if fp8_linears == "keep":  # the release's formats (a config without a quantization block takes the release's)
        storage = storage_format_v41 if v41 else storage_format
        stored = config if config.quantization is not None else replace(config, quantization=QuantizationConfig())
        block = stored.quantization.weight_block_size
        keep_as_fp8_(model, lambda name: storage(name, stored) == "fp8", block, dtype)
    model.rope = RopeTables(config).to(device)
    model.join_projections()
    return model.requires_grad_(False).eval()

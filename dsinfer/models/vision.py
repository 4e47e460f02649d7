"""DeepSeek-V4.1's image encoder: the vision tower (a ViT with a 2D RoPE), the aligner, the span embeddings.

* **Tower** (``vision.*``): patches [N, 3 * 14^2] -> ``patch_embed.proj`` -> ``blocks`` (RMSNorm, fused
  ``wqkv`` attention with RoPE on height in one half of each head and width in the other, ``wo``; RMSNorm,
  SwiGLU MLP with a fused ``w1`` = [gate; up] and ``w2``) -> ``norm``. Attention is bidirectional within an
  image; a batch packs every image's patches into one tensor so the linears run once for all of them, and
  the ``vision_attention`` op keeps images apart.
* **Aligner** (``aligner.*``): each 3 x 3 neighbourhood of patch features (zero-padded on the right and
  bottom), flattened channel-major, goes through ``w1`` -> exact GELU -> ``w2`` into the LLM width.
* **Span** (``image_start``, ``image_newline``, ``image_end``): ``[start] + (row + [newline]) * n_llm_h +
  [end]``, spliced into the prompt's embeddings where the placeholder ids stand.

Names follow the official checkpoint; RMSNorm weights stay float32 (the loader keeps every ``norm.weight``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.config.vision import VisionConfig
from dsinfer.images.inputs import ImageInput
from dsinfer.layers.op_binding import reference_ops
from dsinfer.ops.registry import OpTable


class VisionRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value = x.float()
        value = value * torch.rsqrt(value.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * value).to(x.dtype)


def rope_2d(vit_h: int, vit_w: int, rope_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """Angles [vit_h * vit_w, rope_dim]: the row index times the frequencies, then the column index."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, device=device, dtype=torch.float32) / rope_dim))
    rows = torch.arange(vit_h, device=device, dtype=torch.float32).repeat_interleave(vit_w)
    cols = torch.arange(vit_w, device=device, dtype=torch.float32).repeat(vit_h)
    return torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)


def apply_rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [N, heads, head_dim] by half-split pairs: (first, second) -> (f cos - s sin, s cos + f sin)."""
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(config.patch_dim, config.hidden_size)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.wo = nn.Linear(config.hidden_size, config.hidden_size)
        self.ops: OpTable = reference_ops()  # the model binds its table when it is built

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        q, k, v = (part.reshape(x.shape[0], self.heads, self.head_dim) for part in self.wqkv(x).chunk(3, dim=-1))
        q, k = apply_rope_2d(q, cos, sin), apply_rope_2d(k, cos, sin)
        attend = self.ops.vision_attention
        return self.wo(attend(q, k, v, lengths).reshape(x.shape[0], -1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = VisionAttention(config)
        self.norm2 = VisionRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class VisionTower(nn.Module):
    """Packed patches of several images -> per-patch features [N, hidden] (``vision.*``)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = VisionRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        cfg = self.config
        lengths = [h * w for h, w in grids]
        x = self.patch_embed(patches.to(self.patch_embed.proj.weight.dtype))
        angles = torch.cat([rope_2d(h, w, cfg.head_dim // 2, cfg.rope_theta, x.device) for h, w in grids])
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.norm(x)


class Aligner(nn.Module):
    """Features of one image's patch grid -> one LLM-width vector per ``ratio`` x ``ratio`` cell (``aligner.*``)."""

    def __init__(self, config: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.ratio = config.downsample_ratio
        self.w1 = nn.Linear(config.hidden_size * self.ratio**2, text_hidden)
        self.w2 = nn.Linear(text_hidden, text_hidden)

    def cells(self, features: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        """[vit_h * vit_w, C] -> [llm_h * llm_w, C * ratio^2], each cell flattened channel-major."""
        r = self.ratio
        grid = features.reshape(vit_h, vit_w, -1).permute(2, 0, 1)
        grid = F.pad(grid, (0, -vit_w % r, 0, -vit_h % r))
        return F.unfold(grid.unsqueeze(0), r, stride=r).squeeze(0).transpose(0, 1)

    def forward(self, cells: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(cells)))


def add_image_encoder(model: nn.Module, config: VisionConfig, text_hidden: int) -> None:
    """Give ``model`` the encoder's modules under their official root names (``vision``, ``aligner``, ``image_*``)."""
    model.vision = VisionTower(config)
    model.aligner = Aligner(config, text_hidden)
    model.image_start = nn.Parameter(torch.zeros(text_hidden))
    model.image_newline = nn.Parameter(torch.zeros(text_hidden))
    model.image_end = nn.Parameter(torch.zeros(text_hidden))


def encode_images(model: nn.Module, images: list[ImageInput]) -> list[torch.Tensor]:
    """One [num_tokens, text_hidden] span per image, every image through the tower in one packed batch."""
    if not images:
        return []
    device = model.image_start.device
    grids = [(image.plan.vit_h, image.plan.vit_w) for image in images]
    patches = torch.cat([image.patches.to(device) for image in images])
    features = model.vision(patches, grids).split([h * w for h, w in grids])
    cells = [model.aligner.cells(f, h, w) for f, (h, w) in zip(features, grids, strict=True)]
    aligned = model.aligner(torch.cat(cells)).split([c.shape[0] for c in cells])
    return [_span(model, rows, image) for rows, image in zip(aligned, images, strict=True)]


def _span(model: nn.Module, aligned: torch.Tensor, image: ImageInput) -> torch.Tensor:
    """``[start] + (aligner row + [newline]) * llm_h + [end]``."""
    llm_h, llm_w = image.plan.llm_h, image.plan.llm_w
    dtype = aligned.dtype
    newline = model.image_newline.to(dtype).expand(llm_h, 1, -1)
    rows = torch.cat([aligned.reshape(llm_h, llm_w, -1), newline], dim=1).reshape(llm_h * (llm_w + 1), -1)
    return torch.cat([model.image_start.to(dtype)[None], rows, model.image_end.to(dtype)[None]])


class ImageEncoder(nn.Module):
    """The encoder on its own (the encoder sweep builds this): the same root names as inside the model."""

    def __init__(self, config: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        add_image_encoder(self, config, text_hidden)

    def forward(self, images: list[ImageInput]) -> list[torch.Tensor]:
        return encode_images(self, images)

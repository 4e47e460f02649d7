"""DeepSeek-V4.1's vision tower configuration (the checkpoint's ``vision_config``), parsed and validated once.

Field names and defaults follow Hugging Face's ``DeepseekV41VisionConfig`` (the released checkpoint's
spelling): a 32-layer, 1024-wide ViT with 14-pixel patches and a 2D RoPE, an aligner that merges 3 x 3
patches into one LLM token, and the resize plan's two knobs (``min_pixels``, ``max_image_tokens``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from dsinfer.config.model import ConfigError


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower, aligner and resize plan of a V4.1 checkpoint."""

    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    patch_size: int = 14
    downsample_ratio: int = 3
    rope_theta: float = 10000.0
    max_image_tokens: int = 1024
    min_pixels: int = 295936  # 544 x 544
    max_wh_ratio: int | None = None
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "patch_size",
                     "downsample_ratio", "min_pixels"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"field 'vision_config.{name}': expected a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads or (self.hidden_size // self.num_attention_heads) % 4:
            raise ConfigError(
                f"field 'vision_config.num_attention_heads': {self.num_attention_heads} heads must split "
                f"hidden_size {self.hidden_size} into head dims divisible by 4 (the 2D RoPE halves each head twice)"
            )
        if not isinstance(self.max_image_tokens, int) or self.max_image_tokens < 4:
            raise ConfigError(f"field 'vision_config.max_image_tokens': expected >= 4, got {self.max_image_tokens!r}")
        if self.max_wh_ratio is not None and (
            not isinstance(self.max_wh_ratio, (int, float)) or self.max_wh_ratio <= 0
        ):
            raise ConfigError(
                f"field 'vision_config.max_wh_ratio': expected a positive number, got {self.max_wh_ratio!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch: 3 channels x patch_size x patch_size (channel-major)."""
        return 3 * self.patch_size * self.patch_size

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": "deepseek_v41_vision", **asdict(self)}

    @classmethod
    def from_dict(cls, raw: Any) -> VisionConfig:
        """The checkpoint's ``vision_config`` object; unknown keys are ignored, known ones type-checked."""
        if not isinstance(raw, dict):
            raise ConfigError(f"field 'vision_config': expected an object, got {raw!r}")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known and v is not None}
        for name in ("rope_theta", "rms_norm_eps"):
            if name in values:
                if isinstance(values[name], bool) or not isinstance(values[name], (int, float)):
                    raise ConfigError(f"field 'vision_config.{name}': expected a number, got {values[name]!r}")
                values[name] = float(values[name])
        return cls(**values)


#: The released V4.1-Flash tower: what ``--vision-width flash`` builds for the encoder sweep.
FLASH_VISION = VisionConfig()

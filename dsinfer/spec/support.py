"""Whether a loaded checkpoint can serve a speculative method: checked once, before the engine serves."""

from __future__ import annotations

from dsinfer.config import ConfigError, SpeculativeConfig
from dsinfer.models.deepseek_v4 import DeepseekV4
from dsinfer.models.deepseek_v41 import DeepseekV41


def check_speculative_support(model: DeepseekV4 | DeepseekV41, config: SpeculativeConfig) -> None:
    """Raise :class:`ConfigError` naming ``speculative_config``'s field when ``model`` cannot run ``config``."""
    if config.method == "dspark":
        if not isinstance(model, DeepseekV41):
            raise ConfigError(
                "speculative_config 'method': 'dspark' drafts with DeepSeek-V4.1's DSpark stages; this is a V4 "
                "checkpoint (use 'mtp')"
            )
        if not len(model.mtp):
            raise ConfigError(
                "speculative_config 'method': 'dspark' needs the checkpoint's DSpark stages, and this one has none "
                "(no mtp.* tensors)"
            )
        size, k = model.config.dspark_block_size, config.num_speculative_tokens
        if k > size:
            raise ConfigError(
                f"speculative_config 'num_speculative_tokens': {k} exceeds the checkpoint's DSpark block size "
                f"({size}); a block drafts at most {size} tokens"
            )
        return
    if isinstance(model, DeepseekV41):
        raise ConfigError(
            "speculative_config 'method': 'mtp' needs V4's MTP layers; a V4.1 checkpoint drafts with DSpark stages"
        )
    if not len(model.mtp):
        raise ConfigError(
            "speculative_config 'method': 'mtp' needs the checkpoint's MTP layers, and this one has none "
            "(no mtp.* tensors)"
        )

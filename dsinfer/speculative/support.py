"""Whether a loaded checkpoint can serve a speculative method: checked once, before the engine serves."""

from __future__ import annotations

from dsinfer.config import SpeculativeConfig
from dsinfer.models.served import ServedModel


def check_speculative_support(model: ServedModel, config: SpeculativeConfig) -> None:
    """Raise :class:`ConfigError` naming ``speculative_config``'s field when ``model`` cannot run ``config`` (each
    model family knows its drafting method: :meth:`ServedModel.check_speculative_support`)."""
    model.check_speculative_support(config)

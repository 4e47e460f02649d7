"""dsinfer: inference engine and OpenAI-compatible server for DeepSeek-V4-Flash and V4.1-Flash.

``from dsinfer import LLM, SamplingParams`` (vLLM's spelling) works; both load on first use, so ``import
dsinfer`` alone stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from dsinfer.llm import LLM
    from dsinfer.sampling_params import SamplingParams


def __getattr__(name: str):
    if name == "LLM":
        from dsinfer.llm import LLM

        return LLM
    if name == "SamplingParams":
        from dsinfer.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'dsinfer' has no attribute {name!r}")

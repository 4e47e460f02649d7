"""Images for DeepSeek-V4.1: the resize plan and token counts (``plan``), model-ready inputs (``inputs``)."""

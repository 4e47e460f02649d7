"""dsinfer: inference engine and OpenAI-compatible server for DeepSeek-V4-Flash and V4.1-Flash."""

__version__ = "0.1.0"

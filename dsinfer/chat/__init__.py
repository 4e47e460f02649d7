"""The chat protocol both front ends share: the offline ``LLM`` and the server.

``format`` converts API bodies and renders prompts through deepseek-recipe, ``image_reader`` turns a request's
image parts into model input, ``limits`` holds the per-request checks, and ``stream`` feeds generated tokens to the
library's stream parser. Nothing here imports :mod:`dsinfer.server`, so the server can build an ``LLM`` and the
``LLM`` can render a chat without the two importing each other.
"""

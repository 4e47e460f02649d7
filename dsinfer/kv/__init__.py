"""Caches below the model: per-sequence state slots, compressed blocks, codecs and the packed step."""

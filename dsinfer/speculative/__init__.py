"""Speculative decoding: the drafters (V4's MTP layer, V4.1's DSpark stages), the step that verifies drafts and
drafts again (``executor``), judging the drafts (``verify``, with ``rejection`` sampling), rollback of rejected
cache writes, and the verify and draft steps replayed from CUDA graphs (``graphs``)."""

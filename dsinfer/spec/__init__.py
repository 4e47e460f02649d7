"""Speculative decoding: the drafters (V4's MTP layer, V4.1's DSpark stages), verification of drafts, and
rollback of rejected cache writes."""

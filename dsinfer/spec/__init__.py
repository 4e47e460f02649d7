"""Speculative decoding: the drafter (MTP), verification of drafts, and rollback of rejected cache writes."""

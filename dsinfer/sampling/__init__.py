"""Sampling: one token per request from its logits (penalties, grammar masks, the seeded race), the per-request
token counts and grammar masks it reads, and the host copies that feed it. The engine samples every step with
it and the speculative step judges drafts with it, so it sits below both."""

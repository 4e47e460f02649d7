"""Which DP rank takes a new request: the one with the fewest tokens in flight, unless one already holds the
prompt's first blocks (its prefix cache saves their prefill) and is not much busier.

The API process only sees what it sent and what came back, so "holds the blocks" means "was sent a prompt
with the same first blocks recently"; the rank's prefix cache may have evicted them since, which costs a
prefill, never a wrong token.
"""

from __future__ import annotations

from collections import OrderedDict

REMEMBERED_PREFIXES = 4096  # per rank: block-aligned prompt prefixes sent there, least recently used dropped


class RequestBalancer:
    def __init__(self, num_ranks: int, block_tokens: int, affinity_slack_tokens: int) -> None:
        """``affinity_slack_tokens``: how many more in-flight tokens a rank holding the prefix may have."""
        self.block_tokens = block_tokens
        self.slack = affinity_slack_tokens
        self.inflight_tokens = [0] * num_ranks
        self._prefixes: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_ranks)]

    def _prefix_keys(self, prompt: list[int]) -> list[int]:
        """Hashes of the prompt's block-aligned prefixes, longest first."""
        size, keys, chained = self.block_tokens, [], 0
        for start in range(0, len(prompt) // size * size, size):
            chained = hash((chained, tuple(prompt[start : start + size])))
            keys.append(chained)
        return keys[::-1]

    def choose(self, prompt: list[int]) -> int:
        least = min(range(len(self.inflight_tokens)), key=self.inflight_tokens.__getitem__)
        for key in self._prefix_keys(prompt):
            holders = [r for r, seen in enumerate(self._prefixes) if key in seen]
            if holders:
                best = min(holders, key=self.inflight_tokens.__getitem__)
                if self.inflight_tokens[best] <= self.inflight_tokens[least] + self.slack:
                    return best
                break
        return least

    def assign(self, rank: int, prompt: list[int], tokens: int) -> None:
        self.inflight_tokens[rank] += tokens
        seen = self._prefixes[rank]
        for key in self._prefix_keys(prompt):
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > REMEMBERED_PREFIXES:
            seen.popitem(last=False)

    def release(self, rank: int, tokens: int) -> None:
        self.inflight_tokens[rank] -= tokens

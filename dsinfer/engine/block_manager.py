"""Blocks of compressed-cache entries: allocation, reference counts and prefix caching by content hash.

A block covers ``block_tokens`` positions of one sequence. Blocks whose positions are all computed get a hash
of their tokens chained with the previous block's hash; a later sequence with the same prefix takes those
blocks (reference count + 1) instead of recomputing their entries. Freed blocks keep their hash until they
are handed out again (least recently freed first), so a finished prompt stays reusable while memory allows.
"""

from __future__ import annotations

from collections import OrderedDict

from dsinfer.engine.sequence import Sequence, new_table_token


class BlockManager:
    def __init__(self, num_blocks: int, block_tokens: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks, self.block_tokens = num_blocks, block_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.block_hash: dict[int, int] = {}
        self.hash_to_block: dict[int, int] = {}
        self.prefix_queries = 0  # blocks looked up
        self.prefix_hits = 0  # blocks found

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks ``seq`` needs so that its first ``num_tokens`` positions have a block."""
        return max(0, -(-num_tokens // self.block_tokens) - len(seq.block_table))

    def blocks_needed_for(self, num_tokens: int) -> int:
        """Blocks a new sequence of ``num_tokens`` positions takes."""
        return -(-num_tokens // self.block_tokens)

    def reset_prefix_cache(self) -> None:
        """Forget every block's hash (vLLM's ``reset_prefix_cache``): no later prompt reuses what is cached now.
        The counters start again too."""
        self.block_hash.clear()
        self.hash_to_block.clear()
        self.prefix_queries = self.prefix_hits = 0

    def take_cached_prefix(self, seq: Sequence) -> int:
        """Attach the longest run of cached full blocks matching the sequence's tokens; return their tokens.

        At least one token is always left to compute, so the sequence produces logits this step.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return 0
        tokens = seq.token_ids
        for index in range((len(tokens) - 1) // self.block_tokens):
            self.prefix_queries += 1
            key = self._hash(seq.block_hashes[-1] if seq.block_hashes else None, tokens, index, seq)
            block = self.hash_to_block.get(key)
            if block is None:
                break
            self.prefix_hits += 1
            self._reference(block)
            seq.block_table.append(block)
            seq.block_hashes.append(key)
        return len(seq.block_table) * self.block_tokens

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Give ``seq`` enough blocks for ``num_tokens`` positions (the caller checked there are enough)."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            block, _ = self.free_blocks.popitem(last=False)
            old = self.block_hash.pop(block, None)
            if old is not None and self.hash_to_block.get(old) == block:
                del self.hash_to_block[old]
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def register_computed(self, seq: Sequence) -> None:
        """Publish the hashes of blocks whose positions are now all computed."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed // self.block_tokens, len(seq.block_table))
        if len(seq.block_hashes) >= full:
            return
        tokens = seq.token_ids
        for index in range(len(seq.block_hashes), full):
            key = self._hash(seq.block_hashes[-1] if seq.block_hashes else None, tokens, index, seq)
            block = seq.block_table[index]
            if block not in self.block_hash:
                self.block_hash[block] = key
                self.hash_to_block.setdefault(key, block)
            seq.block_hashes.append(key)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Return the tail blocks ``seq`` no longer needs for its first ``num_tokens`` positions (rejected drafts)."""
        keep = max(-(-num_tokens // self.block_tokens), len(seq.block_hashes))
        if len(seq.block_table) > keep:
            seq.table_token = new_table_token()  # the table shrinks: staged copies of it are stale
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):  # the tail first: a shared prefix is the last to be reused
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
        seq.block_table = []
        seq.table_token = new_table_token()
        seq.block_hashes = []

    def _reference(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_blocks[block]
        self.ref_counts[block] += 1

    def _hash(self, parent: int | None, tokens: list[int], index: int, seq: Sequence) -> int:
        """The block's key: its tokens chained to the previous block's key, plus the content hash (and the
        offset into the span) of every image overlapping it: image spans are one repeated id, so two
        different pictures of one size would otherwise share blocks."""
        start = index * self.block_tokens
        stop = start + self.block_tokens
        images = tuple((image.content_hash, start - image.offset) for image in seq.images
                       if image.offset < stop and image.end > start)  # fmt: skip
        return hash((parent, tuple(tokens[start:stop]), images))

"""Fixed-size KV blocks: reference counts, a free list in LRU order, and the prefix cache.

A block whose last owner lets go stays in the cache (its hash still maps to it) until the
free list hands it out again, oldest-freed first: that is the LRU eviction of cached blocks."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None        # set once the block is full and cached
    token_ids: tuple[int, ...] = ()        # the tokens it holds when cached: confirms a hit


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # block id -> None, oldest-freed first; holds exactly the blocks with ref_count 0.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}   # block hash -> block id
        # (block id, hash, tokens) of cached blocks that allocate() handed out again, when a
        # lower tier wants them (the scheduler drains it into the plan's host offloads); None: off.
        self.evicted: list[tuple[int, bytes, tuple[int, ...]]] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` fresh blocks (evicting cached ones, LRU first), or None and nothing taken."""
        if num_blocks > len(self._free):
            return None
        ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self.evicted is not None and self._cached.get(block.block_hash) == block_id:
                    self.evicted.append((block_id, block.block_hash, block.token_ids))
                self._evict(block)
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def _evict(self, block: Block) -> None:
        if self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
        block.block_hash, block.token_ids = None, ()

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...]) -> int | None:
        """The cached block holding exactly `token_ids` under `block_hash`, or None.

        Comparing the tokens means a hash collision can never be taken for a hit."""
        block_id = self._cached.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks a request reuses (removing free ones from the free list)."""
        for b in block_ids:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self._free[b]
            block.ref_count += 1

    def cache(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """Register a full block under its hash (the first block with a hash keeps it)."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        self._cached[block_hash] = block_id

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each; blocks reaching zero join the free list's young end.

        Callers pass a request's blocks tail first, so its tail is evicted before its prefix."""
        for b in block_ids:
            block = self.blocks[b]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {b} freed twice")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[b] = None

    def reset_cache(self) -> int:
        """Forget every cached hash of unused blocks; returns how many were dropped.

        Blocks with owners keep theirs: their requests still read them, and a hash is only
        ever dropped together with the tokens that confirm it (`_evict`)."""
        dropped = 0
        for b in list(self._free):
            block = self.blocks[b]
            if block.block_hash is not None:
                self._evict(block)
                dropped += 1
        return dropped

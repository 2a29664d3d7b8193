"""Per-request KV blocks on top of the BlockPool: prefix-cache lookups, slot allocation,
caching of blocks as they fill, and freeing. The scheduler sees only block ids and counts."""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from services.scheduler.core.block_pool import BlockPool
from services.scheduler.core.host_tier import HostTier
from services.scheduler.core.request import Request

HashFn = Callable[[bytes, tuple[int, ...], str], bytes]


def chained_block_hash(parent: bytes, token_ids: tuple[int, ...], cache_salt: str) -> bytes:
    """SHA-256 over (parent hash, token ids, salt): equal hashes mean equal whole prefixes."""
    h = hashlib.sha256(parent)
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in token_ids))
    h.update(cache_salt.encode())
    return h.digest()


@dataclass
class PrefixCacheStats:
    queries: int = 0      # prompt tokens looked up
    hits: int = 0         # of those, found in the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: HashFn = chained_block_hash, num_host_blocks: int = 0) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.stats = PrefixCacheStats()
        # Tier 1 (host_tier.py): what the pool evicts goes to the worker's host slots.
        self.host = HostTier(num_host_blocks) if num_host_blocks > 0 and enable_prefix_caching else None
        self.offloads: list[tuple[int, int]] = []    # (block id, slot) for the plan being built
        if self.host is not None:
            self.pool.evicted = []

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_hashes(self, req: Request, num_full_blocks: int) -> list[bytes]:
        """Hashes of the request's first `num_full_blocks` blocks (memoised on the request)."""
        hashes = req.block_hashes
        tokens = req.all_token_ids if len(hashes) < num_full_blocks else None
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else b""
            hashes.append(self.hash_fn(parent, tuple(tokens[i * bs:(i + 1) * bs]), req.cache_salt))
        return hashes[:num_full_blocks]

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Block ids of the longest cached prefix of a waiting request's known tokens.

        At least one token is always left to compute: its logits give the next token."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        tokens = req.all_token_ids
        bs = self.block_size
        hits = []
        for i, block_hash in enumerate(self._block_hashes(req, max_blocks)):
            block_id = self.pool.lookup(block_hash, tuple(tokens[i * bs:(i + 1) * bs]))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def find_host_prefix(self, req: Request, start: int) -> list[int]:
        """Host slots of the blocks after the first `start` that tier 1 holds, in a row (taken:
        made most recent and pinned for the plan being built). Call after find_cached_prefix."""
        if self.host is None:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        tokens, bs, hashes = req.all_token_ids, self.block_size, req.block_hashes
        slots = []
        for i in range(start, max_blocks):
            slot = self.host.take(hashes[i], tuple(tokens[i * bs:(i + 1) * bs]))
            if slot is None:
                break
            slots.append(slot)
        return slots

    def local_prefix_blocks(self, req: Request) -> int:
        """How many leading blocks of a waiting request tiers 0 and 1 hold now (nothing taken)."""
        if not self.enable_prefix_caching:
            return 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        tokens, bs = req.all_token_ids, self.block_size
        for i, block_hash in enumerate(self._block_hashes(req, max_blocks)):
            ids = tuple(tokens[i * bs:(i + 1) * bs])
            if self.pool.lookup(block_hash, ids) is None and (self.host is None or not self.host.contains(block_hash, ids)):
                return i
        return max_blocks

    def prompt_hashes(self, req: Request) -> list[bytes]:
        """The chain of every full block a prefix hit may cover (all but the last prompt token)."""
        return self._block_hashes(req, (req.num_tokens - 1) // self.block_size)

    def take_offloads(self) -> list[tuple[int, int]]:
        out, self.offloads = self.offloads, []
        if self.host is not None:
            self.host.end_plan()
        return out

    def _offload_evicted(self) -> None:
        evicted = self.pool.evicted
        if not evicted:
            return
        for block_id, block_hash, token_ids in evicted:
            slot = self.host.store(block_hash, token_ids)
            if slot is not None:
                self.offloads.append((block_id, slot))
        evicted.clear()

    def allocate(self, req: Request, num_tokens: int, cached_prefix: list[int] = ()) -> bool:
        """Make the request's blocks cover `num_tokens` tokens, reusing `cached_prefix` first."""
        if cached_prefix:
            self.pool.touch(list(cached_prefix))
            req.block_ids.extend(cached_prefix)
        need = self.blocks_for(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        got = self.pool.allocate(need)
        if self.host is not None:
            self._offload_evicted()
        if got is None:
            if cached_prefix:  # undo, so a failed admission leaves nothing behind
                del req.block_ids[-len(cached_prefix):]
                self.pool.free(list(reversed(cached_prefix)))
            return False
        req.block_ids.extend(got)
        return True

    def can_fit(self, num_new_blocks: int) -> bool:
        return num_new_blocks <= self.pool.num_free

    def cache_computed_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """Register every block that is full of computed, known tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens, req.num_tokens) // self.block_size
        if num_full <= req.num_cached_blocks:
            return
        tokens = req.all_token_ids
        bs = self.block_size
        hashes = self._block_hashes(req, num_full)
        for i in range(req.num_cached_blocks, num_full):
            self.pool.cache(req.block_ids[i], hashes[i], tuple(tokens[i * bs:(i + 1) * bs]))
        req.num_cached_blocks = num_full

    def reset_prefix_cache(self) -> int:
        """Drop the prefix-cache entries of every block no request holds (vLLM's
        reset_prefix_cache); returns how many blocks were flushed. Held blocks keep theirs,
        so running requests lose nothing and their blocks stay shareable."""
        return self.pool.reset_cache()

    def free(self, req: Request) -> None:
        """Release the request's blocks at once, tail first (so its prefix stays cached longest)."""
        if req.block_ids:
            self.pool.free(list(reversed(req.block_ids)))
            req.block_ids = []
        req.num_cached_blocks = 0

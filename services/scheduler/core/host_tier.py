"""Tier 1's index: which block hashes the worker's host pool holds, in which slot (docs/kv_tiers.md).

The worker owns the pinned host memory (`--kv-offload-gb`); the scheduler owns this index and
tells the worker, in each StepPlan, which device blocks to copy to which slots (blocks the block
pool is about to hand out again: tier 1 keeps what tier 0 evicts) and which slots to copy into
which device blocks (a prefix hit in host memory). LRU over slots; the tokens of each entry
confirm a hit, as in the block pool, so a hash collision is never taken for one.

Within one plan the worker copies offloads before loads, so a slot that this plan loads from is
pinned until the plan is emitted: no offload of the same plan may overwrite it."""
from __future__ import annotations

from collections import OrderedDict


class HostTier:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError("num_slots must be >= 0")
        self.num_slots = num_slots
        self._lru: OrderedDict[bytes, int] = OrderedDict()   # hash -> slot, least recent first
        self._tokens: dict[int, tuple[int, ...]] = {}        # slot -> the tokens it holds
        self._free = list(range(num_slots - 1, -1, -1))      # pop() gives slot 0 first
        self._pinned: set[int] = set()
        self.stored = 0      # blocks copied in (offloads)

    def __len__(self) -> int:
        return len(self._lru)

    def contains(self, block_hash: bytes, token_ids: tuple[int, ...]) -> bool:
        slot = self._lru.get(block_hash)
        return slot is not None and self._tokens[slot] == token_ids

    def take(self, block_hash: bytes, token_ids: tuple[int, ...]) -> int | None:
        """The slot holding this block, made most recent and pinned for this plan; None: a miss."""
        slot = self._lru.get(block_hash)
        if slot is None or self._tokens[slot] != token_ids:
            return None
        self._lru.move_to_end(block_hash)
        self._pinned.add(slot)
        return slot

    def store(self, block_hash: bytes, token_ids: tuple[int, ...]) -> int | None:
        """A slot for a block leaving the device: None when the pool already holds it (made most
        recent) or no slot can be had (every slot pinned by this plan, or no pool)."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._lru.items() if s not in self._pinned), None)
            if victim is None:
                return None
            slot = self._lru.pop(victim)
        self._lru[block_hash] = slot
        self._tokens[slot] = token_ids
        self.stored += 1
        return slot

    def end_plan(self) -> None:
        self._pinned.clear()

    def reset(self) -> int:
        """Forget every entry (the bytes stay in the worker's slots, unreachable); returns how many."""
        n = len(self._lru)
        self._lru.clear()
        self._tokens.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._pinned.clear()
        return n

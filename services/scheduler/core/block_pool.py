"""Fixed-size KV blocks with reference counts and a free list."""
from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` fresh block ids, or None (and nothing taken) if there are too few."""
        if num_blocks > len(self._free):
            return None
        ids = [self._free.popleft() for _ in range(num_blocks)]
        for b in ids:
            self._ref[b] = 1
        return ids

    def free(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if self._ref[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)

"""Byte extents of one fixed region (the memory backend's arena): first fit, a freed extent
coalesces with its free neighbours, and a free extent of exactly the asked size is reused first
(one namespace's blocks all have one size, so after warm-up nearly every allocation is an
exact reuse of an evicted block's extent). Pure: offsets in, offsets out; the caller locks."""
from __future__ import annotations

import bisect

ALIGN = 256   # every extent starts at a multiple of this (DMA engines and SIMD copies like it)


def aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


class ExtentAllocator:
    """Invariant: the free extents are disjoint, never adjacent (adjacent ones are merged) and
    together with the allocated ones cover [0, capacity) exactly."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity // ALIGN * ALIGN
        self._starts: list[int] = [0] if self.capacity else []   # free extents' offsets, sorted
        self._size: dict[int, int] = {0: self.capacity} if self.capacity else {}   # offset -> size
        self._ends: dict[int, int] = {self.capacity: 0} if self.capacity else {}   # end -> offset
        self._by_size: dict[int, set[int]] = {self.capacity: {0}} if self.capacity else {}
        self.free_bytes = self.capacity

    def allocate(self, size: int) -> int | None:
        """The offset of `size` (rounded up to ALIGN) free bytes, or None when no free extent is
        large enough (the caller evicts and asks again)."""
        size = aligned(size)
        if size <= 0 or size > self.free_bytes:
            return None
        exact = self._by_size.get(size)
        if exact:
            offset = next(iter(exact))
            self._take(offset)
            return offset
        for offset in self._starts:
            have = self._size[offset]
            if have >= size:
                self._take(offset)
                if have > size:
                    self._add(offset + size, have - size)
                return offset
        return None

    def free(self, offset: int, size: int) -> None:
        size = aligned(size)
        if offset % ALIGN or size <= 0 or offset + size > self.capacity or offset in self._size:
            raise ValueError(f"not an allocated extent: [{offset}, +{size})")
        left = self._ends.get(offset)
        if left is not None:             # merge with the free extent just before
            size += self._size[left]
            self._take(left)
            offset = left
        right_size = self._size.get(offset + size)
        if right_size is not None:       # and the one just after
            self._take(offset + size)
            size += right_size
        self._add(offset, size)

    def free_extents(self) -> list[tuple[int, int]]:
        """(offset, size) of every free extent, by offset (tests check the invariant with it)."""
        return [(o, self._size[o]) for o in self._starts]

    def _take(self, offset: int) -> None:
        size = self._size.pop(offset)
        del self._ends[offset + size]
        same = self._by_size[size]
        same.discard(offset)
        if not same:
            del self._by_size[size]
        del self._starts[bisect.bisect_left(self._starts, offset)]
        self.free_bytes -= size

    def _add(self, offset: int, size: int) -> None:
        self._size[offset] = size
        self._ends[offset + size] = offset
        self._by_size.setdefault(size, set()).add(offset)
        bisect.insort(self._starts, offset)
        self.free_bytes += size

"""What every kvstore backend does (host-memory LRU with optional disk spill, Redis), in
values: a key is (namespace id, block hash); a block is its bytes and their CRC-32C.

Backends are synchronous and thread-safe; the gRPC adapter calls them from a thread pool.
A backend never raises for a missing, corrupt or unreachable block: that is a miss.

The memory backend (memory.py) also keeps its blocks in shared memory (`arena`) and offers
reserve / commit / abort of slots and pin / unpin / verify of stored blocks, the zero-copy
plane (store.py uses them when `arena` is set); Redis keeps nothing here (`arena` is None)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

BlockKey = tuple[bytes, bytes]   # (namespace id: 16 bytes, block hash: 1..64 bytes)


class PutOutcome(enum.Enum):
    STORED = "stored"
    EXISTS = "exists"          # already there: refreshed in the LRU, not rewritten
    TOO_LARGE = "too_large"    # larger than the whole capacity: refused
    FAILED = "failed"          # the backend could not take it (unreachable, out of memory)


@dataclass
class BackendStats:
    name: str
    blocks: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    disk_blocks: int = 0
    disk_bytes: int = 0
    disk_capacity_bytes: int = 0
    evictions: int = 0
    corrupt_blocks: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class Backend(Protocol):
    name: str

    def put(self, key: BlockKey, data: bytes, crc: int) -> PutOutcome: ...

    def get(self, key: BlockKey) -> tuple[bytes, int] | None:
        """(data, crc) of a stored block, verified against its checksum; None: a miss (a block
        found corrupt is deleted and counted)."""

    def touch(self, keys: list[BlockKey]) -> None:
        """Mark stored blocks used, in this order (the last one is the most recently used)."""

    def contains(self, keys: list[BlockKey]) -> int:
        """How many of `keys`, from the first, are stored (the longest stored prefix)."""

    def flush(self, ns_id: bytes | None) -> int:
        """Remove a namespace's blocks (None: every block); the number removed."""

    def stats(self) -> BackendStats: ...

    def close(self) -> None: ...

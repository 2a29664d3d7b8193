"""The byte format of one block outside the process (a disk spill file, a Redis value): a fixed
header that names the block and its checksum, then the bytes. Decoding checks everything, so
a short, truncated or foreign record is refused (None), never trusted. No pickle."""
from __future__ import annotations

import struct

from services.common.kv_blocks import MAX_HASH_BYTES, checksum

MAGIC = b"MKVB"
# 2: the checksum is CRC-32C (1 was zlib's CRC-32): a record of version 1 is refused, a miss.
VERSION = 2
# magic, version, hash length, size, crc32c, namespace id (16 bytes); then the hash, then the data
_HEADER = struct.Struct("<4sBB2xQI16s")
HEADER_BYTES = _HEADER.size


def encode(ns_id: bytes, block_hash: bytes, data, crc: int) -> bytes:
    head = _HEADER.pack(MAGIC, VERSION, len(block_hash), len(data), crc, ns_id)
    return b"".join((head, block_hash, data))


def record_size(block_hash: bytes, size: int) -> int:
    return HEADER_BYTES + len(block_hash) + size


def decode(raw, ns_id: bytes, block_hash: bytes) -> tuple[bytes, int] | None:
    """(data, crc) when `raw` is a whole, intact record of exactly this block; else None."""
    if len(raw) < HEADER_BYTES:
        return None
    magic, version, hlen, size, crc, rec_ns = _HEADER.unpack_from(raw, 0)
    if magic != MAGIC or version != VERSION or hlen > MAX_HASH_BYTES or rec_ns != ns_id:
        return None
    start = HEADER_BYTES + hlen
    if bytes(raw[HEADER_BYTES:start]) != block_hash or len(raw) != start + size:
        return None
    data = bytes(raw[start:])
    if checksum(data) != crc:
        return None
    return data, crc

"""What the kvstore and its clients agree on about a KV block, besides the proto: the checksum,
the namespace's validation and its id, and the bounds of one call (docs/kvstore.md).

The checksum is CRC-32C (the `crc32c` package: the CPU's CRC instruction, and it releases the
GIL). Measured over 2 MiB blocks on the H200 box (16 cores, bench/results/host_copy_probe.json):
52 GB/s on 8 threads, against 17 GB/s for zlib.crc32 (CRC-32) and 32 GB/s for a numpy copy;
on one core of this 2-core CPU machine 13 GB/s vs zlib's 6. blake2b / sha256 measured
0.1-0.3 GB/s, far too slow for 2 MiB blocks."""
from __future__ import annotations

import hashlib

import crc32c

import services  # noqa: F401  (puts the generated code on sys.path)
from meshllm.v1 import kv_pb2  # noqa: E402

MAX_HASH_BYTES = 64            # the scheduler's chained hash is a 32-byte SHA-256
GRPC_PAYLOAD_BYTES = 32 << 20  # bytes per Put/Get over gRPC (messages are <= 64 MiB)
MAX_BLOCK_BYTES = GRPC_PAYLOAD_BYTES  # one block must fit one gRPC call (an 8B model's is 2 MiB)
MAX_LOOKUP_HASHES = 65536      # a 1M-token prompt at block size 16
MAX_BLOCKS_PER_CALL = 4096


class NamespaceError(ValueError):
    """A namespace that cannot name comparable bytes (the field is in the message)."""


def checksum(data) -> int:
    """CRC-32C of a bytes-like object (memoryviews of mmaps and tensors included)."""
    return crc32c.crc32c(data)


def copy_into(dst, src) -> None:
    """`dst[:] = src` for bytes-like objects of one length, without holding the GIL."""
    import numpy as np  # here, not at import: the engines' flag parsing needs none of it
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def copy_and_checksum(dst, src) -> int:
    """Copy `src` into `dst` (bytes-like, same length) and return the CRC-32C of what landed in
    `dst`. Both steps release the GIL (numpy's contiguous copy, crc32c), so blocks copied on
    several threads move in parallel."""
    import numpy as np
    out = np.frombuffer(dst, dtype=np.uint8)
    np.copyto(out, np.frombuffer(src, dtype=np.uint8))
    return crc32c.crc32c(out)


def check_namespace(ns: "kv_pb2.KvNamespace") -> None:
    if not ns.model_id:
        raise NamespaceError("namespace.model_id is required")
    for name in ("model_id", "weights_fingerprint", "dtype", "kv_cache_dtype", "layout"):
        if len(getattr(ns, name)) > 256:
            raise NamespaceError(f"namespace.{name} is longer than 256 characters")
    if ns.block_size <= 0:
        raise NamespaceError("namespace.block_size must be positive")
    if ns.num_layers <= 0:
        raise NamespaceError("namespace.num_layers must be positive")
    if ns.tp_size <= 0:
        raise NamespaceError("namespace.tp_size must be >= 1")
    if ns.tp_rank >= ns.tp_size:
        raise NamespaceError(f"namespace.tp_rank {ns.tp_rank} must be < tp_size {ns.tp_size}")
    if not 0 < ns.block_bytes <= MAX_BLOCK_BYTES:
        raise NamespaceError(f"namespace.block_bytes must be in [1, {MAX_BLOCK_BYTES}], got {ns.block_bytes}")


def namespace_id(ns: "kv_pb2.KvNamespace") -> bytes:
    """16 bytes that differ for any two namespaces that differ in any field (a length-prefixed
    encoding of every field, so no two field lists collide by concatenation)."""
    h = hashlib.blake2b(digest_size=16, person=b"meshllm-kvns-v1")
    for text in (ns.model_id, ns.weights_fingerprint, ns.dtype, ns.kv_cache_dtype, ns.layout):
        raw = text.encode()
        h.update(len(raw).to_bytes(4, "little") + raw)
    for number in (ns.block_size, ns.num_layers, ns.tp_size, ns.tp_rank, ns.block_bytes):
        h.update(int(number).to_bytes(8, "little"))
    return h.digest()


def check_hash(block_hash: bytes) -> None:
    if not 0 < len(block_hash) <= MAX_HASH_BYTES:
        raise NamespaceError(f"a block hash must be 1..{MAX_HASH_BYTES} bytes, got {len(block_hash)}")


def add_kvstore_flag(parser) -> None:
    """`--kvstore-addr` on an engine service (scheduler, worker): where the secondary KV tier is."""
    parser.add_argument("--kvstore-addr", default="",
                        help="the kvstore (secondary KV tier, docs/kvstore.md) HOST:PORT; empty: none")


def check_kvstore_addr(addr: str) -> None:
    """ValueError unless `addr` is empty or HOST:PORT (an IPv6 host in brackets)."""
    if not addr:
        return
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--kvstore-addr must be HOST:PORT, got {addr!r}")


# ---- the bulk messages, encoded by hand ---------------------------------------------------------
# protobuf's Python serializer moves big bytes fields at ~0.5-1 GB/s (measured: 40-90 ms for a
# 32 MiB PutRequest); these build the same wire bytes (equal to SerializeToString, checked in
# tests/unit/test_kvstore_wire.py) with one join, so gRPC bytes are not bound by protobuf.

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _field(number: int, length: int) -> bytes:
    """The tag and length of a length-delimited field."""
    return _varint(number << 3 | 2) + _varint(length)


def _block(meta: "kv_pb2.KvBlockMeta | None", data) -> list:
    """The parts of one KvBlock (field numbers as in kv.proto: meta = 1, data = 2)."""
    if meta is None:
        return []
    m = meta.SerializeToString()
    head = _field(1, len(m)) + m
    if data is None or not len(data):
        return [head]
    return [head + _field(2, len(data)), data]


def encode_put_request(ns: "kv_pb2.KvNamespace", blocks: list[tuple["kv_pb2.KvBlockMeta", object]]) -> bytes:
    """A serialized PutRequest (namespace = 1, blocks = 2) with the bytes of each block inline."""
    n = ns.SerializeToString()
    parts = [_field(1, len(n)), n]
    for meta, data in blocks:
        body = _block(meta, data)
        parts += [_field(2, sum(map(len, body))), *body]
    return b"".join(parts)


def encode_get_response(blocks: list[tuple["kv_pb2.KvBlockMeta | None", object]]) -> bytes:
    """A serialized GetResponse (blocks = 1); (None, None) is a miss (an empty KvBlock)."""
    parts = []
    for meta, data in blocks:
        body = _block(meta, data)
        parts += [_field(1, sum(map(len, body))), *body]
    return b"".join(parts)

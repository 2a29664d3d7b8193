"""The kvstore's hand-built bulk messages are exactly what protobuf would serialize, so any
client or server using the generated code reads them (and a reader can never be fooled by a
field boundary in the bytes)."""
from __future__ import annotations

import os

import pytest

from services.common.kv_blocks import encode_get_response, encode_put_request, kv_pb2

NS = kv_pb2.KvNamespace(model_id="smollm2", weights_fingerprint="w", dtype="bfloat16", kv_cache_dtype="fp8_e4m3",
                        block_size=16, num_layers=30, tp_size=2, tp_rank=1, block_bytes=200_000, layout="L2BHD")


@pytest.mark.parametrize("size", [1, 127, 128, 16383, 16384, 200_000])   # varint length boundaries
def test_a_hand_built_put_request_is_the_protobuf_serialization(size):
    blocks = [(kv_pb2.KvBlockMeta(block_hash=os.urandom(32), size=size, checksum=0xFFFFFFFF - i), os.urandom(size))
              for i in range(3)]
    raw = encode_put_request(NS, [(m, memoryview(d)) for m, d in blocks])
    expected = kv_pb2.PutRequest(namespace=NS, blocks=[kv_pb2.KvBlock(meta=m, data=d) for m, d in blocks])
    assert raw == expected.SerializeToString()
    assert kv_pb2.PutRequest.FromString(raw) == expected


def test_a_hand_built_get_response_is_the_protobuf_serialization_misses_included():
    hit = (kv_pb2.KvBlockMeta(block_hash=b"h" * 32, size=300, checksum=7), bytearray(os.urandom(300)))
    items = [(None, None), hit, (None, None), hit]
    raw = encode_get_response(items)
    expected = kv_pb2.GetResponse(blocks=[kv_pb2.KvBlock(meta=m, data=bytes(d)) if m else kv_pb2.KvBlock()
                                          for m, d in items])
    assert raw == expected.SerializeToString()
    parsed = kv_pb2.GetResponse.FromString(raw)
    assert [b.meta.block_hash for b in parsed.blocks] == [b"", b"h" * 32, b"", b"h" * 32]
    assert encode_get_response([]) == b""


# ---- the zero-copy calls at the service's edge (the servicer driven in-process) ---------------
class Aborted(Exception):
    def __init__(self, code, details: str) -> None:
        super().__init__(details)
        self.code = code


class Context:
    """The part of grpc.aio's ServicerContext the servicer uses: abort ends the call."""

    async def abort(self, code, details: str):
        raise Aborted(code, details)


ZNS = kv_pb2.KvNamespace(model_id="m", block_size=16, num_layers=1, tp_size=1, block_bytes=8192)


@pytest.fixture
def servicer():
    import grpc  # noqa: F401  (the status codes)
    from concurrent.futures import ThreadPoolExecutor

    from services.kvstore.memory import MemoryBackend
    from services.kvstore.server import KvStoreServicer, zero_copy_transfers
    from services.kvstore.store import Store
    store = Store(MemoryBackend(8 * 8192))
    pool = ThreadPoolExecutor(2)
    svc = KvStoreServicer(store, None, pool, pool, zero_copy_transfers(store, 30.0))
    yield svc
    pool.shutdown()
    store.backend.close()


def _call(method, request):
    import asyncio
    return asyncio.run(method(request, Context()))


def _code(method, request):
    with pytest.raises(Aborted) as err:
        _call(method, request)
    return err.value.code


def test_a_zero_copy_put_and_get_through_the_servicer_are_in_place_and_checked(servicer):
    import grpc
    from services.common.kv_blocks import checksum
    opened = _call(servicer.OpenArena, kv_pb2.OpenArenaRequest(zero_copy=True))
    assert opened.zero_copy and opened.lease_id and opened.arena_bytes == servicer.store.arena.size
    lease = kv_pb2.ShmWindow(lease_id=opened.lease_id)
    res = _call(servicer.Reserve, kv_pb2.ReserveRequest(namespace=ZNS, block_hashes=[b"a", b"b"], lease=lease))
    assert [s.status for s in res.slots] == [kv_pb2.KV_PUT_STATUS_RESERVED] * 2 and res.reserve_id
    mem = servicer.store.arena.view
    blocks = [os.urandom(8192) for _ in range(2)]
    for slot, data in zip(res.slots, blocks):
        mem[slot.offset:slot.offset + 8192] = data
    done = _call(servicer.Commit, kv_pb2.CommitRequest(lease=lease, reserve_id=res.reserve_id,
                                                       checksums=[checksum(blocks[0]), checksum(blocks[1]) ^ 1]))
    assert list(done.statuses) == [kv_pb2.KV_PUT_STATUS_STORED, kv_pb2.KV_PUT_STATUS_BAD_CHECKSUM]
    again = _call(servicer.Reserve, kv_pb2.ReserveRequest(namespace=ZNS, block_hashes=[b"a"], lease=lease))
    assert [s.status for s in again.slots] == [kv_pb2.KV_PUT_STATUS_EXISTS] and not again.reserve_id
    pin = _call(servicer.Pin, kv_pb2.PinRequest(namespace=ZNS, block_hashes=[b"a", b"b"], lease=lease))
    hit, miss = pin.blocks
    assert pin.read_id and not miss.block_hash and hit.checksum == checksum(blocks[0])
    assert bytes(mem[hit.offset:hit.offset + hit.size]) == blocks[0]
    assert _call(servicer.Release, kv_pb2.ReleaseRequest(lease=lease, read_id=pin.read_id)).corrupt_removed == 0
    assert _call(servicer.Stats, kv_pb2.StatsRequest()).pinned_blocks == 0
    # A Release or Commit of something that already ended is answered, and does nothing.
    assert _call(servicer.Release, kv_pb2.ReleaseRequest(lease=lease, read_id=pin.read_id)).corrupt_removed == 0
    assert not _call(servicer.Commit, kv_pb2.CommitRequest(lease=lease, reserve_id=res.reserve_id)).statuses
    _call(servicer.CloseArena, kv_pb2.CloseArenaRequest(window=lease))
    assert _code(servicer.Pin, kv_pb2.PinRequest(namespace=ZNS, block_hashes=[b"a"], lease=lease)) == \
        grpc.StatusCode.FAILED_PRECONDITION


def test_bad_zero_copy_calls_are_invalid_argument_and_give_back_what_they_held(servicer):
    import grpc
    from services.common.kv_blocks import checksum
    lease = kv_pb2.ShmWindow(lease_id=_call(servicer.OpenArena, kv_pb2.OpenArenaRequest(zero_copy=True)).lease_id)
    bad = grpc.StatusCode.INVALID_ARGUMENT
    for req in (kv_pb2.PinRequest(namespace=ZNS, block_hashes=[b"a"]),                       # no lease
                kv_pb2.PinRequest(namespace=ZNS, block_hashes=[b""], lease=lease),           # empty hash
                kv_pb2.PinRequest(namespace=ZNS, block_hashes=[b"x"] * 4097, lease=lease),   # too many
                kv_pb2.PinRequest(namespace=kv_pb2.KvNamespace(model_id="m"), block_hashes=[b"a"], lease=lease)):
        assert _code(servicer.Pin, req) == bad
    assert _code(servicer.Reserve, kv_pb2.ReserveRequest(namespace=ZNS, block_hashes=[b"y" * 65], lease=lease)) == bad
    assert _code(servicer.Pin, kv_pb2.PinRequest(namespace=ZNS, block_hashes=[b"a"],
                                                 lease=kv_pb2.ShmWindow(lease_id=12345))) == \
        grpc.StatusCode.FAILED_PRECONDITION
    data = bytes(8192)
    servicer.store.put(kv_blocks_id(ZNS), 8192, b"a", data, checksum(data))
    pin = _call(servicer.Pin, kv_pb2.PinRequest(namespace=ZNS, block_hashes=[b"a"], lease=lease))
    assert _code(servicer.Release, kv_pb2.ReleaseRequest(lease=lease, read_id=pin.read_id, corrupt=[0] * 4097)) == bad
    assert _call(servicer.Stats, kv_pb2.StatsRequest()).pinned_blocks == 1     # refused before anything
    assert _code(servicer.Release, kv_pb2.ReleaseRequest(lease=lease, read_id=pin.read_id, corrupt=[1])) == bad
    res = _call(servicer.Reserve, kv_pb2.ReserveRequest(namespace=ZNS, block_hashes=[b"b", b"c"], lease=lease))
    assert _call(servicer.Stats, kv_pb2.StatsRequest()).reserved_bytes == 2 * 8192
    assert _code(servicer.Commit, kv_pb2.CommitRequest(lease=lease, reserve_id=res.reserve_id, checksums=[1])) == bad
    stats = _call(servicer.Stats, kv_pb2.StatsRequest())   # a bad Release or Commit still ends its transfer
    assert stats.pinned_blocks == 0 and stats.reserved_bytes == 0 and stats.transfers == 0
    assert servicer.store.lookup(kv_blocks_id(ZNS), [b"a", b"b"]) == 1


def kv_blocks_id(ns) -> bytes:
    from services.common.kv_blocks import namespace_id
    return namespace_id(ns)

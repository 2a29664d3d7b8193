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

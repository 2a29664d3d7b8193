"""The kvstore's NIXL data plane (docs/kvstore.md), end to end: a real kvstore process with the
memory backend offering its block memory over NIXL (UCX), and a real KvClient forced onto it
(data_plane="nixl": it never maps the arena, as on another host). Pin -> NIXL READ -> CRC-32C on
the client -> Release; Reserve -> NIXL WRITE -> Commit checked by the store; a block corrupted in
the arena, or committed with a wrong checksum, is found, reported and removed; a client killed -9 mid-lease (pins, a reservation and a
NIXL READ done) leaks nothing; a restarted store (a new agent) is used again; the fallback order
(zero copy > NIXL > window > gRPC bytes); the metadata only behind the mesh's mTLS.

NIXL is a requirement (requirements.txt): it not importing is a failure here, never a skip."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from services.common.devca import write_dev_ca
from services.common.internal_tls import InternalTls
from services.common.kv_blocks import kv_pb2
from services.common.kv_client import KvClient
from services.common.kv_nixl import nixl_api
from tests.integration.meshproc import ROOT
from tests.integration.test_kvstore import KvStoreProc, commit_with_wrong_crc, corrupt_in_arena, wait_for_miss

import services  # noqa: F401,E402
from meshllm.v1 import kv_pb2_grpc  # noqa: E402

nixl_api()   # raises (a collection error, so a failure) when nixl does not import

BLOCK = 256 << 10
NS = kv_pb2.KvNamespace(model_id="smollm2", weights_fingerprint="w", dtype="float32", kv_cache_dtype="float32",
                        block_size=16, num_layers=30, tp_size=1, block_bytes=BLOCK, layout="L2BHD")


LEASE_TTL_S = 3.0   # the module's store: a killed client's pins and slots come back this soon


@pytest.fixture(scope="module")
def kvstore():
    p = KvStoreProc("--capacity-gb", "0.1", "--lease-ttl-s", str(LEASE_TTL_S)).start()
    yield p
    p.stop()


def _start_all(*stores: KvStoreProc) -> None:
    """Start kvstore processes side by side (each takes a second or two to come up)."""
    with ThreadPoolExecutor(len(stores)) as pool:
        list(pool.map(KvStoreProc.start, stores))


def _blocks(n: int, tag: bytes) -> list[tuple[bytes, bytes]]:
    return [(tag + i.to_bytes(4, "little"), os.urandom(BLOCK)) for i in range(n)]


def _nixl_client(addr: str, **kw) -> KvClient:
    return KvClient(addr, data_plane="nixl", chunk_bytes=4 * BLOCK, timeout_s=2.0, **kw)


def _idle(stats) -> bool:
    return stats.pinned_blocks == 0 and stats.reserved_bytes == 0 and stats.transfers == 0


def test_nixl_round_trip_is_byte_identical_chunked_and_interoperates_with_zero_copy(kvstore):
    nixl, mapped = _nixl_client(kvstore.addr), KvClient(kvstore.addr)
    try:
        assert nixl.transport == "nixl" and mapped.transport == "arena"
        assert nixl.stats().nixl
        # 10 blocks = 2.5 chunks of 4: three Reserve + WRITE + Commit rounds, three Pin + READ + Release.
        blocks = _blocks(10, b"nx-")
        hashes = [h for h, _ in blocks]
        assert nixl.put(NS, blocks) == 10 and nixl.lookup(NS, hashes) == 10
        dests = [bytearray(BLOCK) for _ in range(11)]
        assert nixl.get_into(NS, hashes[:5] + [b"nx-absent"] + hashes[5:], dests) == [True] * 5 + [False] + [True] * 5
        assert [bytes(d) for i, d in enumerate(dests) if i != 5] == [d for _, d in blocks]
        # Stored already: EXISTS (kept, no WRITE); the planes read what the other wrote.
        assert nixl.put(NS, blocks[:3]) == 3
        assert mapped.get(NS, hashes) == [d for _, d in blocks]
        more = _blocks(3, b"nx-zc-")
        assert mapped.put(NS, more) == 3 and nixl.get(NS, [h for h, _ in more]) == [d for _, d in more]
        # No mapping here: the in-place API says so (the caller uses get_into / put).
        assert nixl.read_zero_copy(NS, hashes, lambda start, views: None) is None
        assert nixl.write_zero_copy(NS, hashes, lambda start, idx, views: None) is None
        assert _idle(nixl.stats())
    finally:
        nixl.close()
        mapped.close()


def test_a_block_corrupted_in_the_arena_is_found_by_the_nixl_reader_reported_and_removed(kvstore):
    client = _nixl_client(kvstore.addr)
    blocks = _blocks(3, b"nx-rot-")
    hashes = [h for h, _ in blocks]
    try:
        assert client.put(NS, blocks) == 3
        before = client.stats().corrupt_blocks
        corrupt_in_arena(kvstore.addr, NS, hashes[1])   # a same-host process scribbles over block 1
        assert client.get(NS, hashes) == [blocks[0][1], None, blocks[2][1]]   # READ, then refused by its CRC
        stats = client.stats()
        assert stats.corrupt_blocks == before + 1 and _idle(stats)             # reported, checked, removed
        assert client.lookup(NS, hashes) == 1
        assert client.put(NS, blocks[1:2]) == 1 and client.get(NS, hashes[1:2]) == [blocks[1][1]]
    finally:
        client.close()


def test_a_block_committed_with_a_wrong_checksum_is_never_read_over_nixl(kvstore):
    client = _nixl_client(kvstore.addr)
    data = os.urandom(BLOCK)
    try:
        assert commit_with_wrong_crc(kvstore.addr, NS, [b"nx-bad-1", b"nx-bad-2"], data) == [
            kv_pb2.KV_PUT_STATUS_STORED] * 2            # answered before the store's check
        assert client.get(NS, [b"nx-bad-1", b"nx-bad-2"]) == [None, data]   # READ, refused by its CRC
        wait_for_miss(client, NS, b"nx-bad-1")
        assert _idle(client.stats()) and client.lookup(NS, [b"nx-bad-2"]) == 1
    finally:
        client.close()


def test_the_nixl_metadata_needs_a_live_lease(kvstore):
    with grpc.insecure_channel(kvstore.addr) as ch:
        stub = kv_pb2_grpc.KvStoreStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.NixlMetadata(kv_pb2.NixlMetadataRequest(lease=kv_pb2.ShmWindow(lease_id=12345)), timeout=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        opened = stub.OpenArena(kv_pb2.OpenArenaRequest(zero_copy=True), timeout=5)
        meta = stub.NixlMetadata(kv_pb2.NixlMetadataRequest(lease=kv_pb2.ShmWindow(lease_id=opened.lease_id)),
                                 timeout=5)
        assert meta.agent_name == opened.nixl_agent and meta.agent_metadata and meta.arena_bytes == opened.arena_bytes
        stub.CloseArena(kv_pb2.CloseArenaRequest(window=kv_pb2.ShmWindow(lease_id=opened.lease_id)), timeout=5)


# A NIXL client killed -9 mid-lease: it pinned two blocks and READ them over NIXL, and reserved two
# slots, then stops without Release or Commit.
_VANISHING_CLIENT = textwrap.dedent("""
    import sys, time
    import grpc
    import services  # noqa: F401
    from meshllm.v1 import kv_pb2_grpc
    from services.common.kv_blocks import kv_pb2
    from services.common.kv_nixl import DONE, NixlPlane
    ns = kv_pb2.KvNamespace.FromString(bytes.fromhex(sys.argv[2]))
    stored = [bytes.fromhex(h) for h in sys.argv[3:]]
    stub = kv_pb2_grpc.KvStoreStub(grpc.insecure_channel(sys.argv[1]))
    plane = NixlPlane(4 * ns.block_bytes, 1)
    opened = stub.OpenArena(kv_pb2.OpenArenaRequest(zero_copy=True), timeout=5)
    lease = kv_pb2.ShmWindow(lease_id=opened.lease_id)
    remote = plane.load(stub.NixlMetadata(kv_pb2.NixlMetadataRequest(lease=lease), timeout=5))
    pin = stub.Pin(kv_pb2.PinRequest(namespace=ns, block_hashes=stored, lease=lease), timeout=5)
    assert all(m.block_hash for m in pin.blocks)
    staged = remote.plane.stage(time.monotonic() + 5)
    assert remote.transfer("READ", staged, [(j, m.offset) for j, m in enumerate(pin.blocks)], ns.block_bytes,
                           time.monotonic() + 5) == DONE
    res = stub.Reserve(kv_pb2.ReserveRequest(namespace=ns, block_hashes=[b"nx-ttl-a", b"nx-ttl-b"], lease=lease),
                       timeout=5)
    assert [s.status for s in res.slots] == [kv_pb2.KV_PUT_STATUS_RESERVED] * 2
    print("holding", flush=True)
    time.sleep(60)
""")


def test_a_nixl_client_killed_mid_lease_leaks_no_pin_and_no_slot(kvstore):
    client = _nixl_client(kvstore.addr)
    blocks = _blocks(2, b"nx-ttl-")
    child = None
    try:
        assert client.put(NS, blocks) == 2 and _idle(client.stats())
        child = subprocess.Popen([sys.executable, "-c", _VANISHING_CLIENT, kvstore.addr, NS.SerializeToString().hex(),
                                  *(h.hex() for h, _ in blocks)],
                                 cwd=ROOT, stdout=subprocess.PIPE, text=True)
        lines = iter(child.stdout.readline, "")
        assert any(line.strip() == "holding" for line in lines), "the vanishing client did not get its pins"
        stats = client.stats()
        assert stats.pinned_blocks == 2 and stats.reserved_bytes == 2 * BLOCK and stats.transfers == 2
        child.send_signal(signal.SIGKILL)
        child.wait()
        deadline = time.monotonic() + LEASE_TTL_S + 5
        while not _idle(s := client.stats()):
            assert time.monotonic() < deadline, f"the killed client's pins and slots were never freed: {s}"
            time.sleep(0.1)
        assert client.lookup(NS, [b"nx-ttl-a", b"nx-ttl-b"]) == 0      # never committed, never visible
        more = _blocks(4, b"nx-ttl-more-")
        assert client.put(NS, more) == 4 and client.get(NS, [h for h, _ in more]) == [d for _, d in more]
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        client.close()


def test_a_restarted_store_has_a_new_agent_and_the_nixl_client_loads_it(caplog):
    store = KvStoreProc("--capacity-gb", "0.05").start()
    client = _nixl_client(store.addr, max_retry_after_s=0.5)
    caplog.set_level(logging.INFO, logger="meshllm.kv_client")
    blocks = _blocks(3, b"nx-rs-")
    hashes = [h for h, _ in blocks]
    try:
        assert client.put(NS, blocks) == 3 and client.get(NS, hashes) == [d for _, d in blocks]
        store.kill9()
        assert client.get(NS, hashes) == [None] * 3 and client.put(NS, blocks) == 0   # misses, never raised
        store.start()                                           # the same port, a new process
        deadline = time.monotonic() + 15
        # (On a loaded machine a call to the just restarted store can miss its deadline: a retry.)
        while client.put(NS, blocks) != 3 or client.transport != "nixl":
            assert time.monotonic() < deadline, "the restarted kvstore was not used again over NIXL"
            time.sleep(0.2)
        assert client.get(NS, hashes) == [d for _, d in blocks]
        loaded = [r.getMessage().rsplit("agent ", 1)[1] for r in caplog.records if ": NIXL to its " in r.getMessage()]
        assert len(loaded) == 2 and loaded[0] != loaded[1], loaded    # the metadata fetched once per store
        assert _idle(client.stats())
    finally:
        client.close()
        store.stop()


def test_the_planes_are_chosen_zero_copy_then_nixl_then_window_then_grpc_bytes(kvstore):
    def planes(addr: str) -> dict[str, str]:
        out = {}
        for plane in ("auto", "nixl", "shm", "grpc"):
            c = KvClient(addr, data_plane=plane, chunk_bytes=4 * BLOCK)
            try:
                out[plane] = c.transport
                blocks = _blocks(2, f"nx-order-{plane}-".encode())
                assert c.put(NS, blocks) == 2 and c.get(NS, [h for h, _ in blocks]) == [d for _, d in blocks]
            finally:
                c.close()
        return out

    assert planes(kvstore.addr) == {"auto": "arena", "nixl": "nixl", "shm": "shm", "grpc": "grpc"}
    no_zero_copy = KvStoreProc("--capacity-gb", "0.02", "--no-zero-copy")
    no_nixl = KvStoreProc("--capacity-gb", "0.02", "--no-zero-copy", "--no-nixl")
    try:
        _start_all(no_zero_copy, no_nixl)
        assert planes(no_zero_copy.addr) == {"auto": "nixl", "nixl": "nixl", "shm": "shm", "grpc": "grpc"}
        # Without NIXL a forced NIXL client falls back to gRPC bytes (never an error).
        assert planes(no_nixl.addr) == {"auto": "shm", "nixl": "grpc", "shm": "shm", "grpc": "grpc"}
    finally:
        no_zero_copy.stop()
        no_nixl.stop()


def test_the_nixl_plane_is_behind_the_mesh_mtls(tmp_path):
    certs = str(tmp_path / "certs")
    write_dev_ca(certs, services=("kvstore",))
    env = {"MESHLLM_INTERNAL_TLS_CERTFILE": f"{certs}/kvstore.pem", "MESHLLM_INTERNAL_TLS_KEYFILE": f"{certs}/kvstore.key",
           "MESHLLM_INTERNAL_TLS_CA_CERTS": f"{certs}/ca.pem"}
    store = KvStoreProc("--capacity-gb", "0.02", env=env).start()
    mesh = InternalTls(f"{certs}/client.pem", f"{certs}/client.key", f"{certs}/ca.pem")
    try:
        with grpc.insecure_channel(store.addr) as ch:   # no certificate: not even a lease or the metadata
            stub = kv_pb2_grpc.KvStoreStub(ch)
            for call, req in ((stub.OpenArena, kv_pb2.OpenArenaRequest(zero_copy=True)),
                              (stub.NixlMetadata, kv_pb2.NixlMetadataRequest(lease=kv_pb2.ShmWindow(lease_id=1)))):
                with pytest.raises(grpc.RpcError) as err:
                    call(req, timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        outsider = KvClient(store.addr, data_plane="nixl", timeout_s=0.5)
        assert outsider.transport == "grpc" and outsider.put(NS, _blocks(1, b"nx-tls-out-")) == 0
        outsider.close()
        member = _nixl_client(store.addr, credentials=mesh.channel_credentials())
        blocks = _blocks(2, b"nx-tls-")
        assert member.transport == "nixl" and member.put(NS, blocks) == 2
        assert member.get(NS, [h for h, _ in blocks]) == [d for _, d in blocks]
        member.close()
    finally:
        store.stop()

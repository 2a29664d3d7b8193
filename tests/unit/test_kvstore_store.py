"""The kvstore's store rules on every backend: host memory, memory with disk spill, and Redis
(a real redis-server started here on a free port; a failure, never a skip, if it cannot be);
then the memory backend's arena: extents, pins against eviction, reserved slots committed only
with the right CRC-32C, reported corruption checked again, the hard bound with mixed sizes.

Blocks are small (16 KiB) so each test moves a few MB at most."""
from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time

import pytest
import redis

from services.common.kv_blocks import NamespaceError, check_namespace, checksum, kv_pb2, namespace_id
from services.kvstore import record
from services.kvstore.disk import DiskTier
from services.kvstore.extents import ALIGN, ExtentAllocator
from services.kvstore.memory import Extent, MemoryBackend
from services.kvstore.redis_backend import RedisBackend, _key
from services.kvstore.store import PutStatus, Store
from services.scheduler.core.kv_cache_manager import chained_block_hash

BLOCK = 16 << 10


def _ns(**over) -> "kv_pb2.KvNamespace":
    fields = dict(model_id="smollm2", weights_fingerprint="w1", dtype="bfloat16", kv_cache_dtype="bfloat16",
                  block_size=16, num_layers=30, tp_size=1, tp_rank=0, block_bytes=BLOCK, layout="L2BHD")
    fields.update(over)
    return kv_pb2.KvNamespace(**fields)


NS = _ns()
NSID = namespace_id(NS)


def _chain(n: int, salt: str = "", seed: int = 0) -> list[bytes]:
    hashes, parent = [], b""
    for i in range(n):
        parent = chained_block_hash(parent, tuple(range(seed + 16 * i, seed + 16 * i + 16)), salt)
        hashes.append(parent)
    return hashes


def _data(i: int) -> bytes:
    return (i.to_bytes(4, "little") * (BLOCK // 4))


def _put(store: Store, h: bytes, data: bytes, ns_id: bytes = NSID, size: int = BLOCK) -> PutStatus:
    return store.put(ns_id, size, h, data, checksum(data))


# ---- Redis, started by the test ------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _redis_server() -> str:
    """Path of Debian's redis-server, installed with apt-get when missing (as root; about 10 s).
    Never a skip: without it the Redis backend would go untested."""
    found = shutil.which("redis-server")
    if found:
        return found
    if os.geteuid() != 0:
        pytest.fail("redis-server is not installed and this is not root: run `sudo apt-get install -y redis-server`")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "redis-server"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if r.returncode != 0:
            pytest.fail(f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr[-2000:]}")
    found = shutil.which("redis-server")
    if not found:
        pytest.fail("apt-get installed redis-server but it is not on PATH")
    return found


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    exe = _redis_server()
    port = _free_port()
    d = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(d), "--maxmemory-policy", "allkeys-lru", "--maxmemory-samples", "10"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    yield url
    proc.kill()
    proc.wait()


@pytest.fixture(params=["memory", "disk", "redis"])
def store(request, tmp_path):
    """A store of 8 blocks' capacity on each backend."""
    if request.param == "memory":
        backend = MemoryBackend(8 * BLOCK)
    elif request.param == "disk":
        backend = MemoryBackend(2 * BLOCK, DiskTier(str(tmp_path / "spill"), 8 * record.record_size(b"x" * 32, BLOCK)))
    else:
        url = request.getfixturevalue("redis_url")
        redis.Redis.from_url(url).flushall()
        backend = RedisBackend(url, 8 * record.record_size(b"x" * 32, BLOCK))
    s = Store(backend)
    yield s
    backend.close()


def _corrupt(store: Store, key) -> None:
    b = store.backend
    if isinstance(b, RedisBackend):
        r = redis.Redis.from_url(b.url)
        raw = bytearray(r.get(_key(key)))
        raw[-5] ^= 0xFF
        r.set(_key(key), bytes(raw))
    elif not b.corrupt_for_test(key):   # not in memory: on disk
        path = b.spill.path_for_test(key)
        raw = bytearray(open(path, "rb").read())
        raw[-5] ^= 0xFF
        open(path, "wb").write(raw)


# ---- the same rules on every backend ---------------------------------------------------------
def test_put_get_lookup_round_trip(store):
    chain = _chain(6)
    assert [_put(store, h, _data(i)) for i, h in enumerate(chain[:4])] == [PutStatus.STORED] * 4
    assert _put(store, chain[0], _data(0)) == PutStatus.EXISTS
    assert store.lookup(NSID, chain) == 4
    assert store.lookup(NSID, chain[1:]) == 3
    assert store.lookup(NSID, _chain(3, seed=999)) == 0
    for i, h in enumerate(chain[:4]):
        data, crc = store.get(NSID, BLOCK, h)
        assert data == _data(i) and crc == checksum(_data(i))
    assert store.get(NSID, BLOCK, chain[4]) is None


def test_a_block_whose_bytes_do_not_match_its_checksum_is_refused(store):
    h = _chain(1)[0]
    assert store.put(NSID, BLOCK, h, _data(1), checksum(_data(1)) ^ 1) == PutStatus.BAD_CHECKSUM
    assert store.get(NSID, BLOCK, h) is None and store.lookup(NSID, [h]) == 0


def test_a_block_of_the_wrong_size_is_refused(store):
    h = _chain(1)[0]
    short = _data(1)[:-1]
    assert store.put(NSID, BLOCK, h, short, checksum(short)) == PutStatus.BAD_SIZE
    assert store.lookup(NSID, [h]) == 0


def test_a_corrupted_stored_block_is_a_miss_and_is_removed(store):
    chain = _chain(2)
    for i, h in enumerate(chain):
        _put(store, h, _data(i))
    _corrupt(store, (NSID, chain[0]))
    assert store.get(NSID, BLOCK, chain[0]) is None
    assert store.backend.stats().corrupt_blocks >= 1
    assert store.lookup(NSID, chain) == 0          # gone, not served again
    assert store.get(NSID, BLOCK, chain[1])[0] == _data(1)


def test_namespaces_and_salts_isolate(store):
    chain = _chain(3, salt="tenant-a")
    for i, h in enumerate(chain):
        _put(store, h, _data(i))
    # Same tokens, another tenant's salt: other hashes, nothing found.
    assert store.lookup(NSID, _chain(3, salt="tenant-b")) == 0
    assert store.lookup(NSID, _chain(3, salt="tenant-a")) == 3
    # Same hashes, any namespace field different: nothing found.
    for other in (_ns(dtype="float16"), _ns(kv_cache_dtype="fp8_e4m3"), _ns(tp_rank=1, tp_size=2),
                  _ns(weights_fingerprint="w2"), _ns(model_id="other")):
        oid = namespace_id(other)
        assert store.lookup(oid, chain) == 0
        assert store.get(oid, BLOCK, chain[0]) is None
    assert store.lookup(NSID, chain) == 3


def test_a_put_larger_than_the_capacity_is_refused_cleanly(store):
    chain = _chain(2)
    _put(store, chain[0], _data(0))
    big = 64 * BLOCK
    blob = bytes(big)
    assert store.put(NSID, big, chain[1], blob, checksum(blob)) == PutStatus.TOO_LARGE
    assert store.get(NSID, BLOCK, chain[0])[0] == _data(0)   # nothing evicted for it


def test_flush_removes_one_namespace_or_all(store):
    other = namespace_id(_ns(model_id="other"))
    chain = _chain(2)
    for i, h in enumerate(chain):
        _put(store, h, _data(i))
        _put(store, h, _data(i), ns_id=other)
    assert store.flush(other) == 2
    assert store.lookup(other, chain) == 0 and store.lookup(NSID, chain) == 2
    assert store.flush(None) == 2
    assert store.lookup(NSID, chain) == 0


# ---- capacity and LRU order ------------------------------------------------------------------
def test_memory_lru_evicts_the_least_recently_used_and_never_exceeds_capacity():
    backend = MemoryBackend(4 * BLOCK)
    store = Store(backend)
    chain = _chain(12)
    for i, h in enumerate(chain[:4]):
        _put(store, h, _data(i))
    store.get(NSID, BLOCK, chain[0])                  # 0 is now the most recently used
    _put(store, chain[4], _data(4))
    assert [k[1] for k in backend.keys()] == [chain[2], chain[3], chain[0], chain[4]]
    for i, h in enumerate(chain[5:], 5):
        _put(store, h, _data(i))
        assert backend.stats().bytes <= 4 * BLOCK
    assert backend.stats().evictions == 8
    assert store.lookup(NSID, chain[8:]) == 4


def test_a_chain_is_evicted_from_its_tail_so_what_stays_is_a_prefix():
    store = Store(MemoryBackend(4 * BLOCK))
    chain = _chain(6)
    # One put larger than the memory: the head gets the slots, the tail is dropped.
    statuses = store.put_batch(NSID, BLOCK, [(h, _data(i), checksum(_data(i))) for i, h in enumerate(chain)])
    assert statuses == [PutStatus.STORED] * 4 + [PutStatus.FAILED] * 2
    assert store.lookup(NSID, chain) == 4                      # blocks 0..3: the head
    found = store.get_batch(NSID, BLOCK, chain)
    assert [f is not None for f in found] == [True] * 4 + [False] * 2
    other = _chain(2, seed=500)
    store.put_batch(NSID, BLOCK, [(h, _data(9), checksum(_data(9))) for h in other])
    assert store.lookup(NSID, chain) == 2 and store.lookup(NSID, other) == 2


def test_disk_spill_is_bounded_lru_and_survives_a_restart(tmp_path):
    per_file = record.record_size(chain_hash := _chain(1)[0], BLOCK)
    assert len(chain_hash) == 32
    spill_dir = str(tmp_path / "spill")
    backend = MemoryBackend(2 * BLOCK, DiskTier(spill_dir, 4 * per_file))
    store = Store(backend)
    chain = _chain(8)
    for i, h in enumerate(chain):
        _put(store, h, _data(i))
        assert backend.spill.stats().bytes <= 4 * per_file
    # memory: 6, 7; disk: 2..5 (0 and 1 fell off the disk's LRU end)
    assert backend.stats().disk_blocks == 4
    assert store.get(NSID, BLOCK, chain[0]) is None
    store.backend.spill.get((NSID, chain[2]))          # 2 is now the disk's most recent
    time.sleep(0.01)
    # A new process over the same directory (kill -9: host memory is gone, the disk is not).
    again = Store(MemoryBackend(2 * BLOCK, DiskTier(spill_dir, 3 * per_file)))
    s = again.backend.spill.stats()
    assert s.blocks == 3 and s.bytes <= 3 * per_file   # the smaller bound evicted the oldest (3)
    assert again.get(NSID, BLOCK, chain[3]) is None
    for i in (2, 4, 5):
        assert again.get(NSID, BLOCK, chain[i])[0] == _data(i)


def test_a_corrupt_or_short_disk_file_is_a_miss_and_is_deleted(tmp_path):
    spill = DiskTier(str(tmp_path / "spill"), 1 << 30)
    chain = _chain(3)
    for i, h in enumerate(chain):
        spill.put((NSID, h), _data(i), checksum(_data(i)))
    short, flipped, wrong = (spill.path_for_test((NSID, h)) for h in chain)
    os.truncate(short, os.path.getsize(short) - 10)
    raw = bytearray(open(flipped, "rb").read())
    raw[100] ^= 1
    open(flipped, "wb").write(raw)
    shutil.copy(spill.path_for_test((NSID, chain[0])), wrong)   # another block's (valid) file
    restarted = DiskTier(str(tmp_path / "spill"), 1 << 30)
    for h, path in zip(chain, (short, flipped, wrong)):
        assert restarted.get((NSID, h)) is None
        assert not os.path.exists(path)
    assert restarted.stats().corrupt_blocks == 3 and restarted.stats().blocks == 0


def test_interrupted_disk_writes_leave_nothing_a_restart_would_read(tmp_path):
    spill = DiskTier(str(tmp_path / "spill"), 1 << 30)
    h = _chain(1)[0]
    spill.put((NSID, h), _data(0), checksum(_data(0)))
    leftover = spill.path_for_test((NSID, h)) + ".tmp-123-456"
    open(leftover, "wb").write(b"half a block")
    again = DiskTier(str(tmp_path / "spill"), 1 << 30)
    assert not os.path.exists(leftover)
    assert again.get((NSID, h))[0] == _data(0)


def test_redis_capacity_is_redis_maxmemory_with_lru_eviction(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.flushall()
    big = 256 << 10
    store = Store(RedisBackend(redis_url, 1 << 30))
    chain = _chain(8)
    blobs = [bytes([i]) * big for i in range(8)]
    for h, blob in zip(chain[:2], blobs):
        assert store.put(NSID, big, h, blob, checksum(blob)) == PutStatus.STORED
    # Room for these two and half a block more (used_memory also counts Redis' buffers).
    r.config_set("maxmemory", int(r.info("memory")["used_memory"]) + big // 2)
    try:
        time.sleep(1.1)                                # Redis' LRU clock ticks once a second
        assert store.get(NSID, big, chain[0])[0] == blobs[0]
        time.sleep(1.1)
        assert store.put(NSID, big, chain[2], blobs[2], checksum(blobs[2])) == PutStatus.STORED
        mem = r.info("memory")
        assert int(mem["used_memory"]) <= int(mem["maxmemory"])
        assert int(r.info("stats")["evicted_keys"]) >= 1
        assert store.get(NSID, big, chain[1]) is None           # least recently used: gone
        assert store.get(NSID, big, chain[0])[0] == blobs[0]    # read since: kept
        assert store.get(NSID, big, chain[2])[0] == blobs[2]
        for h, blob in zip(chain[3:], blobs[3:]):               # and the bound holds under load
            store.put(NSID, big, h, blob, checksum(blob))
            mem = r.info("memory")
            assert int(mem["used_memory"]) <= int(mem["maxmemory"])
        assert store.get(NSID, big, chain[7])[0] == blobs[7]
    finally:
        r.config_set("maxmemory", 0)


def test_an_unreachable_redis_is_a_miss_and_a_failed_put_not_an_error():
    port = _free_port()   # nothing listens there
    store = Store(RedisBackend(f"redis://127.0.0.1:{port}/0", 1 << 30, timeout_s=0.2))
    h = _chain(1)[0]
    assert _put(store, h, _data(0)) == PutStatus.FAILED
    assert store.get(NSID, BLOCK, h) is None and store.lookup(NSID, [h]) == 0


# ---- the namespace -----------------------------------------------------------------------------
@pytest.mark.parametrize("bad,field", [(dict(model_id=""), "model_id"), (dict(block_size=0), "block_size"),
                                       (dict(num_layers=0), "num_layers"), (dict(tp_size=0), "tp_size"),
                                       (dict(tp_size=2, tp_rank=2), "tp_rank"), (dict(block_bytes=0), "block_bytes")])
def test_a_namespace_that_cannot_name_comparable_bytes_is_refused(bad, field):
    with pytest.raises(NamespaceError, match=field):
        check_namespace(_ns(**bad))


def test_every_namespace_field_changes_the_namespace_id():
    base = namespace_id(NS)
    changed = [dict(model_id="x"), dict(weights_fingerprint="x"), dict(dtype="x"), dict(kv_cache_dtype="x"),
               dict(block_size=32), dict(num_layers=31), dict(tp_size=2), dict(tp_size=2, tp_rank=1),
               dict(block_bytes=BLOCK * 2), dict(layout="x")]
    ids = {namespace_id(_ns(**c)) for c in changed}
    assert base not in ids and len(ids) == len(changed)
    # No ambiguity by concatenation: ("ab", "c") vs ("a", "bc").
    assert namespace_id(_ns(model_id="ab", weights_fingerprint="c")) != namespace_id(_ns(model_id="a", weights_fingerprint="bc"))


# ---- the memory backend's arena: extents, pins, reserved slots ---------------------------------
def test_extents_reuse_an_exact_fit_first_and_coalesce_what_is_freed():
    a = ExtentAllocator(18 * ALIGN)
    x, y, z, w, v = (a.allocate(n * ALIGN) for n in (4, 4, 4, 2, 4))
    assert (x, y, z, w, v) == (0, 4 * ALIGN, 8 * ALIGN, 12 * ALIGN, 14 * ALIGN) and a.free_bytes == 0
    a.free(x, 4 * ALIGN)
    a.free(w, 2 * ALIGN)
    assert a.allocate(2 * ALIGN) == w                  # an exact fit, not a split of the first fit x
    assert a.allocate(2 * ALIGN) == x                  # else first fit, split ...
    assert a.free_extents() == [(x + 2 * ALIGN, 2 * ALIGN)]   # ... the rest stays free
    for off, n in ((x, 2), (y, 4), (z, 4), (w, 2), (v, 4)):
        a.free(off, n * ALIGN)
    assert a.free_extents() == [(0, 18 * ALIGN)] and a.free_bytes == 18 * ALIGN   # all merged back
    assert a.allocate(19 * ALIGN) is None and a.allocate(1) == 0                   # sizes round up
    with pytest.raises(ValueError):
        a.free(3, ALIGN)                                # not an extent it gave out


def test_extents_never_overlap_and_cover_the_region_under_random_traffic():
    rng = random.Random(7)
    a = ExtentAllocator(1 << 20)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and (rng.random() < 0.45 or a.free_bytes < 64 << 10):
            off = rng.choice(list(live))
            a.free(off, live.pop(off))
        else:
            size = rng.choice([ALIGN, 3 * ALIGN, 16 << 10, 40 << 10])
            off = a.allocate(size)
            if off is not None:
                live[off] = -(-size // ALIGN) * ALIGN
        spans = sorted([(o, s, "used") for o, s in live.items()] + [(o, s, "free") for o, s in a.free_extents()])
        end = 0
        for o, s, _ in spans:
            assert o == end, "a gap or an overlap"
            end = o + s
        assert end == a.capacity
        free = a.free_extents()
        assert all(o1 + s1 < o2 for (o1, s1), (o2, _) in zip(free, free[1:])), "adjacent free extents not merged"


def _pin(store: Store, hashes: list[bytes]) -> list:
    return store.pin(NSID, BLOCK, hashes)


def test_a_pinned_block_survives_eviction_pressure_and_is_evicted_after_release():
    backend = MemoryBackend(4 * BLOCK)
    store = Store(backend)
    chain = _chain(12)
    for i, h in enumerate(chain[:4]):
        _put(store, h, _data(i))
    pinned = _pin(store, [chain[0]])
    _put(store, chain[1], _data(1))                      # 0 is now the least recently used
    for i, h in enumerate(chain[4:10], 4):               # pressure: six more blocks
        assert _put(store, h, _data(i)) == PutStatus.STORED
    assert chain[0] in [k[1] for k in backend.keys()]    # pinned: never evicted
    assert bytes(backend.view(pinned[0])) == _data(0)    # and never overwritten
    assert backend.stats().bytes <= 4 * BLOCK
    store.release(NSID, [chain[0]], pinned, [])
    assert backend.stats().extra["pins"] == 0
    _put(store, chain[10], _data(10))
    assert chain[0] not in [k[1] for k in backend.keys()]   # released: evicted first (the LRU)
    # Every block pinned or reserved: no room, nothing evicted, the put is dropped.
    held = _pin(store, chain[7:11])
    assert _put(store, chain[11], _data(11)) == PutStatus.FAILED
    store.release(NSID, chain[7:11], held, [])
    assert _put(store, chain[11], _data(11)) == PutStatus.STORED


def test_a_block_removed_while_pinned_keeps_its_bytes_until_released():
    backend = MemoryBackend(2 * BLOCK)
    store = Store(backend)
    h = _chain(1)[0]
    _put(store, h, _data(3))
    pinned = _pin(store, [h])
    assert store.flush(NSID) == 1 and store.lookup(NSID, [h]) == 0
    other = _chain(2, seed=77)
    for i, o in enumerate(other):                        # the memory is full of others now
        _put(store, o, _data(10 + i))
    assert bytes(backend.view(pinned[0])) == _data(3)    # the reader's bytes are untouched
    assert backend.stats().extra["free_bytes"] == 0 and store.lookup(NSID, other[1:]) == 1
    store.release(NSID, [h], pinned, [])
    assert backend.stats().extra["free_bytes"] == BLOCK                      # its extent is free now
    assert _put(store, _chain(1, seed=99)[0], _data(5)) == PutStatus.STORED
    assert store.lookup(NSID, other[1:]) == 1 and backend.stats().evictions == 1   # no eviction for it


def test_reserved_slots_are_committed_only_with_the_right_crc32c():
    backend = MemoryBackend(4 * BLOCK)
    store = Store(backend)
    chain = _chain(3)
    _put(store, chain[0], _data(0))
    slots = store.reserve(NSID, BLOCK, chain)
    assert slots[0] is PutStatus.EXISTS and all(isinstance(x, Extent) for x in slots[1:])
    assert store.lookup(NSID, chain) == 1                # reserved is not visible
    for i in (1, 2):
        backend.view(slots[i])[:] = _data(i)
    claimed = [0, checksum(_data(1)), checksum(_data(2)) ^ 1]
    assert store.commit(NSID, BLOCK, chain, slots, claimed) == [PutStatus.EXISTS, PutStatus.STORED,
                                                                PutStatus.BAD_CHECKSUM]
    assert store.lookup(NSID, chain) == 2 and store.get(NSID, BLOCK, chain[1])[0] == _data(1)
    s = backend.stats()
    assert s.extra["reserved_bytes"] == 0 and s.extra["free_bytes"] == 4 * BLOCK - 2 * BLOCK   # refused: freed


def test_a_block_corrupted_in_place_is_removed_only_when_the_store_finds_it_corrupt_too():
    backend = MemoryBackend(4 * BLOCK)
    store = Store(backend)
    chain = _chain(3)
    for i, h in enumerate(chain):
        _put(store, h, _data(i))
    pinned = _pin(store, chain)
    backend.corrupt_for_test((NSID, chain[1]))
    seen = [checksum(backend.view(e)) == e.crc for e in pinned]   # what a reader checks
    assert seen == [True, False, True]
    # The reader reports 1 (truly corrupt) and 2 (a false report: kept).
    assert store.release(NSID, chain, pinned, [1, 2]) == 1
    assert backend.stats().corrupt_blocks == 1 and backend.stats().extra["pins"] == 0
    assert store.lookup(NSID, chain) == 1 and store.lookup(NSID, chain[2:]) == 1
    assert store.get(NSID, BLOCK, chain[1]) is None


def test_the_capacity_is_a_hard_bound_with_two_namespaces_of_different_block_sizes():
    small, big = BLOCK, 3 * BLOCK + 1000                  # the big one is not a multiple of ALIGN
    ns_small, ns_big = NSID, namespace_id(_ns(block_bytes=big))
    cap = 10 * BLOCK
    backend = MemoryBackend(cap)
    store = Store(backend)
    rng = random.Random(3)
    stored: dict[tuple[bytes, bytes], bytes] = {}
    for i in range(120):
        ns, size = (ns_big, big) if rng.random() < 0.4 else (ns_small, small)
        h = i.to_bytes(4, "little") * 8
        data = bytes([i % 251]) * size
        status = store.put(ns, size, h, data, checksum(data))
        assert status in (PutStatus.STORED, PutStatus.FAILED)
        if status is PutStatus.STORED:
            stored[(ns, h)] = data
        s = backend.stats()
        assert s.bytes + s.extra["reserved_bytes"] <= cap and backend.arena.size == 4096 + cap // ALIGN * ALIGN
        if i % 20 == 0:
            held = _pin(store, [h])                       # a reader in the middle of the traffic
            store.release(ns, [h], held, [])
    kept = backend.keys()
    assert {k[0] for k in kept} == {ns_small, ns_big}
    for ns, h in kept:                                    # every kept block is intact
        size = big if ns == ns_big else small
        assert store.get(ns, size, h)[0] == stored[(ns, h)]


def test_evicted_arena_blocks_spill_to_disk_and_a_restart_finds_them(tmp_path):
    spill_dir = str(tmp_path / "spill")
    per_file = record.record_size(b"x" * 32, BLOCK)
    store = Store(MemoryBackend(2 * BLOCK, DiskTier(spill_dir, 16 * per_file)))
    chain = _chain(6)
    for i in range(0, 6, 2):                             # three puts: each evicts the one before
        store.put_batch(NSID, BLOCK, [(h, _data(j), checksum(_data(j))) for j, h in enumerate(chain[i:i + 2], i)])
    pinned = _pin(store, chain[:1])                      # read through from disk into the arena
    assert pinned[0] is not None and bytes(store.backend.view(pinned[0])) == _data(0)
    store.release(NSID, chain[:1], pinned, [])
    store.backend.close()                                # kill -9 would lose only what is in memory
    again = Store(MemoryBackend(2 * BLOCK, DiskTier(spill_dir, 16 * per_file)))
    assert again.lookup(NSID, chain) == 6
    assert [again.get(NSID, BLOCK, h)[0] for h in chain] == [_data(i) for i in range(6)]

"""The kvstore client the engines use (docs/kvstore.md): Lookup, Put and Get of whole KV blocks
over the fastest data plane it can reach, and never an exception into the caller's hot path.

    kv = KvClient("127.0.0.1:50070", credentials=tls.channel_credentials())
    n = kv.lookup(ns, chain)                    # longest stored prefix of a hash chain
    kv.put(ns, [(block_hash, buf), ...])        # buf: any C-contiguous bytes-like object
    found = kv.get_into(ns, hashes, [dst, ...]) # copies into writable buffers; [True/False]
    # zero copy (None: no arena mapped here, use put / get_into):
    found = kv.read_zero_copy(ns, hashes, consume)   # consume(start, views): copy them out
    kept = kv.write_zero_copy(ns, hashes, fill)      # fill(start, idx, views): write into them
    # ... the caller checksums (e.g. on its GPU, where the bytes land / come from):
    found = kv.read_zero_copy(ns, hashes, consume, consumer_verifies=True)  # consume(start, views, crcs) -> [ok]
    kept = kv.write_zero_copy(ns, hashes, fill)      # fill answers Filled(crcs, wait)
    kv.set_arena_hooks(on_map, on_unmap)             # e.g. cudaHostRegister the mapping

Planes, fastest first: the memory backend's block memory mapped here (same host: blocks are read
and written in place, zero copy: Pin/Release, Reserve/Commit; kv_shm.py), the same block memory
over NIXL when it cannot be mapped here (another host or container: the same Pin / Reserve, the
bytes moved by NIXL READ / WRITE through a registered staging buffer; kv_nixl.py), a leased
shared-memory window (same host, a backend that keeps nothing itself: Redis), gRPC bytes (any
host). `data_plane` forces one (a forced plane that is not there gives gRPC bytes).

This module is the façade: the API, its metrics (kv_metrics.py) and the window / gRPC bytes
paths. The channel, availability and the plane leased on the store are kv_link.py's; the chunked
zero-copy reads and writes (pins ahead, commits in flight, NIXL staging) are kv_transfers.py's.

Every call has a deadline; a kvstore that is down, slow, restarted or full gives misses and
dropped saves. A lost kvstore is logged once (and again when it is back), and calls made while
it is lost return at once (a miss) until the next retry time: no per-call timeouts pile up.
Thread-safe: zero-copy transfers of many threads run at once; a window carries one at a time."""
from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.common import kv_blocks
from services.common.kv_blocks import checksum, copy_and_checksum, encode_put_request, kv_pb2
from services.common.kv_link import KEEP_LOST_ARENA_S, NIXL_RETRY_S, KvLink  # noqa: F401 - re-exported
from services.common.kv_metrics import (AVAILABLE, BYTES, DROPPED, GBPS, HITS, MISSES, SAVED,  # noqa: F401
                                        SECONDS, TIER)
from services.common.kv_shm import Window
from services.common.kv_transfers import KEPT, ConsumeFailed, Filled, ZeroCopyTransfers, map_blocks  # noqa: F401

Block = tuple[bytes, object]   # (block hash, bytes-like of namespace.block_bytes bytes)
Consume = Callable[[int, list], None]              # consume(start, views): views[i] is block start+i
Fill = Callable[[int, list, list], object]         # fill(start, idx, views): views[k] is block idx[k]
DATA_PLANES = ("auto", "zero_copy", "nixl", "shm", "grpc")
WRITE_CHUNK_BYTES = 256 << 20   # the default Reserve chunk (at most chunk_bytes)


def _nbytes(buf) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class KvClient:
    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None = None, *,
                 use_shm: bool = True, window_bytes: int = 64 << 20, timeout_s: float = 1.0,
                 lookup_timeout_s: float = 0.25, min_gbps: float = 0.2, retry_after_s: float = 0.5,
                 max_retry_after_s: float = 5.0, copy_threads: int | None = None,
                 chunk_bytes: int = 512 << 20, data_plane: str = "auto", nixl_buffer_bytes: int = 128 << 20,
                 write_chunk_bytes: int | None = None, first_write_bytes: int = 0,
                 last_write_bytes: int = 0) -> None:
        if data_plane not in DATA_PLANES:
            raise ValueError(f"data_plane must be one of {DATA_PLANES}, got {data_plane!r}")
        self.address = address
        # The planes this client may use: "auto" all of them, fastest first; one named, only it
        # (else gRPC bytes); use_shm=False is "grpc".
        self.data_plane = data_plane if use_shm else "grpc"
        self.use_shm = self.data_plane != "grpc"
        self.window_bytes = window_bytes
        self.chunk_bytes = chunk_bytes      # bytes per zero-copy Pin call, and the most per Reserve
        self.timeout_s = timeout_s
        self.lookup_timeout_s = lookup_timeout_s
        self.min_gbps = min_gbps
        # NIXL staging slots hold one chunk each, and at least the largest block.
        nixl_slot_bytes = max(kv_blocks.MAX_BLOCK_BYTES, min(chunk_bytes, nixl_buffer_bytes // 2))
        self._link = KvLink(address, credentials, data_plane=self.data_plane, window_bytes=window_bytes,
                            timeout_s=timeout_s, lookup_timeout_s=lookup_timeout_s, min_gbps=min_gbps,
                            retry_after_s=retry_after_s, max_retry_after_s=max_retry_after_s,
                            nixl_slot_bytes=nixl_slot_bytes,
                            nixl_slots=max(1, min(8, nixl_buffer_bytes // nixl_slot_bytes)))
        # The blocks of one call are copied and checksummed on several threads (numpy's copy and
        # crc32c release the GIL); a zero-copy write's commits run beside the next chunk's fill.
        self._copies = ThreadPoolExecutor(copy_threads or min(8, os.cpu_count() or 1),
                                          thread_name_prefix="kv-client-copy")
        # Chunks: a Pin of chunk_bytes (a round trip per chunk: fewer, larger ones keep the copies
        # busy), a Reserve of write_chunk_bytes (default: up to 256 MiB: a Reserve's round trip
        # costs about what 128 MiB of DMA does, and the next one overlaps this one's copies), a
        # save's first one of first_write_bytes (0: a whole chunk; a smaller first one let the
        # store start its check sooner when Commit waited for it), its last ones halving down to
        # last_write_bytes (0: no taper; the commit after the last copy is the save's exposed
        # round trip); measured in bench/gpu_kv_tiers.py.
        write = write_chunk_bytes if write_chunk_bytes else min(chunk_bytes, WRITE_CHUNK_BYTES)
        self._zero_copy = ZeroCopyTransfers(self._link, self._copies, write, read_chunk_bytes=chunk_bytes,
                                            first_write_bytes=first_write_bytes,
                                            last_write_bytes=last_write_bytes)

    # ---- the API ----------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return self._link.available

    @property
    def transport(self) -> str:
        """What the next transfer would use: "arena" (zero copy), "nixl", "shm" (a window) or "grpc"."""
        return self._link.transport

    def set_arena_hooks(self, on_map: Callable[[mmap.mmap], None] | None,
                        on_unmap: Callable[[mmap.mmap], None] | None) -> None:
        """on_map(mm) runs once for each arena this client maps, before any view of it is handed
        out (at once here for one mapped already); on_unmap(mm) before it is unmapped (the store
        lost for good or replaced by a restarted one, or close()). On whichever thread maps."""
        self._link.set_arena_hooks(on_map, on_unmap)

    def lookup(self, ns: "kv_pb2.KvNamespace", block_hashes: Sequence[bytes]) -> int:
        """How many blocks of the chain, from the first, the kvstore holds (0 when unreachable)."""
        if not block_hashes or self._link.skip():
            return 0
        resp = self._link.call(self._link.stub.Lookup, kv_pb2.LookupRequest(
            namespace=ns, block_hashes=list(block_hashes[:kv_blocks.MAX_LOOKUP_HASHES])), self.lookup_timeout_s)
        return resp.num_found if resp is not None else 0

    def put(self, ns: "kv_pb2.KvNamespace", blocks: Sequence[Block]) -> int:
        """Save blocks; the number the kvstore now holds (stored or already there). Blocks it
        refuses or cannot take are dropped and counted."""
        if not blocks:
            return 0
        if self._link.skip():
            DROPPED.labels(TIER).inc(len(blocks))
            return 0
        start = time.perf_counter()
        views = [(h, _nbytes(buf)) for h, buf in blocks]
        if all(len(v) == ns.block_bytes for _, v in views):
            def fill(_: int, idx: list[int], slots: list) -> list[int]:
                return self._map(lambda k: copy_and_checksum(slots[k], views[idx[k]][1]), len(idx))
            kept = self._zero_copy.write(ns, [h for h, _ in views], fill)
            if kept is not None:
                return self._saved(ns, len(blocks), kept, start)
        window = self._link.get_window()
        per_call = (window.size if window is not None else kv_blocks.GRPC_PAYLOAD_BYTES) // max(1, ns.block_bytes)
        step = max(1, min(per_call, kv_blocks.MAX_BLOCKS_PER_CALL))
        kept = 0
        for i in range(0, len(views), step):
            kept += self._put_chunk(ns, views[i:i + step], window)
            if self._link.skip():
                break
        return self._saved(ns, len(blocks), kept, start)

    def write_zero_copy(self, ns: "kv_pb2.KvNamespace", block_hashes: Sequence[bytes], fill: Fill) -> int | None:
        """Save blocks by writing them straight into the store's memory: None when no arena is
        mapped here (use put). Otherwise slots are reserved for the blocks the store does not
        hold, `fill(start, idx, views)` writes block `idx[k]` (an index into block_hashes) into
        the writable memoryview `views[k]` (e.g. a GPU->host DMA) and returns once the bytes are
        there; the client checksums the slots and commits them. Or fill answers a Filled: the
        slots' CRC-32Cs, computed by the caller from its own bytes (the store still checks
        them against what landed), and a wait for its copies, which the commit runs first (the
        fill only started them). Chunked (each chunk's commit overlaps the next chunk's fill).
        Returns the blocks the store now holds (stored or already there); a fill that raises
        drops its chunk and the rest. Never raises."""
        if not block_hashes:
            return 0
        if self._link.skip():
            DROPPED.labels(TIER).inc(len(block_hashes))
            return 0
        start = time.perf_counter()

        def fill_then_checksum(first: int, idx: list[int], slots: list) -> Filled | None:
            out = fill(first, idx, slots)
            return out if isinstance(out, Filled) else None   # None: the commit checksums the slots

        kept = self._zero_copy.write(ns, list(block_hashes), fill_then_checksum, mapped_only=True)
        return None if kept is None else self._saved(ns, len(block_hashes), kept, start)

    def _saved(self, ns, offered: int, kept: int, start: float) -> int:
        DROPPED.labels(TIER).inc(offered - kept)
        SAVED.labels(TIER).inc(kept)
        self._timed("save", kept * ns.block_bytes, start)
        return kept

    def _put_chunk(self, ns, chunk, window: Window | None) -> int:
        nbytes = sum(len(v) for _, v in chunk)
        if window is not None and nbytes <= window.size:
            with window.lock:
                if self._link.window is window:   # not dropped meanwhile
                    offsets = [0]
                    for _, v in chunk[:-1]:
                        offsets.append(offsets[-1] + len(v))
                    crcs = self._map(lambda j: copy_and_checksum(
                        window.view[offsets[j]:offsets[j] + len(chunk[j][1])], chunk[j][1]), len(chunk))
                    metas = [kv_pb2.KvBlock(meta=kv_pb2.KvBlockMeta(block_hash=h, size=len(v), checksum=crc, offset=off))
                             for (h, v), crc, off in zip(chunk, crcs, offsets)]
                    req = kv_pb2.PutRequest(namespace=ns, blocks=metas, window=window.lease)
                    resp = self._link.call(self._link.stub.Put, req, self._link.deadline(nbytes))
                    if resp is not None or not self.available:
                        return _kept(resp)
        crcs = self._map(lambda j: checksum(chunk[j][1]), len(chunk))
        raw = encode_put_request(ns, [(kv_pb2.KvBlockMeta(block_hash=h, size=len(v), checksum=crc), v)
                                      for (h, v), crc in zip(chunk, crcs)])
        return _kept(self._link.call(self._link.put_raw, raw, self._link.deadline(nbytes)))

    def get(self, ns: "kv_pb2.KvNamespace", block_hashes: Sequence[bytes]) -> list[bytes | None]:
        """Each block's bytes, or None for a miss."""
        out: list[bytes | None] = [None] * len(block_hashes)
        dests = [bytearray(ns.block_bytes) for _ in block_hashes]
        for i, ok in enumerate(self.get_into(ns, block_hashes, dests)):
            if ok:
                out[i] = bytes(dests[i])
        return out

    def get_into(self, ns: "kv_pb2.KvNamespace", block_hashes: Sequence[bytes], dests: Sequence[object]) -> list[bool]:
        """Copy each found block into its writable buffer (namespace.block_bytes bytes, e.g. a
        pinned host tensor viewed as uint8); True where it was loaded and verified."""
        if len(dests) != len(block_hashes):
            raise ValueError("get_into needs one destination per block hash")
        if not block_hashes:
            return []
        if self._link.skip():
            MISSES.labels(TIER).inc(len(block_hashes))
            return [False] * len(block_hashes)
        start = time.perf_counter()
        outs = [_nbytes(d) for d in dests]

        def copy_out(first: int, views: list, metas: list) -> list[bool | None]:
            # The copy is verified where it landed: the end-to-end check on the caller's bytes.
            def one(j: int) -> bool | None:
                out = outs[first + j]
                if views[j] is None or len(out) != len(views[j]):
                    return None
                return copy_and_checksum(out, views[j]) == metas[j].checksum
            return self._map(one, len(views))

        found = self._zero_copy.read(ns, list(block_hashes), copy_out)
        if found is None:
            found = [False] * len(block_hashes)
            window = self._link.get_window()
            room = window.size if window is not None else kv_blocks.GRPC_PAYLOAD_BYTES
            step = max(1, min(room // max(1, ns.block_bytes), kv_blocks.MAX_BLOCKS_PER_CALL))
            for i in range(0, len(block_hashes), step):
                self._get_chunk(ns, block_hashes[i:i + step], dests[i:i + step], found, i, window)
                if self._link.skip():
                    break
        return self._loaded(ns, found, start)

    def read_zero_copy(self, ns: "kv_pb2.KvNamespace", block_hashes: Sequence[bytes],
                       consume: Consume, consumer_verifies: bool = False) -> list[bool] | None:
        """Load blocks straight out of the store's memory: None when no arena is mapped here
        (use get_into). Otherwise the found blocks are pinned and `consume(start, views)` is
        called on this thread, chunk by chunk (a chunk where nothing was found is skipped):
        views[i] is a read-only memoryview of block start+i inside the mapped arena, or None for
        a miss; consume copies them out (e.g. GPU DMAs) and returns once the copies are
        complete, keeping no view; returning False ends the load after this chunk (the later
        blocks are misses, never pinned). Meanwhile the client
        verifies every view's CRC-32C on its pool; then the blocks are unpinned (the corrupt
        ones reported to the store). True where the block was found and verified; a consume
        that raises makes its chunk misses and ends the load. Never raises.

        consumer_verifies: consume(start, views, checksums) verifies the bytes itself, where they
        landed (checksums[i]: block start+i's stored CRC-32C, None for a miss), and answers
        [True / False (corrupt: reported to the store) / None (not copied)] per view; no CPU
        thread of the client reads the blocks, and the load ends after a chunk that was not
        all copied and verified."""
        if not block_hashes:
            return []
        if self._link.skip():
            MISSES.labels(TIER).inc(len(block_hashes))
            return [False] * len(block_hashes)
        start = time.perf_counter()

        def verify_beside(first: int, views: list, metas: list) -> list[bool | None]:
            crcs = [self._copies.submit(checksum, v) if v is not None else None for v in views]
            try:
                if consume(first, views) is False:
                    stop[0] = True
            except Exception as exc:  # noqa: BLE001 - the caller's copy failed: misses, reported once
                self._link.log_once(f"kvstore load: consume failed ({type(exc).__name__}: {str(exc)[:120]})")
                for f in crcs:
                    if f is not None:
                        f.result()
                raise ConsumeFailed() from None
            return [None if f is None else f.result() == m.checksum for f, m in zip(crcs, metas)]

        def verified_by_consumer(first: int, views: list, metas: list) -> list[bool | None]:
            try:
                got = list(consume(first, views, [m.checksum if v is not None else None
                                                  for v, m in zip(views, metas)]))
            except Exception as exc:  # noqa: BLE001 - the caller's copy failed: misses, reported once
                self._link.log_once(f"kvstore load: consume failed ({type(exc).__name__}: {str(exc)[:120]})")
                raise ConsumeFailed() from None
            got = [v if v in (True, False) else None for v in got[:len(views)]] + [None] * (len(views) - len(got))
            if not all(got):
                stop[0] = True
            return got

        stop = [False]
        found = self._zero_copy.read(ns, list(block_hashes), verified_by_consumer if consumer_verifies else verify_beside,
                                     stop, mapped_only=True)
        return None if found is None else self._loaded(ns, found, start)

    def _loaded(self, ns, found: list[bool], start: float) -> list[bool]:
        hits = sum(found)
        HITS.labels(TIER).inc(hits)
        MISSES.labels(TIER).inc(len(found) - hits)
        self._timed("load", hits * ns.block_bytes, start)
        return found

    def _get_chunk(self, ns, hashes, dests, found: list[bool], base: int, window: Window | None) -> None:
        nbytes = len(hashes) * ns.block_bytes
        if window is not None and nbytes <= window.size:
            with window.lock:
                if self._link.window is window:
                    req = kv_pb2.GetRequest(namespace=ns, block_hashes=list(hashes), window=window.lease)
                    resp = self._link.call(self._link.stub.Get, req, self._link.deadline(nbytes))
                    if resp is not None:
                        def fill(j: int) -> bool:
                            m = resp.blocks[j]
                            return bool(m.meta.block_hash) and m.meta.offset + m.meta.size <= window.size and _fill(
                                dests[j], window.view[m.meta.offset:m.meta.offset + m.meta.size], m.meta, ns)
                        for j, ok in enumerate(self._map(fill, len(resp.blocks))):
                            found[base + j] = ok
                        return
                    if not self.available:
                        return
        resp = self._link.call(self._link.stub.Get, kv_pb2.GetRequest(namespace=ns, block_hashes=list(hashes)),
                          self._link.deadline(nbytes))
        if resp is not None:
            def fill_bytes(j: int) -> bool:
                b = resp.blocks[j]
                return bool(b.meta.block_hash) and _fill(dests[j], b.data, b.meta, ns)
            for j, ok in enumerate(self._map(fill_bytes, len(resp.blocks))):
                found[base + j] = ok

    def _map(self, fn, n: int) -> list:
        return map_blocks(self._copies, fn, n)

    def _timed(self, direction: str, nbytes: int, start: float) -> None:
        dt = time.perf_counter() - start
        SECONDS.labels(TIER, direction).observe(dt)
        if nbytes:
            BYTES.labels(TIER, direction).inc(nbytes)
            GBPS.labels(TIER, direction).set(nbytes / dt / 1e9 if dt > 0 else 0.0)

    @property
    def transfer_stats(self) -> dict[str, float]:
        """Seconds per zero-copy stage, summed since this client began (benchmarks)."""
        return dict(self._zero_copy.stats)

    def stats(self) -> "kv_pb2.StatsResponse | None":
        if self._link.skip():
            return None
        return self._link.call(self._link.stub.Stats, kv_pb2.StatsRequest(), self.timeout_s)

    def flush(self, ns: "kv_pb2.KvNamespace | None" = None) -> int | None:
        """Remove a namespace's blocks (None: all of them); the number removed, None if unreachable."""
        req = kv_pb2.FlushRequest(namespace=ns) if ns is not None else kv_pb2.FlushRequest(all_namespaces=True)
        resp = self._link.call(self._link.stub.Flush, req, self.timeout_s * 5)
        return resp.blocks_removed if resp is not None else None

    def close(self) -> None:
        self._link.close()
        self._copies.shutdown(wait=False)
        self._zero_copy.close()


def _kept(resp: "kv_pb2.PutResponse | None") -> int:
    if resp is None:
        return 0
    return sum(1 for s in resp.statuses if s in KEPT)


def _fill(dest, src, meta: "kv_pb2.KvBlockMeta", ns: "kv_pb2.KvNamespace") -> bool:
    """Copy a block into its destination and verify what landed there (the end-to-end check)."""
    out = _nbytes(dest)
    if meta.size != ns.block_bytes or len(src) != ns.block_bytes or len(out) != ns.block_bytes:
        return False
    return copy_and_checksum(out, src) == meta.checksum

"""The kvstore client's chunked zero-copy transfers (docs/kvstore.md): reads (Pin -> the caller's
handle over the pinned views -> Release) and writes (Reserve -> fill -> checksum -> Commit),
chunk by chunk, over the store's block memory mapped here or reached over NIXL through a staging
slot. KvClient (kv_client.py) wraps them with its metrics; the lease they run under is KvLink's
(kv_link.py).

    transfers = ZeroCopyTransfers(link, copies, chunk_bytes)
    found = transfers.read(ns, hashes, handle)   # handle(start, views, metas) -> [verified or None]
    kept = transfers.write(ns, hashes, fill)     # fill(start, idx, slots) -> Filled, checksums or None

Pipelined so the store's round trips overlap the copies: a read pins chunk k+1 on a helper thread
while chunk k is handled, and releases chunk k in the background; a write commits chunk k (at most
COMMITS_IN_FLIGHT at once) while chunk k+1 is reserved and filled. A fill may only start its
copies and answer a Filled (its own checksums, and a wait for the copies): the commit thread then
waits, so the next chunk's Reserve overlaps this chunk's copies. Both answer None when there is
no arena here (the caller falls back to a window or gRPC bytes), and never raise. `stats` sums
the seconds of each stage (bench/gpu_kv_tiers.py reports them)."""
from __future__ import annotations

import collections
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from services.common import kv_blocks
from services.common.kv_blocks import checksum, kv_pb2
from services.common.kv_link import LEASE_REFUSED, KvLink
from services.common.kv_nixl import DONE, FAILED, NixlRemote
from services.common.kv_shm import ArenaMapping, release_view

COMMITS_IN_FLIGHT = 3   # a save's chunks k-2..k copied, checksummed and committed while k+1 is filled
_RESERVED = kv_pb2.KV_PUT_STATUS_RESERVED
KEPT = (kv_pb2.KV_PUT_STATUS_STORED, kv_pb2.KV_PUT_STATUS_EXISTS)


@dataclass
class Filled:
    """What a fill may answer: the CRC-32C of each slot's bytes, computed by the filler from
    its own copy of them (the store checks them against what landed on Commit), or a callable
    that returns them (called on the commit thread, after `wait()`: a device checksum still
    running need not hold up the next chunk's Reserve), and `wait()`, which returns once the
    bytes are in the slots (None: they are already) and raises if the copies failed (the chunk
    is then dropped)."""
    checksums: list[int] | Callable[[], list[int]]
    wait: Callable[[], None] | None = None


def _resolved(crcs, n: int) -> list[int]:
    """A fill's checksums as a list of n (a callable is called); ValueError if not n of them."""
    out = list(crcs() if callable(crcs) else crcs)
    if len(out) != n:
        raise ValueError(f"{len(out)} checksums for {n} slots")
    return out


class ConsumeFailed(Exception):
    """The caller's consume raised (already logged): its chunk is a miss and the load ends."""


def map_blocks(pool: ThreadPoolExecutor, fn, n: int) -> list:
    """[fn(0), ..., fn(n - 1)], on the pool when more than one (numpy's copy and crc32c release
    the GIL: the blocks of one call are copied and checksummed on several threads)."""
    if n == 0:
        return []
    return [fn(0)] if n == 1 else list(pool.map(fn, range(n)))


class ZeroCopyTransfers:
    def __init__(self, link: KvLink, copies: ThreadPoolExecutor, chunk_bytes: int, read_chunk_bytes: int = 0,
                 first_write_bytes: int = 0, last_write_bytes: int = 0) -> None:
        self._link = link
        self._copies = copies
        self.chunk_bytes = chunk_bytes      # bytes per zero-copy Reserve call (at most)
        self.read_chunk_bytes = read_chunk_bytes or chunk_bytes   # ... per Pin call
        # A write's first chunk (0: chunk_bytes), then twice the last up to chunk_bytes: the
        # store's check of the first commit starts sooner (it is what a save waits for).
        self.first_write_bytes = first_write_bytes
        # ... and its last chunks halve down to last_write_bytes (0: no taper): the commit that
        # follows the last copy (a save's exposed round trip) covers few blocks.
        self.last_write_bytes = last_write_bytes
        # A write's commits run beside the next chunk's fill; a read's pins ahead and releases.
        self.commits_in_flight = COMMITS_IN_FLIGHT
        self._commits = ThreadPoolExecutor(2 * COMMITS_IN_FLIGHT, thread_name_prefix="kv-client-commit")
        self._rpcs = ThreadPoolExecutor(2, thread_name_prefix="kv-client-rpc")
        self.stats = collections.Counter()   # seconds per stage, summed over calls (benchmarks)

    def _timed(self, key: str, t0: float) -> None:
        self.stats[key] += time.perf_counter() - t0

    def _map(self, fn, n: int) -> list:
        return map_blocks(self._copies, fn, n)

    def _step(self, ns, arena=None, chunk_bytes: int = 0) -> int:
        """Blocks per Pin / Reserve: a chunk; over NIXL also what one staging slot holds."""
        room = chunk_bytes or self.chunk_bytes
        if isinstance(arena, NixlRemote):
            room = min(room, arena.plane.slot_bytes)
        return max(1, min(kv_blocks.MAX_BLOCKS_PER_CALL, room // max(1, ns.block_bytes)))

    def _write_spans(self, ns, n: int, arena) -> list[tuple[int, int]]:
        """(first block, count) of each Reserve: from first_write_bytes doubling up to a chunk,
        then (last_write_bytes) halving down to it at the end. Head and tail grow alternately,
        the smaller first, so a short write tapers at both ends too."""
        step = self._step(ns, arena)

        def blocks(nbytes: int) -> int:
            return max(1, min(step, nbytes // max(1, ns.block_bytes))) if nbytes else step
        head, tail, front, back, left = blocks(self.first_write_bytes), blocks(self.last_write_bytes), [], [], n
        while left > 0:
            if not self.last_write_bytes or head <= tail:
                front.append(min(head, left))
                head, left = min(step, head * 2), left - front[-1]
            else:
                back.append(min(tail, left))
                tail, left = min(step, tail * 2), left - back[-1]
        spans, i = [], 0
        for size in front + back[::-1]:
            spans.append((i, size))
            i += size
        return spans

    def write(self, ns, hashes: list[bytes], fill, mapped_only: bool = False) -> int | None:
        """Reserve, fill, checksum and commit, chunk by chunk, the commit of chunk k on a
        helper thread while chunk k+1 is reserved and filled. None: no arena here."""
        return self._link.leased(lambda arena, lease: self._write_chunks(ns, hashes, fill, arena, lease), mapped_only)

    def _write_chunks(self, ns, hashes: list[bytes], fill, arena: ArenaMapping | NixlRemote, lease: int):
        """Mapped here, `fill` writes into the reserved slots themselves; over NIXL into a staging
        slot, which one NIXL WRITE then puts into the reserved slots before the commit."""
        kept, pending = 0, collections.deque()   # commits in flight, at most COMMITS_IN_FLIGHT
        nixl = isinstance(arena, NixlRemote)
        bb = ns.block_bytes
        try:
            for i, count in self._write_spans(ns, len(hashes), arena):
                chunk = hashes[i:i + count]
                t0 = time.perf_counter()
                resp = self._link.call(self._link.stub.Reserve, kv_pb2.ReserveRequest(
                    namespace=ns, block_hashes=chunk, lease=kv_pb2.ShmWindow(lease_id=lease)),
                    self._link.deadline(0))
                self._timed("write_reserve_s", t0)
                if resp is None:
                    if i == 0 and self._link.refused_lease(lease):
                        return LEASE_REFUSED
                    break
                reserved_at = time.monotonic()
                staged = arena.plane.stage(reserved_at + self._link.timeout_s) if nixl and resp.reserve_id else None
                idx, slots, offsets = [], [], []
                for j, slot in enumerate(resp.slots[:len(chunk)]):
                    view = None
                    if slot.status == _RESERVED:
                        if not nixl:
                            view = arena.slot(slot.offset, bb)
                        elif staged is not None and arena.valid(slot.offset, bb):
                            view = staged.block(len(slots), bb)
                            offsets.append(slot.offset)
                    if view is not None:
                        idx.append(i + j)
                        slots.append(view)
                    elif slot.status == kv_pb2.KV_PUT_STATUS_EXISTS:
                        kept += 1
                crcs, wait, failed = None, None, False
                if slots and len(resp.slots) == len(chunk) and len(slots) == sum(
                        s.status == _RESERVED for s in resp.slots):
                    t0 = time.perf_counter()
                    try:
                        crcs = fill(i, idx, slots)
                        if isinstance(crcs, Filled):
                            crcs, wait = crcs.checksums, crcs.wait
                            if nixl and wait is not None:
                                wait()     # in the staging slot before the NIXL WRITE
                                wait = None
                            if nixl or not callable(crcs):   # else the commit thread calls it
                                crcs = _resolved(crcs, len(slots))
                    except Exception as exc:  # noqa: BLE001 - a failed fill is a dropped save
                        self._link.log_once(f"kvstore save: filling the reserved slots failed ({type(exc).__name__}: "
                                       f"{str(exc)[:120]})")
                        failed = True
                    self._timed("write_fill_s", t0)
                elif resp.reserve_id:
                    failed = True             # a store answer we cannot use: give the slots back
                if staged is not None:
                    outcome = DONE
                    if not failed:
                        if crcs is None:      # computed before the staging slot is reused
                            crcs = self._map(lambda k: checksum(slots[k]), len(slots))
                        outcome = arena.transfer("WRITE", staged, list(enumerate(offsets)), bb,
                                                 time.monotonic() + self._link.deadline(len(slots) * bb))
                    staged.release()
                    if outcome != DONE:
                        self._link.nixl_failed(arena, outcome)
                        if outcome != FAILED:
                            break             # it may still land: no commit, no abort (the slots expire)
                        failed = True
                t0 = time.perf_counter()
                while len(pending) >= self.commits_in_flight:
                    kept += pending.popleft().result()
                self._timed("write_commit_wait_s", t0)
                if resp.reserve_id:
                    pending.append(self._commits.submit(self._commit, lease, resp.reserve_id, slots, crcs, failed,
                                                        reserved_at, wait))
                if failed:
                    break
        finally:
            t0 = time.perf_counter()
            while pending:
                kept += pending.popleft().result()
            self._timed("write_commit_wait_s", t0)
        return kept

    def _commit(self, lease: int, reserve_id: int, slots: list, crcs, abort: bool, reserved_at: float,
                wait=None) -> int:
        """The store checks the slots against our checksums and keeps the good ones; how many.
        `wait`: the fill's copies, finished first, even for an abort (no copy may still write a
        slot given back); a failed one aborts the reservation."""
        try:
            if wait is not None:
                t0 = time.perf_counter()
                try:
                    wait()
                except Exception as exc:  # noqa: BLE001 - the copies failed: the slots go back
                    self._link.log_once(f"kvstore save: the copies into the slots failed ({type(exc).__name__})")
                    abort = True
                self._timed("write_copy_wait_s", t0)
            if not abort and crcs is None:
                t0 = time.perf_counter()
                crcs = self._map(lambda k: checksum(slots[k]), len(slots))
                self._timed("write_checksum_s", t0)
            elif not abort and callable(crcs):
                t0 = time.perf_counter()
                try:
                    crcs = _resolved(crcs, len(slots))
                except Exception as exc:  # noqa: BLE001 - no checksums: the slots go back
                    self._link.log_once(f"kvstore save: the fill's checksums failed ({type(exc).__name__}: "
                                        f"{str(exc)[:120]})")
                    abort = True
                self._timed("write_crc_wait_s", t0)
            # Slots held past half the lease's life may have been taken back: never claim them.
            abort = abort or time.monotonic() - reserved_at > self._link.lease_ttl_s / 2
            t0 = time.perf_counter()
            resp = self._link.call(self._link.stub.Commit, kv_pb2.CommitRequest(
                lease=kv_pb2.ShmWindow(lease_id=lease), reserve_id=reserve_id,
                checksums=[] if abort else list(crcs), abort=abort),
                self._link.deadline(len(slots) * (len(slots[0]) if slots else 0)))
            self._timed("write_commit_rpc_s", t0)
            return 0 if resp is None else sum(s in KEPT for s in resp.statuses)
        except Exception as exc:  # noqa: BLE001 - never into the caller
            self._link.log_once(f"kvstore commit failed ({type(exc).__name__})")
            return 0
        finally:
            for v in slots:
                release_view(v)


    def read(self, ns, hashes: list[bytes], handle, stop=(False,), mapped_only: bool = False) -> list[bool] | None:
        """Pin, hand the views to `handle(start, views, metas) -> [verified or None]`, release,
        chunk by chunk (until stop[0] is set). None: no arena here."""
        return self._link.leased(lambda arena, lease: self._read_chunks(ns, hashes, handle, arena, lease, stop),
                                 mapped_only)

    def _read_chunks(self, ns, hashes: list[bytes], handle, arena: ArenaMapping | NixlRemote, lease: int, stop):
        """Chunk k+1 is pinned (on a helper thread) while chunk k is consumed and verified, and
        chunk k is released in the background: the store's round trips overlap the copies."""
        found = [False] * len(hashes)
        step = self._step(ns, arena, self.read_chunk_bytes)
        starts = list(range(0, len(hashes), step))
        if not starts:
            return found

        def pin(i: int):
            return self._pin_chunk(ns, hashes[i:i + step], lease)
        ahead = self._rpcs.submit(pin, starts[0])
        releases = []
        try:
            for k, i in enumerate(starts):
                t0 = time.perf_counter()
                pinned, ahead = ahead.result(), None
                self._timed("read_pin_wait_s", t0)
                if pinned is not None and k and not all(m.block_hash for m in pinned[0].blocks):
                    # Pinned ahead with the previous chunk still held, a block on disk may have
                    # found no room in memory: once that chunk is given back, pin it again.
                    if pinned[0].read_id:
                        self._release_read(ns, lease, pinned[0].read_id, [])
                    for f in releases:
                        f.result()
                    pinned = pin(i)
                if pinned is not None and k + 1 < len(starts):
                    ahead = self._rpcs.submit(pin, starts[k + 1])
                if pinned is None:
                    return LEASE_REFUSED if i == 0 and self._link.refused_lease(lease) else found
                chunk = hashes[i:i + step]
                t0 = time.perf_counter()
                ok, release = self._use_chunk(ns, chunk, i, arena, lease, handle, *pinned)
                self._timed("read_use_s", t0)
                if release is not None:
                    releases.append(self._rpcs.submit(release))
                found[i:i + len(ok)] = ok
                if len(ok) < len(chunk) or stop[0] or self._link.skip():
                    break   # the store lost, or the caller's consume failed or had enough
        finally:
            if ahead is not None:   # pinned for nothing: given back
                pinned = ahead.result()
                if pinned is not None and pinned[0].read_id:
                    self._release_read(ns, lease, pinned[0].read_id, [])
            for f in releases:
                f.result()
        return found

    def _pin_chunk(self, ns, chunk: list[bytes], lease: int):
        """(PinResponse, when it came) or None: the Pin failed."""
        resp = self._link.call(self._link.stub.Pin, kv_pb2.PinRequest(namespace=ns, block_hashes=chunk,
                                                            lease=kv_pb2.ShmWindow(lease_id=lease)),
                          self._link.deadline(len(chunk) * ns.block_bytes))
        return None if resp is None else (resp, time.monotonic())

    def _release_read(self, ns, lease: int, read_id: int, corrupt: list[int]) -> None:
        self._link.call(self._link.stub.Release, kv_pb2.ReleaseRequest(lease=kv_pb2.ShmWindow(lease_id=lease),
                                                             read_id=read_id, corrupt=corrupt),
                   self._link.deadline(len(corrupt) * ns.block_bytes))

    def _use_chunk(self, ns, chunk: list[bytes], first: int, arena: ArenaMapping | NixlRemote, lease: int, handle,
                   resp, pinned_at: float):
        """(found-and-verified per block of the chunk, shorter than the chunk: stop here; the
        release to run, or None)."""
        metas = list(resp.blocks)
        if len(metas) != len(chunk):
            metas = []   # an answer we cannot use: misses (and the pins given back)
        staged, failed = None, False
        if isinstance(arena, NixlRemote):
            views, staged, failed = self._nixl_read(arena, ns, metas, chunk)
        else:
            views = [arena.slot(m.offset, ns.block_bytes)
                     if m.block_hash == h and m.size == ns.block_bytes else None for m, h in zip(metas, chunk)]
        read_only = [v.toreadonly() if v is not None else None for v in views]
        try:
            verified = handle(first, read_only, metas) if any(v is not None for v in views) else [None] * len(views)
        except ConsumeFailed:
            verified, failed = [None] * len(views), True
        finally:
            for v in read_only + views:
                release_view(v)
            if staged is not None:
                staged.release()
        # Pins held past half the lease's life may have been taken back: never trust those bytes.
        late = time.monotonic() - pinned_at > self._link.lease_ttl_s / 2
        release = None
        if resp.read_id:
            corrupt = [j for j, ok in enumerate(verified) if ok is False] if not late else []
            release = lambda: self._release_read(ns, lease, resp.read_id, corrupt)  # noqa: E731
        if failed:
            return [], release   # shorter than the chunk: the load ends here
        return [bool(v) and not late for v in verified] + [False] * (len(chunk) - len(verified)), release

    def _nixl_read(self, remote: NixlRemote, ns, metas: list, chunk: list[bytes]):
        """(views, the staging slot they are in or None, failed): one NIXL READ of the pinned
        blocks into a staging slot, block j of the chunk at j * block_bytes; views[j] is None for
        a miss. A READ that fails or misses its deadline makes every block a miss and ends the load."""
        bb = ns.block_bytes
        views: list = [None] * len(metas)
        want = [j for j, (m, h) in enumerate(zip(metas, chunk))
                if m.block_hash == h and m.size == bb and remote.valid(m.offset, bb)]
        if not want:
            return views, None, False
        deadline = time.monotonic() + self._link.deadline(len(want) * bb)
        staged = remote.plane.stage(deadline)
        if staged is None:
            return views, None, True
        outcome = remote.transfer("READ", staged, [(j, metas[j].offset) for j in want], bb, deadline)
        if outcome != DONE:
            self._link.nixl_failed(remote, outcome)
            return views, staged, True
        for j in want:
            views[j] = staged.block(j, bb)
        return views, staged, False


    def close(self) -> None:
        self._commits.shutdown(wait=False)
        self._rpcs.shutdown(wait=False)

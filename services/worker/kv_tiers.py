"""The worker's side of the KV tiers (docs/kv_tiers.md): what the scheduler's plan asks it to copy.

- Tier 1, host memory (`--kv-offload-gb`): a pool of slots, pinned on a GPU. A plan names device
  blocks to copy into slots before the blocks are reused (offloads) and slots to copy into
  device blocks (loads). Both are enqueued on the step's stream ahead of its forward, offloads
  first, so stream order alone makes them safe: nothing waits on the host.
- Tier 2, the kvstore (`--kvstore-addr`): a plan names blocks to fetch for a request the
  scheduler holds back; one thread fetches them (on the kvstore's host straight out of the
  store's memory onto the device, kv_store_io.py; elsewhere chunk by chunk through a staging
  buffer), and the result (how many leading blocks arrived, within `--kv-load-timeout-ms`) is
  reported in a later StepResult. A plan also names blocks its step completes: right behind the
  forward they are gathered on the device, and a background thread (services/common/kv_saver.py)
  copies them into slots of the store's memory; past `--kv-save-buffer-mb` of saves in flight
  (device memory on a GPU) a save is dropped, never waited for.

A block's bytes are "L2BHD": for each layer, K then V, [block_size, kv_heads, head_dim] each, in
the cache's storage dtype; one layer's cache is [2, num_blocks, block_size, kv_heads, head_dim]
(models/llama.py). Copies work on uint8 views, so an fp8 cache moves like any other. An fp8 cache
that stores V transposed per block ([kv_heads, head_dim, block_size], attention.v_transposed) is
"L2BHD-VT" (`layout`): the kvstore namespace carries it, so only engines of one layout share."""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass

import torch

from services.worker.plan import LoadResult, PlanError, SaveResult, TierBlocks

log = logging.getLogger("meshllm.worker.kv_tiers")

LAYOUT = "L2BHD"
_LOAD_CHUNK_BYTES = 64 << 20   # staging of one fetch: the kvstore's default window


def layout(kv_dtype: torch.dtype, block_size: int) -> str:
    """The byte layout of a block of this cache dtype and block size (module doc)."""
    from services.worker.attention import v_transposed_for
    return LAYOUT + "-VT" if v_transposed_for(kv_dtype, block_size) else LAYOUT


@dataclass
class TierConfig:
    """What load.py gives the runner (the client and namespace fields stay None without a kvstore)."""

    offload_bytes: int = 0                 # --kv-offload-gb
    client: object | None = None           # services.common.kv_client.KvClient
    make_namespace: object | None = None   # block_size, block_bytes -> KvNamespace
    load_timeout_s: float = 2.0            # --kv-load-timeout-ms
    save_buffer_bytes: int = 256 << 20     # host buffers of saves not yet put (pinned on a GPU)
    direct: bool = False                   # copy handed-off blocks from peer workers (kv_export.py)
    peer_credentials: object | None = None # internal mTLS for their WorkerControl
    direct_transport: str = "mmap"         # kv_export.TRANSPORTS
    # Tensor parallel: this rank's place; with tp_size > 1 a fetch or save is reported only once
    # every rank's copy of it ended (tier_agreement.py; tp_ranks.TpLink runs the agreement).
    tp_size: int = 1
    tp_rank: int = 0


class KvTiers:
    def __init__(self, kv_caches: list[torch.Tensor], block_size: int, cfg: TierConfig, exported=None) -> None:
        self.cfg = cfg
        self.device = kv_caches[0].device
        self.cuda = self.device.type == "cuda"
        # Byte views of each layer's cache: [2, num_blocks, block_size, kvh, head_dim * itemsize].
        self.views = [c.view(torch.uint8) for c in kv_caches]
        two, self.num_blocks, bs, kvh, hd = self.views[0].shape
        # ... and as rows of 8-byte words, one row per (K or V, block): the copies index whole
        # rows (an index op over uint8 elements moves one byte per element, ~20x slower on a GPU).
        self.rows = [v.reshape(two, self.num_blocks, -1).view(torch.int64) for v in self.views]
        self.row_words = self.rows[0].shape[-1]
        self.block_shape = (len(self.views), two, bs, kvh, hd)       # one block, L2BHD
        self.block_bytes = len(self.views) * two * bs * kvh * hd
        self.block_size = block_size
        self.num_slots = cfg.offload_bytes // self.block_bytes if cfg.offload_bytes > 0 else 0
        self.host = (torch.zeros((self.num_slots, *self.block_shape), dtype=torch.uint8, pin_memory=self.cuda)
                     if self.num_slots else None)
        self.client = cfg.client
        self.namespace = (cfg.make_namespace(block_size, self.block_bytes)
                          if self.client is not None and cfg.make_namespace is not None else None)
        self.stats = collections.Counter()   # host_offload/host_load blocks and seconds (metrics)
        self.peers = None
        if cfg.direct:
            from services.worker.kv_export import Peers
            self.peers = Peers(cfg.peer_credentials, tuple(kv_caches[0].shape), kv_caches[0].dtype, self.device,
                               transport=cfg.direct_transport, local=exported, tp=(cfg.tp_size, cfg.tp_rank))
        self.agreement = None
        if cfg.tp_size > 1:
            from services.worker.tier_agreement import RankAgreement
            self.agreement = RankAgreement(self._take_local)
        self._jobs: collections.deque = collections.deque()
        self._done: collections.deque = collections.deque()
        self._saved: collections.deque = collections.deque()   # SaveResults, in submission order
        self._cond = threading.Condition()
        self._busy = 0                       # fetches queued or running
        self._closed = False
        self._saver = None
        self.store_io = None
        self._fetch_staging: torch.Tensor | None = None   # the fetch thread's (copying path)
        self._thread = None
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        if self.namespace is not None:
            from services.common.kv_saver import KvSaver
            from services.worker.kv_store_io import StoreIO
            self._saver = KvSaver(self.client, max_pending_bytes=max(cfg.save_buffer_bytes, self.block_bytes))
            self.store_io = StoreIO(self.client, self.block_shape, self.device, self.scatter)
        if self.namespace is not None or self.peers is not None:
            self._thread = threading.Thread(target=self._fetch_loop, name="kv-tier-fetch", daemon=True)
            self._thread.start()
        log.info("KV tiers: host pool %d blocks (%.2f GiB), kvstore %s, direct hand-offs %s", self.num_slots,
                 self.num_slots * self.block_bytes / 2**30, "on" if self.namespace is not None else "off",
                 "on" if self.peers is not None else "off")

    # ---- checks (before anything of a plan is applied) -----------------------------------
    def check(self, plan) -> None:
        for pairs in (plan.host_offloads, plan.host_loads):
            for block, slot in pairs:
                if not 0 <= block < self.num_blocks:
                    raise PlanError(f"KV tier copy: block id {block} outside [0, {self.num_blocks})")
                if not 0 <= slot < self.num_slots:
                    raise PlanError(f"KV tier copy: host slot {slot} outside [0, {self.num_slots})")
        for t in (*plan.tier_loads, *plan.tier_saves):
            if t.peer:
                if len(t.src_block_ids) != len(t.block_ids):
                    raise PlanError(f"request {t.request_id}: {len(t.block_ids)} block ids, "
                                    f"{len(t.src_block_ids)} peer block ids")
            elif len(t.block_ids) != len(t.block_hashes):
                raise PlanError(f"request {t.request_id}: {len(t.block_ids)} block ids, {len(t.block_hashes)} hashes")
            if any(not 0 <= b < self.num_blocks for b in t.block_ids):
                raise PlanError(f"request {t.request_id}: a tier block id outside [0, {self.num_blocks})")

    # ---- block bytes ---------------------------------------------------------------------
    def _index(self, block_ids) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)

    def gather(self, block_ids) -> torch.Tensor:
        """[n, *block_shape] uint8 on the device: the blocks' bytes, L2BHD."""
        idx = self._index(block_ids)
        n, two = len(block_ids), self.block_shape[1]
        out = torch.empty((n, len(self.rows), two, self.row_words), dtype=torch.int64, device=self.device)
        for layer, r in enumerate(self.rows):
            out[:, layer] = r.index_select(1, idx).transpose(0, 1)
        return out.view(torch.uint8).view(n, *self.block_shape)

    def scatter(self, block_ids, src: torch.Tensor) -> None:
        """Write [n, *block_shape] (on the device) into the blocks (ids: a list, or a long tensor
        on the device)."""
        idx = block_ids if isinstance(block_ids, torch.Tensor) else self._index(block_ids)
        n, two = len(idx), self.block_shape[1]
        words = src.contiguous().view(n, len(self.rows), two, -1).view(torch.int64)
        for layer, r in enumerate(self.rows):
            r.index_copy_(1, idx, words[:, layer].transpose(0, 1))

    # ---- tier 1 --------------------------------------------------------------------------
    def apply_host_copies(self, plan) -> None:
        """Offloads, then loads: on the current stream, ahead of the step's forward."""
        if plan.host_offloads:
            t0 = time.perf_counter()
            blocks = [b for b, _ in plan.host_offloads]
            slots = [s for _, s in plan.host_offloads]
            data = self.gather(blocks)
            if self.cuda:
                for j, s in enumerate(slots):
                    self.host[s].copy_(data[j], non_blocking=True)
            else:
                self.host.index_copy_(0, torch.tensor(slots, dtype=torch.long), data)
            self._count("host_offload", len(blocks), t0)
        if plan.host_loads:
            t0 = time.perf_counter()
            blocks = [b for b, _ in plan.host_loads]
            slots = [s for _, s in plan.host_loads]
            if self.cuda:
                data = torch.empty((len(slots), *self.block_shape), dtype=torch.uint8, device=self.device)
                for j, s in enumerate(slots):
                    data[j].copy_(self.host[s], non_blocking=True)
            else:
                data = self.host.index_select(0, torch.tensor(slots, dtype=torch.long))
            self.scatter(blocks, data)
            self._count("host_load", len(blocks), t0)

    def _count(self, kind: str, n: int, t0: float) -> None:
        """Tier-1 counters; the metrics share kv_client's families with tier="host". On a GPU the
        copies are stream-ordered inside the step, so only bytes and blocks are counted there."""
        from services.common import kv_client as m
        self.stats[kind + "_blocks"] += n
        direction = "save" if kind == "host_offload" else "load"
        (m.SAVED if direction == "save" else m.HITS).labels("host").inc(n)
        m.BYTES.labels("host", direction).inc(n * self.block_bytes)
        if not self.cuda:
            dt = time.perf_counter() - t0
            self.stats[kind + "_seconds"] += dt
            m.SECONDS.labels("host", direction).observe(dt)
            if dt > 0:
                m.GBPS.labels("host", direction).set(n * self.block_bytes / dt / 1e9)

    # ---- tier 2: fetches -----------------------------------------------------------------
    def start_loads(self, loads: list[TierBlocks]) -> None:
        for t in loads:
            if (self.peers is None if t.peer else self.namespace is None) or not t.block_ids:
                self._done.append(LoadResult(t.request_id, 0, len(t.block_ids), 0, 0))
                continue
            with self._cond:
                self._jobs.append((t, time.monotonic() + self.cfg.load_timeout_s))
                self._busy += 1
                self._cond.notify()

    def take_loads(self, wait_s: float = 0.0) -> list[LoadResult]:
        """Fetches that ended; with `wait_s`, wait that long for one if some are under way."""
        if wait_s:
            self.wait_done(wait_s, loads_only=True)
        if self.agreement is not None:
            return self.agreement.take_loads()
        return self._drain(self._done)

    @staticmethod
    def _drain(results: collections.deque) -> list:
        out = []
        while results:
            out.append(results.popleft())
        return out

    def _take_local(self) -> tuple[list[LoadResult], list[SaveResult]]:
        """Tensor parallel: this rank's ended fetches and saves, for the agreement."""
        return self._drain(self._done), self._drain(self._saved)

    @property
    def loads_in_flight(self) -> int:
        return self._busy

    @property
    def busy(self) -> bool:
        """Fetches or saves under way (each is reported when it ends), or, tensor parallel, ended
        here and waiting for the other ranks."""
        return bool(self._busy or (self._saver is not None and self._saver.pending_bytes)
                    or (self.agreement is not None and self.agreement.pending))

    def wait_done(self, wait_s: float, loads_only: bool = False) -> None:
        """Wait up to `wait_s` for a fetch (or, unless loads_only, a save) to end (a plan sent only
        to hear of them)."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if loads_only:
                if self._done or not self._busy:
                    return
            elif self._done or self._saved or not self.busy:
                return
            with self._cond:
                self._cond.wait(0.0005)

    @property
    def has_done(self) -> bool:
        if self.agreement is not None:
            return self.agreement.has_agreed
        return bool(self._done or self._saved)

    def _fetch_loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                job, deadline = self._jobs.popleft()
            t0 = time.perf_counter_ns()
            try:
                loaded = self._fetch(job, deadline)
            except Exception:  # noqa: BLE001 - a fetch that fails is recomputed, never an error
                log.exception("kvstore fetch failed")
                loaded = 0
            with self._cond:
                self._done.append(LoadResult(job.request_id, loaded, len(job.block_ids),
                                             loaded * self.block_bytes, time.perf_counter_ns() - t0))
                self._busy -= 1
                self._cond.notify_all()

    def _fetch_direct(self, job: TierBlocks, deadline: float) -> int:
        t0 = time.perf_counter()
        n = self._copy_direct(job, deadline)
        from services.common import kv_client as m   # the tier metrics, tier="direct"
        if n:
            m.HITS.labels("direct").inc(n)
            m.BYTES.labels("direct", "load").inc(n * self.block_bytes)
            dt = time.perf_counter() - t0
            m.SECONDS.labels("direct", "load").observe(dt)
            if dt > 0:
                m.GBPS.labels("direct", "load").set(n * self.block_bytes / dt / 1e9)
        else:
            m.MISSES.labels("direct").inc(len(job.block_ids))
        return n

    def _copy_direct(self, job: TierBlocks, deadline: float) -> int:
        """Copy a hand-off's blocks out of the peer worker's cache (mapped memfd or CUDA IPC), all of
        it before the peer's lease on them ends (after it, they may hold another request's KV)."""
        margin = 50_000_000   # 50 ms
        if job.lease_deadline_ns and time.time_ns() >= job.lease_deadline_ns - margin:
            log.warning("direct hand-off from %s: its lease ended before the copy began", job.peer)
            return 0
        try:
            peer = self.peers.get(job.peer)
        except Exception as exc:  # noqa: BLE001 - unreachable or not comparable: recompute
            log.warning("direct hand-off from %s failed: %s", job.peer, exc)
            self.peers.forget(job.peer)
            return 0
        if any(not 0 <= b < peer.num_blocks for b in job.src_block_ids):
            log.warning("direct hand-off from %s names blocks outside its cache", job.peer)
            return 0
        if peer.nixl_remote is not None:   # another host (or --kv-direct-transport nixl)
            if not peer.read_nixl(list(job.src_block_ids), list(job.block_ids), deadline):
                log.warning("direct hand-off from %s over NIXL failed or timed out", job.peer)
                return 0
            if job.lease_deadline_ns and time.time_ns() >= job.lease_deadline_ns:
                return 0
            self.stats["direct_blocks"] += len(job.block_ids)
            return len(job.block_ids)
        src = torch.tensor(list(job.src_block_ids), dtype=torch.long, device=self.device)
        dst = self._index(job.block_ids)
        two = self.block_shape[1]
        peer_rows = [p.view(torch.uint8).reshape(two, peer.num_blocks, -1).view(torch.int64) for p in peer.layers]
        if self.cuda:
            with torch.cuda.stream(self._stream):
                for r, p in zip(self.rows, peer_rows):
                    r.index_copy_(1, dst, p.index_select(1, src))
            self._stream.synchronize()
        else:
            for r, p in zip(self.rows, peer_rows):
                r.index_copy_(1, dst, p.index_select(1, src))
        if time.monotonic() > deadline or (job.lease_deadline_ns and time.time_ns() >= job.lease_deadline_ns):
            return 0   # too late: what was copied may not be the handed-off KV (recomputed)
        self.stats["direct_blocks"] += len(job.block_ids)
        return len(job.block_ids)

    def _fetch(self, job: TierBlocks, deadline: float) -> int:
        if job.peer:
            return self._fetch_direct(job, deadline)
        zero_copy = self.store_io.load(self.namespace, list(job.block_hashes), list(job.block_ids), deadline)
        if zero_copy is not None:   # straight out of the store's memory (kv_store_io.py)
            return zero_copy if time.monotonic() < deadline else 0
        # Through the client's copies (another host, the Redis backend): chunks of a staging buffer.
        per_chunk = max(1, _LOAD_CHUNK_BYTES // self.block_bytes)
        if self._fetch_staging is None:
            self._fetch_staging = torch.empty((per_chunk, *self.block_shape), dtype=torch.uint8, pin_memory=self.cuda)
        staging = self._fetch_staging
        loaded = 0
        n = len(job.block_ids)
        while loaded < n and time.monotonic() < deadline:
            hashes = job.block_hashes[loaded:loaded + per_chunk]
            found = self.client.get_into(self.namespace, hashes, [staging[i].numpy() for i in range(len(hashes))])
            ok = next((i for i, f in enumerate(found) if not f), len(found))
            if ok == 0 or time.monotonic() >= deadline:
                break   # too late: its bytes are not used (the blocks are recomputed)
            blocks = job.block_ids[loaded:loaded + ok]
            if self.cuda:
                with torch.cuda.stream(self._stream):
                    self.scatter(blocks, staging[:ok].to(self.device, non_blocking=True))
                self._stream.synchronize()   # on the device before it is reported, and staging is free
            else:
                self.scatter(blocks, staging[:ok])
            loaded += ok
            if ok < len(hashes):
                break
        return loaded

    # ---- tier 2: saves -------------------------------------------------------------------
    def save(self, saves: list[TierBlocks]) -> None:
        """Right behind the step's forward (stream order): copy the blocks out, put them later.
        Every entry is reported once (take_saves), saved or dropped."""
        if self._saver is None:
            self.refuse_saves(saves)
            return
        for t in saves:
            if not t.block_ids:
                self._saved.append(SaveResult(t.request_id, 0, 0))
                continue
            nbytes = len(t.block_ids) * self.block_bytes
            if self._saver.pending_bytes + nbytes > self._saver.max_pending_bytes:
                self._saver.dropped += len(t.block_ids)   # the store is slower than the engine
                self._saved.append(SaveResult(t.request_id, len(t.block_ids), 0))
                continue
            # Gathered on the step's stream right behind its forward; the saver's thread copies
            # it from the device straight into the store's memory (kv_store_io.py).
            data = self.gather(t.block_ids)
            event = None
            if self.cuda:
                event = torch.cuda.Event()
                event.record()
            hashes = list(t.block_hashes)

            def put(ns, _blocks, data=data, event=event, hashes=hashes) -> int:
                return self.store_io.save(ns, hashes, data, event)

            def after(kept: int, t=t) -> None:
                self._saved.append(SaveResult(t.request_id, len(t.block_ids), kept))
            if not self._saver.submit(self.namespace, [(h, None) for h in hashes], after=after, put=put, nbytes=nbytes):
                self._saved.append(SaveResult(t.request_id, len(t.block_ids), 0))

    def refuse_saves(self, saves) -> None:
        """Saves that will never run (a refused or failed plan): reported as dropped."""
        for t in saves:
            self._saved.append(SaveResult(t.request_id, len(t.block_ids), 0))

    def take_saves(self) -> list[SaveResult]:
        if self.agreement is not None:
            return self.agreement.take_saves()
        return self._drain(self._saved)

    def flush_saves(self, timeout_s: float) -> bool:
        return self._saver is None or self._saver.flush(timeout_s)

    # ---- lifetime ------------------------------------------------------------------------
    def drain(self, timeout_s: float = 10.0) -> None:
        """Wait for fetches under way (they write into the cache) and forget their results."""
        with self._cond:
            while self._jobs:
                self._jobs.popleft()
                self._busy -= 1
            self._cond.wait_for(lambda: not self._busy, timeout_s)
        self._done.clear()
        if self.agreement is not None:
            self.agreement.forget_loads()

    def close(self) -> None:
        self.drain()
        if self.peers is not None:
            self.peers.close()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._saver is not None:
            self._saver.close(2.0)

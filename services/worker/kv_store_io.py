"""KV blocks between the worker's cache and the kvstore's own memory, with no copy in between
(docs/kv_tiers.md, docs/kvstore.md).

On the kvstore's host the client maps the store's block memory (services/common/kv_client.py);
here that mapping is registered with CUDA once (cudaHostRegister: the GPU's copy engines then
read and write it as they do pinned memory). A load is then one host-to-device copy per run of
adjacent blocks, straight out of the store's memory into a device staging buffer, and a scatter
into the cache; a save one device-to-host copy per run into the slots the store reserved.

Checksums: on a GPU with Triton each block's CRC-32C is computed on the device
(kv_block_crc.py): a load verifies the staged bytes, what actually landed, against the store's
checksum (a mismatch is a miss, reported to the store); a save checksums the gathered blocks
once, before their copies, and its fill only starts the copies (the client's commit thread waits
for them), so the next chunk's Reserve overlaps them; the store verifies what landed on Commit.
No CPU thread of the worker reads the blocks. Elsewhere (the CPU, no Triton, a block size the
kernel does not cut, device_checksums=False) the client verifies (loads) or computes (saves)
each block's CRC-32C on its threads while the copies run. Where no arena is mapped (the kvstore
on another host, or its Redis backend) the client's copying calls are used, through host memory.

    io = StoreIO(client, block_shape, device, scatter)
    n = io.load(namespace, hashes, block_ids, deadline)   # leading blocks loaded; None: no arena
    kept = io.save(namespace, hashes, data, ready_event)  # data: [n, *block_shape] on the device
"""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from services.common.kv_transfers import Filled

log = logging.getLogger("meshllm.worker.kv_store_io")

STAGING_BYTES = 64 << 20   # device staging of one load chunk


def _address(view) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class ArenaMappings:
    """The client's arena mappings as uint8 tensors over the same memory, registered with CUDA
    on a GPU (set as the client's arena hooks)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._lock = threading.Lock()
        self._maps: dict[int, tuple[int, int, torch.Tensor, bool]] = {}   # id(mm) -> (base, size, tensor, registered)

    def on_map(self, mm) -> None:
        tensor = torch.frombuffer(mm, dtype=torch.uint8)
        base, size = int(tensor.data_ptr()), tensor.numel()
        registered = False
        if self.cuda:
            t0 = time.perf_counter()
            rc = torch.cuda.cudart().cudaHostRegister(base, size, 0)
            code = int(rc[0] if isinstance(rc, tuple) else rc)
            registered = code == 0
            if registered:
                log.info("kvstore arena of %.2f GiB registered with CUDA in %.0f ms", size / 2**30,
                         (time.perf_counter() - t0) * 1e3)
            else:
                log.warning("kvstore arena: cudaHostRegister failed (error %d): copies go through "
                            "pageable memory (slower)", code)
        with self._lock:
            self._maps[id(mm)] = (base, size, tensor, registered)

    def on_unmap(self, mm) -> None:
        with self._lock:
            entry = self._maps.pop(id(mm), None)   # our tensor goes: the client may close the mapping
        if entry is not None and entry[3]:
            torch.cuda.synchronize()   # no copy of ours may still use it
            torch.cuda.cudart().cudaHostUnregister(entry[0])

    def tensor_at(self, addr: int, nbytes: int) -> torch.Tensor | None:
        """The uint8 tensor over [addr, addr + nbytes) of a mapped arena, or None."""
        with self._lock:
            for base, size, tensor, _ in self._maps.values():
                if base <= addr and addr + nbytes <= base + size:
                    return tensor[addr - base:addr - base + nbytes]
        return None

    def tensor(self, view) -> torch.Tensor:
        """A uint8 tensor over the memory of `view` (a memoryview into a mapped arena)."""
        t = self.tensor_at(_address(view), len(view))
        if t is not None:
            return t
        # Not a mapping we know (its hook failed): torch over the view itself (a read-only one
        # is copied: only loads read those).
        arr = np.frombuffer(view, dtype=np.uint8)
        return torch.from_numpy(arr if arr.flags.writeable else arr.copy())

    def runs(self, views: list, size: int) -> list[tuple[int, int, torch.Tensor | None]]:
        """(first index, count, tensor over the whole run or None) for the runs of adjacent
        `size`-byte blocks of one mapped arena in `views`."""
        addrs = [_address(v) for v in views]
        out: list[tuple[int, int, torch.Tensor | None]] = []
        i = 0
        while i < len(addrs):
            j = i + 1
            while j < len(addrs) and addrs[j] == addrs[j - 1] + size:
                j += 1
            whole = self.tensor_at(addrs[i], (j - i) * size)
            if whole is None:
                out += [(k, 1, None) for k in range(i, j)]
            else:
                out.append((i, j - i, whole))
            i = j
        return out


class StoreIO:
    def __init__(self, client, block_shape: tuple[int, ...], device: torch.device,
                 scatter: Callable[[list[int], torch.Tensor], None], device_checksums: bool = True) -> None:
        self.client = client
        self.block_shape = block_shape
        self.block_bytes = int(np.prod(block_shape))
        self.device = device
        self.cuda = device.type == "cuda"
        self.scatter = scatter
        self.per_chunk = max(1, STAGING_BYTES // self.block_bytes)
        self.maps = ArenaMappings(self.cuda)
        self.stats = collections.Counter()   # seconds in our copies vs whole calls (bench/gpu_kv_tiers.py)
        self._staging: list[torch.Tensor] | None = None    # on the device; the fetch thread's
        self._load_stream = torch.cuda.Stream(device) if self.cuda else None
        self._scatter_stream = torch.cuda.Stream(device) if self.cuda else None
        self._scattered: list = []            # per staging buffer: its last scatter's event
        self._save_stream = torch.cuda.Stream(device) if self.cuda else None
        self._crc_host: torch.Tensor | None = None   # pinned: a load chunk's device checksums
        self._crc_stream = torch.cuda.Stream(device) if self.cuda else None   # a save's checksums
        self.crc = self._device_crc() if self.cuda and device_checksums else None
        client.set_arena_hooks(self.maps.on_map, self.maps.on_unmap)

    def _device_crc(self):
        """The GPU's CRC-32C for our blocks, compiled and checked against the CPU's here (None:
        the client checksums on the CPU)."""
        try:
            from services.common.kv_blocks import checksum
            from services.worker.kv_block_crc import BlockCrc
            crc = BlockCrc.for_size(self.block_bytes)
            if crc is None:
                log.info("kvstore tier: no GPU checksum for %d-byte blocks: the client checksums them", self.block_bytes)
                return None
            probe = torch.randint(0, 256, (2, self.block_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
            with torch.cuda.stream(self._save_stream):
                got = crc(probe.to(self.device, non_blocking=False)).cpu().tolist()
            want = [checksum(probe[i].numpy()) for i in range(2)]
            if [g & 0xFFFFFFFF for g in got] != want:
                log.warning("kvstore tier: the GPU checksum disagrees with the CPU's: the client checksums")
                return None
            return crc
        except Exception as exc:  # noqa: BLE001 - no GPU checksum: the CPU path
            log.warning("kvstore tier: no GPU checksum (%s: %s): the client checksums", type(exc).__name__, str(exc)[:200])
            return None

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=self.cuda)

    # ---- loads (the fetch thread) ---------------------------------------------------------
    def load(self, ns, hashes: list[bytes], block_ids: list[int], deadline: float) -> int | None:
        """Fill block_ids[i] with the stored block hashes[i]; the number of leading blocks that
        arrived and verified in time. None: no arena here (the caller uses get_into)."""
        copied = [0]   # leading blocks copied into the cache

        def consume(start: int, views: list) -> bool:
            """False ends the load after this chunk (the client pins nothing more)."""
            if start != copied[0] or time.monotonic() >= deadline:
                return False   # after a gap, or too late: the rest is recomputed
            k = next((i for i, v in enumerate(views) if v is None), len(views))
            if k:
                self._load_chunk(block_ids[start:start + k], views[:k])
            copied[0] = start + k
            return k == len(views)   # nothing after a miss is used

        def consume_verified(start: int, views: list, crcs: list) -> list:
            """The device checksums what landed in staging (verified[i], None: not copied)."""
            if start != copied[0] or time.monotonic() >= deadline:
                return [None] * len(views)
            k = next((i for i, v in enumerate(views) if v is None), len(views))
            verified: list = [None] * len(views)
            if k:
                got = self._load_chunk(block_ids[start:start + k], views[:k])
                verified[:k] = [(g & 0xFFFFFFFF) == c for g, c in zip(got, crcs[:k])]
            ok = next((i for i, v in enumerate(verified) if not v), len(views))
            copied[0] = start + ok
            return verified

        t0 = time.perf_counter()
        if self.crc is not None:
            found = self.client.read_zero_copy(ns, hashes, consume_verified, consumer_verifies=True)
        else:
            found = self.client.read_zero_copy(ns, hashes, consume)
        if found is None:
            return None
        self.stats["load_s"] += time.perf_counter() - t0
        verified = next((i for i, f in enumerate(found) if not f), len(found))
        return min(verified, copied[0])

    def _load_chunk(self, blocks: list[int], views: list) -> list[int] | None:
        t0 = time.perf_counter()
        try:
            return self._copy_in(blocks, views)
        finally:
            self.stats["load_copy_s"] += time.perf_counter() - t0
            self.stats["load_chunks"] += 1

    def _copy_in(self, blocks: list[int], views: list) -> list[int] | None:
        """Staging chunk by chunk: on a GPU two staging buffers alternate, so the copies into one
        run (the load stream) while the other is checksummed (self.crc) and scattered into the
        cache (the scatter stream); complete on return. The staged blocks' CRC-32Cs (as int32),
        or None without self.crc."""
        bb, per = self.block_bytes, self.per_chunk
        if self._staging is None:
            n = 2 if self.cuda else 1
            self._staging = [torch.empty((per, *self.block_shape), dtype=torch.uint8, device=self.device)
                             for _ in range(n)]
            self._scattered = [None] * n
        if not self.cuda:
            flat = self._staging[0].view(-1)
            for c in range(0, len(views), per):
                part = views[c:c + per]
                for j, v in enumerate(part):
                    flat[j * bb:(j + 1) * bb].copy_(self.maps.tensor(v))
                self.scatter(blocks[c:c + len(part)], self._staging[0][:len(part)])
            return None
        crcs = ids = None
        if self.crc is not None:
            if self._crc_host is None or self._crc_host.numel() < len(views):
                self._crc_host = torch.empty(max(len(views), per), dtype=torch.int32, pin_memory=True)
            with torch.cuda.stream(self._scatter_stream):
                crcs = torch.empty(len(views), dtype=torch.int32, device=self.device)
        for k, c in enumerate(range(0, len(views), per)):
            part, b = views[c:c + per], k % 2
            staging, flat = self._staging[b], self._staging[b].view(-1)
            with torch.cuda.stream(self._load_stream):
                if self._scattered[b] is not None:
                    self._load_stream.wait_event(self._scattered[b])   # its last scatter read it
                for first, count, whole in self.maps.runs(part, bb):
                    src = whole if whole is not None else self.maps.tensor(part[first])
                    flat[first * bb:(first + count) * bb].copy_(src, non_blocking=True)
                    self.stats["load_runs"] += 1
                copied = torch.cuda.Event()
                copied.record()
            with torch.cuda.stream(self._scatter_stream):
                if ids is None:   # the chunk's block ids, on the device once
                    ids = torch.tensor(blocks, dtype=torch.long).pin_memory().to(self.device, non_blocking=True)
                self._scatter_stream.wait_event(copied)
                if crcs is not None:
                    crcs[c:c + len(part)] = self.crc(staging[:len(part)])
                self.scatter(ids[c:c + len(part)], staging[:len(part)])
                self._scattered[b] = torch.cuda.Event()
                self._scattered[b].record()
        if crcs is not None:
            host = self._crc_host[:len(views)]
            with torch.cuda.stream(self._scatter_stream):
                host.copy_(crcs, non_blocking=True)
        self._load_stream.synchronize()    # every copy out of the views is done before they go
        self._scatter_stream.synchronize()
        return None if crcs is None else host.tolist()

    # ---- saves (the saver thread) ---------------------------------------------------------
    def save(self, ns, hashes: list[bytes], data: torch.Tensor, ready=None) -> int:
        """Save [n, *block_shape] blocks (`ready`: a CUDA event after which `data` holds them).
        Returns the blocks the store now holds. Never raises."""
        bb = self.block_bytes
        if ready is not None and self.cuda:
            self._save_stream.wait_event(ready)
        flat = data.reshape(len(hashes), -1)
        crcs: list = []     # the device's checksums of `data`, fetched by the first commit that needs them
        crc_lock = threading.Lock()
        crc_ready = None
        if self.crc is not None:   # beside the copies (its own stream): the first commit waits for it
            if ready is not None:
                self._crc_stream.wait_event(ready)
            with torch.cuda.stream(self._crc_stream):
                on_device = self.crc(flat)
                on_host = torch.empty(len(hashes), dtype=torch.int32, pin_memory=True)
                on_host.copy_(on_device, non_blocking=True)
                crc_ready = torch.cuda.Event()
                crc_ready.record()

        def fill(start: int, idx: list[int], views: list) -> Filled | None:
            t0 = time.perf_counter()
            stream = torch.cuda.stream(self._save_stream) if self.cuda else contextlib.nullcontext()
            try:
                with stream:
                    for first, count, whole in self.maps.runs(views, bb):
                        self.stats["save_runs"] += 1
                        rows = idx[first:first + count]
                        if whole is not None and rows == list(range(rows[0], rows[0] + count)):
                            self._copy(whole, flat[rows[0]:rows[0] + count].reshape(-1))
                        else:
                            for v, i in zip(views[first:first + count], rows):
                                self._copy(self.maps.tensor(v), flat[i])
                    done = torch.cuda.Event() if crc_ready is not None else None
                    if done is not None:
                        done.record()
            except BaseException:
                if self.cuda:
                    self._save_stream.synchronize()   # nothing of ours still writes the slots
                raise
            if done is None:
                if self.cuda:
                    self._save_stream.synchronize()
                self.stats["save_copy_s"] += time.perf_counter() - t0
                return None      # the client checksums the slots
            self.stats["save_copy_s"] += time.perf_counter() - t0   # started only

            def checksums() -> list[int]:   # on a commit thread: the next Reserve need not wait
                with crc_lock:
                    if not crcs:
                        crc_ready.synchronize()
                        crcs.extend(v & 0xFFFFFFFF for v in on_host.tolist())
                return [crcs[i] for i in idx]

            def wait() -> None:
                t1 = time.perf_counter()
                done.synchronize()
                self.stats["save_wait_s"] += time.perf_counter() - t1
            return Filled(checksums, wait)

        t0 = time.perf_counter()
        kept = self.client.write_zero_copy(ns, hashes, fill)
        if crc_ready is not None:
            crc_ready.synchronize()   # no fill may have waited for it: it still reads `data`
        self.stats["save_s"] += time.perf_counter() - t0
        if kept is not None:
            return kept
        if self.cuda:   # no arena here: through host memory and the client's copying put
            if ready is not None:
                ready.synchronize()
            flat = flat.to("cpu")
        return self.client.put(ns, [(h, flat[i].numpy()) for i, h in enumerate(hashes)])


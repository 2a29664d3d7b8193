"""Direct KV hand-off between two workers of one host (docs/pd.md): the prefill worker's KV cache
is one allocation another process can map, and the decode worker copies the blocks it was
handed straight out of it, with no store in between.

- CPU: the cache lives in a memfd (`memfd_create`; it cannot outlive the process, so kill -9
  leaks nothing) whose first 4 KiB hold 32 random bytes; a decode worker maps
  `/proc/<pid>/fd/<fd>` (same host and user), checks the host's boot id and those bytes (a
  reused pid or another host's is never taken for it), and copies blocks with index ops.
- CUDA: the cache is one device allocation shared by CUDA IPC (the storage handle torch's own
  tensor sharing uses, sent as protobuf fields, never pickled); the copy is device to device.

- NIXL (the transfer library vLLM and Dynamo use): for a peer on another host, or everywhere with
  `--kv-direct-transport nixl`. Each exporting worker registers its one allocation with a NIXL
  agent (UCX backend; DRAM on the CPU, VRAM on a GPU) and publishes the agent's metadata in the
  descriptor; the decode worker READs the handed-off blocks' rows straight into its own
  registered cache (RDMA or NVLink where UCX has them; TCP otherwise).

The export descriptor travels over WorkerControl.ExportKv on the worker's gRPC port, which has
internal mTLS like every internal hop, so only the mesh learns it (and NIXL's metadata with it).

Tensor parallel: every rank exports its own shard (its own memfd, CUDA IPC allocation or NIXL
agent); the ranks gather their descriptors on rank 0 (tp_ranks.TpLink.share_exports), whose
ExportKv answers for each rank (`tp_rank`), and decode rank r copies from prefill rank r. Both
workers must have the same tensor-parallel size: a peer of another size (or a descriptor of
another rank) is refused, and that hand-off is recomputed (re-sharding is not implemented).
The prefill engine keeps the handed-off blocks under a lease until the decode side has them (the
scheduler's part)."""
from __future__ import annotations

import atexit
import logging
import mmap
import os
import threading

import grpc
import torch

from services.common import pb
from services.common.procs import boot_id as _boot_id

log = logging.getLogger("meshllm.worker.kv_export")

_HEADER = 4096
_TOKEN = 32


# mmap (the default): the mapped cache (memfd / CUDA IPC), same host only; nixl: always NIXL;
# auto: mmap on the same host, NIXL for another. NIXL is imported only for nixl and auto: its
# bundled libraries can clash with others already loaded in a process (an abort seen when
# grpc_tools' compiler was loaded first), so a worker that does not ask for it never loads it.
TRANSPORTS = ("mmap", "nixl", "auto")


def nixl_api():
    """nixl._api, or None when NIXL is not installed."""
    try:
        from nixl import _api
    except ImportError:
        return None
    return _api


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


class ExportedCache:
    """One allocation holding every layer's cache ([L, 2, NB, bs, kvh, hd]) that a peer can map."""

    def __init__(self, num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 nixl: bool = False) -> None:
        self.num_layers, self.shape, self.dtype, self.device = num_layers, tuple(shape), dtype, device
        numel = num_layers
        for n in shape:
            numel *= n
        self.nbytes = numel * dtype.itemsize
        self._mm = None
        if device.type == "cuda":
            self.all = torch.zeros((num_layers, *shape), dtype=dtype, device=device)
            self.fd = -1
            self.token = b""
        else:
            self.fd = os.memfd_create("meshllm-kv-export", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, _HEADER + self.nbytes)
            self._mm = mmap.mmap(self.fd, _HEADER + self.nbytes)   # zero-filled pages, allocated when touched
            self.token = os.urandom(_TOKEN)
            self._mm[:_TOKEN] = self.token
            raw = torch.frombuffer(self._mm, dtype=torch.uint8, offset=_HEADER, count=self.nbytes)
            self.all = raw.view(dtype).view(num_layers, *shape)
        self.layers = list(self.all.unbind(0))
        self.row_bytes = self.nbytes // (num_layers * shape[0] * shape[1])   # one (K or V, block) row
        self.agent = self.nixl_mem = None
        api = nixl_api() if nixl else None
        if api is not None:
            try:
                # Peers READ from this cache: the agent progresses its UCX worker on a thread,
                # one that polls (kv_nixl.make_agent), not NIXL's default busy spin of a core.
                from services.common.kv_nixl import make_agent
                self.agent, _ = make_agent("meshllm-kv", progress_thread=True)
                self.nixl_mem = "VRAM" if device.type == "cuda" else "DRAM"
                dev = device.index or 0 if device.type == "cuda" else 0
                self.agent.register_memory([(self.all.data_ptr(), self.nbytes, dev, "")], self.nixl_mem)
            except Exception as exc:  # noqa: BLE001 - NIXL is one transport among others
                log.warning("NIXL unavailable for direct hand-offs: %s", exc)
                self.agent = None

    def row_addr(self, base: int, num_blocks: int, layer: int, kv: int, block: int) -> int:
        return base + ((layer * 2 + kv) * num_blocks + block) * self.row_bytes

    def describe(self) -> "pb.control.KvExport":
        msg = pb.control.KvExport(boot_id=_boot_id(), pid=os.getpid(), nbytes=self.nbytes, shape=list(self.shape),
                                  dtype=str(self.dtype).removeprefix("torch."), num_layers=self.num_layers)
        if self.device.type == "cuda":
            storage = self.all.untyped_storage()
            (device, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync) = storage._share_cuda_()
            msg.kind, msg.device, msg.ipc_handle = "cuda_ipc", int(device), bytes(handle)
            msg.storage_bytes, msg.storage_offset = int(size), int(offset)
            msg.ref_counter_handle, msg.ref_counter_offset = bytes(rc_handle), int(rc_offset)
            msg.event_handle, msg.event_sync_required = bytes(ev_handle or b""), bool(ev_sync)
            msg.data_offset = self.all.storage_offset() * self.dtype.itemsize
        else:
            msg.kind, msg.fd, msg.token, msg.data_offset = "memfd", self.fd, self.token, _HEADER
        if self.agent is not None:
            msg.nixl_metadata, msg.nixl_base, msg.nixl_mem = self.agent.get_agent_metadata(), self.all.data_ptr(), self.nixl_mem
        return msg


def check_tp(desc: "pb.control.KvExport", tp_size: int, tp_rank: int) -> None:
    """ValueError unless the descriptor is rank `tp_rank` of a worker of `tp_size` ranks."""
    size = desc.tp_size or 1
    if size != tp_size:
        raise ValueError(f"the peer worker has tensor-parallel size {size}, this one {tp_size}: a hand-off "
                         f"between different sizes needs the KV re-sharded, which is not supported "
                         f"(give both the same --tensor-parallel-size)")
    if desc.tp_rank != tp_rank:
        raise ValueError(f"the peer described its rank {desc.tp_rank}, not rank {tp_rank}")


def serve_exports(describe_rank):
    """WorkerControl.kv_export for a worker: rank -> KvExport; LookupError for a rank it has not.
    `describe_rank` is one cache's describe (tensor parallel size 1) or TpLink.export_of."""
    def describe(rank: int) -> "pb.control.KvExport":
        if rank != 0:
            raise LookupError(f"this worker has tensor-parallel size 1; rank {rank} was asked for")
        return describe_rank()
    return describe


class PeerCache:
    """A peer worker's exported cache, mapped here: `layers[l]` is its layer-l cache."""

    def __init__(self, desc: "pb.control.KvExport", local_shape: tuple[int, ...], local_dtype: torch.dtype,
                 device: torch.device, transport: str = "mmap", local: ExportedCache | None = None) -> None:
        dtype = _dtype(desc.dtype)
        peer_shape = tuple(desc.shape)
        # Same model, same block size: every dimension but the block count must match.
        if dtype != local_dtype or peer_shape[:1] + peer_shape[2:] != local_shape[:1] + local_shape[2:]:
            raise ValueError(f"the peer's cache ({desc.dtype} {peer_shape}) is not comparable with ours "
                             f"({local_dtype} {local_shape})")
        self.num_blocks = peer_shape[1]
        self._mm = None
        self.layers, self.all = [], None
        self.nixl_remote = None      # NIXL: the peer agent's name in our agent, and its cache's base
        same_host = desc.boot_id == _boot_id()
        if transport == "nixl" or (transport == "auto" and not same_host):
            if local is None or local.agent is None or not desc.nixl_metadata:
                raise ValueError("NIXL is not available on both ends" if same_host else
                                 "the peer runs on another host and NIXL is not available on both ends")
            self.local, self.nixl_base, self.nixl_mem = local, desc.nixl_base, desc.nixl_mem
            name = local.agent.add_remote_agent(desc.nixl_metadata)
            self.nixl_remote = name.decode() if isinstance(name, bytes) else name
            self.nixl_device = desc.device
            return
        if not same_host:
            raise ValueError("the peer runs on another host")
        n = desc.num_layers
        if desc.kind == "memfd":
            fd = os.open(f"/proc/{desc.pid}/fd/{desc.fd}", os.O_RDWR)
            try:
                self._mm = mmap.mmap(fd, desc.data_offset + desc.nbytes)
            finally:
                os.close(fd)
            if self._mm[:len(desc.token)] != desc.token:
                self._mm.close()
                raise ValueError("the mapping is not the peer's KV cache")
            raw = torch.frombuffer(self._mm, dtype=torch.uint8, offset=desc.data_offset, count=desc.nbytes)
            self.all = raw.view(dtype).view(n, *peer_shape)
        elif desc.kind == "cuda_ipc":
            if device.type != "cuda":
                raise ValueError("a CUDA peer cannot be mapped by a CPU worker")
            storage = torch.UntypedStorage._new_shared_cuda(
                desc.device, desc.ipc_handle, desc.storage_bytes, desc.storage_offset, desc.ref_counter_handle,
                desc.ref_counter_offset, desc.event_handle or None, desc.event_sync_required)
            flat = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
            raw = flat[desc.data_offset:desc.data_offset + desc.nbytes]
            self.all = raw.view(dtype).view(n, *peer_shape)
        else:
            raise ValueError(f"unknown export kind {desc.kind!r}")
        self.layers = list(self.all.unbind(0))

    def read_nixl(self, src_blocks, dst_blocks, deadline: float) -> bool:
        """READ the rows of src_blocks (the peer's) into dst_blocks (ours) over NIXL; False when the
        transfer failed or did not finish by `deadline` (time.monotonic())."""
        import time
        local, agent = self.local, self.local.agent
        rb, L = local.row_bytes, local.num_layers
        ldev = local.device.index or 0 if local.device.type == "cuda" else 0
        lbase = local.all.data_ptr()
        lnb, rnb = local.shape[1], self.num_blocks
        mine, theirs = [], []
        for layer in range(L):
            for kv in range(2):
                for s, d in zip(src_blocks, dst_blocks):
                    theirs.append((local.row_addr(self.nixl_base, rnb, layer, kv, s), rb, self.nixl_device))
                    mine.append((local.row_addr(lbase, lnb, layer, kv, d), rb, ldev))
        handle = agent.initialize_xfer("READ", agent.get_xfer_descs(mine, local.nixl_mem),
                                       agent.get_xfer_descs(theirs, self.nixl_mem), self.nixl_remote)
        try:
            agent.transfer(handle)
            while True:
                state = agent.check_xfer_state(handle)
                if state == "DONE":
                    return True
                if state == "ERR" or time.monotonic() > deadline:
                    return False
                time.sleep(0.0002)
        finally:
            agent.release_xfer_handle(handle)

    def close(self) -> None:
        self.layers, self.all = [], None
        if self.nixl_remote is not None:
            try:
                self.local.agent.remove_remote_agent(self.nixl_remote)
            except Exception:  # noqa: BLE001
                pass
            self.nixl_remote = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass


class Peers:
    """Mapped peers by WorkerControl address (asked once, mapped again after a failure)."""

    def __init__(self, credentials: grpc.ChannelCredentials | None, local_shape, local_dtype, device,
                 timeout_s: float = 2.0, transport: str = "mmap", local: ExportedCache | None = None,
                 tp: tuple[int, int] = (1, 0)) -> None:
        self.credentials, self.local_shape, self.local_dtype, self.device = credentials, local_shape, local_dtype, device
        self.tp_size, self.tp_rank = tp   # this rank copies from the peer's rank of the same number
        self.transport, self.local = transport, local
        self.timeout_s = timeout_s
        self._peers: dict[str, PeerCache] = {}
        self._stubs: dict[str, tuple] = {}    # addr -> (channel, WorkerControl stub)
        self._lock = threading.Lock()
        # A gRPC channel still open when the interpreter exits can abort it ("terminate called
        # without an active exception"): close ours first.
        atexit.register(self.close)

    def get(self, addr: str) -> PeerCache:
        """The peer's cache as it exports it now: asked every time (one small RPC), mapped again
        when it changed (a restarted peer, a new block size), so a stale mapping is never read."""
        with self._lock:
            stub = self._stubs.get(addr)
            if stub is None:   # one channel per peer, kept (a new one costs a connection per hand-off)
                from services.common.grpc_server import GRPC_OPTIONS
                ch = (grpc.secure_channel(addr, self.credentials, options=GRPC_OPTIONS) if self.credentials is not None
                      else grpc.insecure_channel(addr, options=GRPC_OPTIONS))
                stub = self._stubs[addr] = (ch, pb.control_grpc.WorkerControlStub(ch))
        desc = stub[1].ExportKv(pb.control.ExportKvRequest(tp_rank=self.tp_rank), timeout=self.timeout_s)
        check_tp(desc, self.tp_size, self.tp_rank)
        key = desc.SerializeToString(deterministic=True)
        with self._lock:
            peer = self._peers.get(addr)
            if peer is not None and peer.key == key:
                return peer
            if peer is not None:
                peer.close()
            peer = self._peers[addr] = PeerCache(desc, self.local_shape, self.local_dtype, self.device,
                                                 self.transport, self.local)
            peer.key = key
            log.info("mapped the KV cache of peer %s (%s)", addr, "nixl" if peer.nixl_remote else desc.kind)
            return peer

    def forget(self, addr: str) -> None:
        with self._lock:
            peer = self._peers.pop(addr, None)
            stub = self._stubs.pop(addr, None)
        if peer is not None:
            peer.close()
        if stub is not None:
            stub[0].close()

    def close(self) -> None:
        for addr in list({*self._peers, *self._stubs}):
            self.forget(addr)

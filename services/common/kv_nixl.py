"""NIXL (UCX), the kvstore's data plane for a client that cannot map the store's block memory
(another host or container; docs/kvstore.md).

The store registers its block memory with its own NIXL agent and hands the agent's metadata to
clients that hold a lease (NixlMetadata, behind the mesh's gRPC credentials). The control plane
stays the zero-copy one: a read is Pin (the store answers the pinned blocks' offsets) -> NIXL
READ of those extents into a staging slot of this client's registered buffer -> the caller's
copy out, CRC-32C verified where it landed -> Release; a write is Reserve -> the blocks copied
into a staging slot (CRC-32C computed as they land) -> NIXL WRITE into the reserved slots ->
Commit (the store checks each slot in place). The store never initiates anything: it only keeps
its UCX worker progressing.

    plane = NixlPlane(slot_bytes, slots)        # this client's agent + registered host buffer
    remote = plane.load(metadata_response)      # the store's agent (once per store process)
    staged = plane.stage(deadline)              # a staging slot, or None (none free in time)
    outcome = remote.transfer("READ", staged, [(j, offset)], block_bytes, deadline)
    staged.release()

A transfer that does not complete by its deadline is a failed one: its staging slot is never
used again (the bytes may still land there), and a write that may still land is neither
committed nor aborted (its slots go back when the reservation expires, lease_ttl_s)."""
from __future__ import annotations

import importlib
import os
import secrets
import threading
import time

DONE, FAILED, LOST = "done", "failed", "lost"   # LOST: timed out, may still land
PROGRESS_POLL_US = 2000   # the store's UCX progress thread wakes at least this often (events wake it sooner)
_config_lock = threading.Lock()


class NixlUnavailable(Exception):
    """NIXL does not import here, or has no UCX backend."""


def nixl_api():
    """NIXL's Python API. The backend module first: the `nixl` meta package imports torch (a
    second or more on a CPU-only host) only to pick between CUDA builds."""
    errors = []
    for name in ("nixl_cu13._api", "nixl_cu12._api", "nixl._api"):
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise NixlUnavailable("nixl does not import (" + "; ".join(errors)[:300] + ")")


def make_agent(prefix: str, progress_thread: bool):
    """A NIXL agent with the UCX backend, thread-safe, named uniquely (a restarted process gets a
    new name, which is how its peers tell it from the one before).

    progress_thread: a target (the store) must progress its UCX worker for peers' connections
    and, over TCP, their transfers. NIXL's Python wrapper starts that thread with a poll timeout
    of 0, a busy spin that keeps a core 100% busy in an idle kvstore; the config class is
    swapped for one that raises the timeout to PROGRESS_POLL_US while the agent is made
    (measured: ~1.5% of a core idle instead of 100%). An initiator (the client) needs no thread:
    polling a transfer's state progresses its worker."""
    api = nixl_api()
    name = f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"
    conf = api.nixl_agent_config(backends=["UCX"], enable_prog_thread=progress_thread,
                                 sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    bind = api.nixlBind

    class _Config(bind.nixlAgentConfig):
        def __setattr__(self, key, value):
            super().__setattr__(key, max(int(value), PROGRESS_POLL_US) if key == "pthrDelay" else value)

    with _config_lock:
        original, bind.nixlAgentConfig = bind.nixlAgentConfig, _Config
        try:
            agent = api.nixl_agent(name, conf)
        finally:
            bind.nixlAgentConfig = original
    if "UCX" not in agent.backends:
        raise NixlUnavailable("NIXL has no UCX backend here")
    return agent, name


def buffer_address(buf) -> int:
    """The address of a writable buffer's first byte (an mmap, a bytearray, a numpy array)."""
    import ctypes
    c = ctypes.c_ubyte.from_buffer(buf)
    try:
        return ctypes.addressof(c)
    finally:
        del c   # the address stays valid while `buf` lives; the export must not pin it


class Staged:
    """One staging slot of the client's buffer, held for one chunk of one transfer."""

    def __init__(self, plane: "NixlPlane", index: int) -> None:
        self.plane, self.index = plane, index
        self.address = plane.address + index * plane.slot_bytes
        self.view = plane.view[index * plane.slot_bytes:(index + 1) * plane.slot_bytes]
        self.lost = False     # a transfer into or out of it timed out: never used again

    def block(self, j: int, size: int) -> memoryview:
        return self.view[j * size:(j + 1) * size]

    def release(self) -> None:
        self.plane._give_back(self.index, self.lost)


class NixlPlane:
    """This client's NIXL agent and the host buffer it registered, split into `slots` staging
    slots of `slot_bytes` (one per chunk in flight)."""

    def __init__(self, slot_bytes: int, slots: int) -> None:
        import numpy as np
        self.agent, self.name = make_agent("meshllm-kvclient", progress_thread=False)
        self.slot_bytes = slot_bytes
        self.buffer = np.zeros(slot_bytes * slots, dtype=np.uint8)   # [slots * slot_bytes]; pages on first use
        self.address = self.buffer.ctypes.data
        self.view = memoryview(self.buffer)
        self._registered = self.agent.register_memory([(self.address, len(self.buffer), 0, "")], "DRAM")
        self._free = list(range(slots))
        self._cond = threading.Condition()
        self.lost_slots = 0

    def stage(self, deadline: float) -> Staged | None:
        with self._cond:
            while not self._free:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left) and not self._free:
                    return None
            return Staged(self, self._free.pop())

    def _give_back(self, index: int, lost: bool) -> None:
        with self._cond:
            if lost:
                self.lost_slots += 1    # bounded by the slots: with none left, stage() gives None
                return
            self._free.append(index)
            self._cond.notify()

    def load(self, resp) -> "NixlRemote":
        """The store's agent (a NixlMetadataResponse) loaded into ours."""
        return NixlRemote(self, resp)


class NixlRemote:
    """A kvstore's block memory as NIXL READ / WRITE targets. `users` and `retired` are kept
    under the client's lock, like a mapped arena's: it is unloaded once retired and unused."""

    def __init__(self, plane: NixlPlane, resp) -> None:
        loaded = plane.agent.add_remote_agent(resp.agent_metadata)
        self.name = loaded.decode() if isinstance(loaded, bytes) else loaded
        self.plane = plane
        if self.name != resp.agent_name:
            self.close()
            raise ValueError("the NIXL metadata names another agent than the kvstore's")
        self.address = resp.arena_address
        self.size = resp.arena_bytes
        self.users = 0
        self.retired = False

    def valid(self, offset: int, size: int) -> bool:
        """An extent the store named is inside its block memory (never trusted blindly; NIXL
        would refuse one outside the registration too). The first bytes are the arena's nonce."""
        return offset >= 32 and size > 0 and offset + size <= self.size

    def transfer(self, op: str, staged: Staged, pairs: list[tuple[int, int]], block_bytes: int,
                 deadline: float) -> str:
        """READ (store -> staging) or WRITE (staging -> store) of whole blocks: pairs are
        (block j of the staging slot, offset in the store's block memory). DONE, FAILED (it
        ended, with an error) or LOST (not done by `deadline`: it may still land; the slot is
        marked lost)."""
        agent = self.plane.agent
        mine = [(staged.address + j * block_bytes, block_bytes, 0) for j, _ in pairs]
        theirs = [(self.address + offset, block_bytes, 0) for _, offset in pairs]
        try:
            handle = agent.initialize_xfer(op, agent.get_xfer_descs(mine, "DRAM"),
                                           agent.get_xfer_descs(theirs, "DRAM"), self.name)
        except Exception:  # noqa: BLE001 - refused before anything moved
            return FAILED
        state = "ERR"
        try:
            state = agent.transfer(handle)
            pause = 20e-6
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(pause)                 # the GIL is free meanwhile; UCX progresses on its thread
                pause = min(pause * 2, 1e-3)
                state = agent.check_xfer_state(handle)
        except Exception:  # noqa: BLE001 - an error of the transfer is a failed transfer
            state = "ERR"
        if state == "PROC":
            staged.lost = True
        try:
            agent.release_xfer_handle(handle)   # cancels one still in flight, if UCX can
        except Exception:  # noqa: BLE001
            staged.lost = True
        if state == "DONE":
            return DONE
        return LOST if staged.lost else FAILED

    def close(self) -> None:
        try:
            self.plane.agent.remove_remote_agent(self.name)
        except Exception:  # noqa: BLE001 - the store is gone already
            pass

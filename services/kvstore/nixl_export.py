"""The memory backend's block memory offered over NIXL (UCX) to clients that cannot map it
(another host or container; docs/kvstore.md). The store only registers the memfd with its agent
and hands the agent's metadata to clients holding a lease (NixlMetadata); the clients READ the
extents they pinned and WRITE the slots they reserved, one-sided, and the store's UCX worker
progresses on NIXL's own thread. Pins, reservations, leases and checksums are the zero-copy
plane's (transfers.py, store.py): nothing here keeps per-client state."""
from __future__ import annotations

import logging

from services.common.kv_nixl import NixlUnavailable, buffer_address, make_agent
from services.kvstore.arena import SharedFile

log = logging.getLogger("meshllm.kvstore.nixl")


class NixlExport:
    def __init__(self, arena: SharedFile) -> None:
        self.agent, self.name = make_agent("meshllm-kvstore", progress_thread=True)
        self.address = buffer_address(arena.mm)    # offset 0 of the memfd, in this process
        self.size = arena.size
        self._registered = self.agent.register_memory([(self.address, self.size, 0, "")], "DRAM")
        self.metadata = self.agent.get_agent_metadata()

    def close(self) -> None:
        try:
            self.agent.deregister_memory(self._registered)
        except Exception as exc:  # noqa: BLE001 - the process is ending anyway
            log.debug("NIXL deregistration failed: %s", exc)


def start_nixl(wanted: bool | None, arena: SharedFile | None) -> NixlExport | None:
    """NixlExport for --nixl (True) or the default (None: on when it can be); None when off.
    --nixl that cannot be enabled raises (the operator asked for it); the default logs why not."""
    if wanted is False:
        return None
    why = ""
    if arena is None:
        why = "the backend keeps no block memory here (Redis)"
    else:
        try:
            return NixlExport(arena)
        except NixlUnavailable as exc:
            why = str(exc)
        except Exception as exc:  # noqa: BLE001 - UCX failing to start is a reason, not a crash
            why = f"{type(exc).__name__}: {exc}"
    if wanted:
        raise RuntimeError(f"--nixl: the NIXL data plane cannot be enabled: {why}")
    log.warning("NIXL data plane off: %s; clients that cannot map the block memory use gRPC bytes", why)
    return None

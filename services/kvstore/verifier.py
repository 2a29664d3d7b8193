"""The commit verifier: a zero-copy Commit (--verify-on-commit async, the default) answers once
its blocks are recorded with their writer's CRC-32C, unverified (store.commit(verify=False));
this re-computes each block's CRC-32C afterwards on the store's check threads and drops a block
whose bytes do not match (counted: commit_mismatches, meshllm:kvstore_commit_mismatch_blocks;
logged once per burst, never its bytes). On an H200 box the check costs 25-58 ms per GiB on
the CPU against ~18 ms for the writer's DMA: waiting for it made a save 3x slower than the copy.

Until checked, a block is served only where the reader checks it anyway: a Pin's reader verifies
every block it is handed (the protocol's rule, kept by every KvClient read), a Get's bytes are
checked by the store before they are sent, and a block is checked before it spills to disk.

Bounded: at most `max_backlog_bytes` wait to be checked; a Commit that would go past that is
verified before it answers (admit() says False), so a writer faster than the checks is slowed to
their pace instead of the backlog growing. close() abandons what has not started (those blocks
stay unverified: served only to readers that check, never persisted unchecked) and waits a
little for the checks already running."""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("meshllm.kvstore.verifier")

MAX_BACKLOG_BYTES = 4 << 30
LOG_EVERY_S = 10.0   # one log line per burst of mismatches


class CommitVerifier:
    def __init__(self, store, pool: ThreadPoolExecutor, max_backlog_bytes: int = MAX_BACKLOG_BYTES,
                 clock=time.monotonic) -> None:
        self._store = store
        self._pool = pool                  # the store's check threads (server.py's copies)
        self._max = max_backlog_bytes
        self._clock = clock
        self._backlog = 0                  # bytes admitted and not yet checked (or abandoned)
        self._running = 0                  # checks reading bytes now
        self._closed = False
        self._unlogged, self._logged_at = 0, float("-inf")
        self._cond = threading.Condition()

    def admit(self, nbytes: int) -> bool:
        """Room for a Commit of `nbytes` to be checked later; False: check it before answering."""
        with self._cond:
            if self._closed or self._backlog + nbytes > self._max:
                return False
            self._backlog += nbytes
            return True

    def submit(self, ns_id: bytes, blocks: list[tuple[bytes, object]], admitted: int) -> None:
        """Check the (hash, slot) blocks that an admitted Commit stored; the rest of `admitted`
        (refused or EXISTS blocks) is given back at once."""
        self._done(admitted - sum(slot.size for _, slot in blocks))
        for i, (block_hash, slot) in enumerate(blocks):
            try:
                self._pool.submit(self._check, ns_id, block_hash, slot)
            except RuntimeError:    # the pool is shut down: stopping, the rest is abandoned
                self._done(sum(s.size for _, s in blocks[i:]))
                return

    def _check(self, ns_id: bytes, block_hash: bytes, slot) -> None:
        with self._cond:
            if self._closed:
                self._backlog -= slot.size
                self._cond.notify_all()
                return
            self._running += 1
        ok = None
        try:
            ok = self._store.check_committed(ns_id, block_hash, slot)
        except Exception:   # noqa: BLE001 - never lose the accounting; the block stays unverified
            log.exception("commit verifier: a check failed")
        finally:
            with self._cond:
                self._running -= 1
                self._backlog -= slot.size
                if ok is False:
                    self._unlogged += 1
                report = self._unlogged and self._clock() - self._logged_at >= LOG_EVERY_S
                if report:
                    n, self._unlogged, self._logged_at = self._unlogged, 0, self._clock()
                self._cond.notify_all()
        if report:
            log.warning("dropped %d committed block(s) whose bytes did not match their writer's checksum", n)

    def _done(self, nbytes: int) -> None:
        with self._cond:
            self._backlog -= nbytes
            self._cond.notify_all()

    @property
    def backlog_bytes(self) -> int:
        with self._cond:
            return self._backlog

    def drain(self, timeout_s: float) -> bool:
        """Wait until everything admitted is checked; False if `timeout_s` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._backlog == 0, timeout_s)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop checking: queued checks are abandoned; the running ones are waited for (up to
        `timeout_s`), so the block memory is not unmapped under them."""
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: self._running == 0, timeout_s)

"""What the scheduler's readiness means, kept in plain attributes the engine loop sets and
the health thread (services/common/health_thread.py) reads, so the answer is true even when
the loop is saturated or stuck:

- liveness: the process answers (the health thread's "" service);
- readiness: the worker said hello (model loaded, KV pool allocated, the core built over it),
  the engine loop task is running, and we are not shutting down;
- progress: with work pending (requests queued or a step in flight), a step must complete
  at least every `progress_timeout_s`; otherwise NOT_SERVING ("no step completed in ...").
  A hung worker (SIGSTOP, a wedged device) or a blocked loop shows up here, while the
  worker's own process and its step timeout (--step-timeout-s) may still look fine.

The verdict is a pure function of these fields and the time."""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class EngineVitals:
    progress_timeout_s: float = 30.0
    worker_ready: bool = False
    worker_reason: str = "waiting for the worker"
    loop_alive: bool = False
    draining: bool = False
    pending: bool = False
    last_progress: float = 0.0      # monotonic: the last completed step, or when work arrived

    def set_worker(self, ready: bool, reason: str = "") -> None:
        self.worker_ready, self.worker_reason = ready, reason

    def note_pending(self, pending: bool, now: float | None = None) -> None:
        if pending and not self.pending:
            # The clock starts when work arrives, not at the last step before an idle hour.
            self.last_progress = time.monotonic() if now is None else now
        self.pending = pending

    def step_done(self, now: float | None = None) -> None:
        self.last_progress = time.monotonic() if now is None else now

    def verdict(self, now: float | None = None) -> tuple[bool, str]:
        now = time.monotonic() if now is None else now
        if self.draining:
            return False, "shutting down: finishing in-flight requests"
        if not self.loop_alive:
            return False, "the engine loop is not running"
        if not self.worker_ready:
            return False, self.worker_reason or "worker not ready"
        stalled = now - self.last_progress
        if self.pending and stalled > self.progress_timeout_s:
            return False, f"no step completed in {stalled:.0f}s with work pending"
        return True, "ready"

"""The supervisor's pure core: one state machine per replica, fed probe results and clock
readings by the adapter (runner.py), answering "restart it", "give up" or nothing.

No processes, sockets or clocks in here, so every transition is unit-tested with made-up
times (tests/unit/test_supervisor_state.py)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class State(enum.Enum):
    STARTING = "starting"        # processes started, not ready yet
    READY = "ready"
    DRAINING = "draining"        # admin drain: alive, routers send it nothing new
    NOT_READY = "not_ready"      # was ready; readiness NOT_SERVING or the probe went unanswered
    RESTARTING = "restarting"    # failed; waiting out the backoff
    DEAD = "dead"                # gave up


class Probe(enum.Enum):
    SERVING = "serving"
    NOT_SERVING = "not_serving"
    UNREACHABLE = "unreachable"  # no answer in time: a dead port or a hung (SIGSTOPped) process


@dataclass(frozen=True)
class ProbeResult:
    status: Probe
    detail: str = ""


@dataclass(frozen=True)
class Policy:
    """When to call a replica failed and how to restart it."""

    startup_timeout_s: float = 300.0   # STARTING longer than this: failed
    unhealthy_after_s: float = 5.0     # probes unanswered this long (after ready): hung
    unready_after_s: float = 10.0      # NOT_SERVING this long, for replicas restarted when unready
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    max_restarts: int = 5              # restarts in restart_window_s before giving up (DEAD)
    restart_window_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("startup_timeout_s", "unhealthy_after_s", "unready_after_s", "backoff_max_s",
                     "restart_window_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.backoff_initial_s < 0 or self.backoff_initial_s > self.backoff_max_s:
            raise ValueError("backoff_initial_s must be in [0, backoff_max_s]")
        if self.max_restarts < 0:
            raise ValueError("max_restarts must be >= 0")

    def backoff_s(self, recent_restarts: int) -> float:
        """Exponential: initial, 2x, 4x ... capped, by restarts already made in the window."""
        return min(self.backoff_initial_s * (2 ** recent_restarts), self.backoff_max_s)


def worst(probes: list[ProbeResult]) -> ProbeResult:
    """One verdict for a replica of several processes: the worst of theirs."""
    for status in (Probe.UNREACHABLE, Probe.NOT_SERVING):
        for p in probes:
            if p.status is status:
                return p
    return ProbeResult(Probe.SERVING)


@dataclass
class ReplicaMachine:
    """The life of one replica across restarts. Times are monotonic seconds."""

    replica_id: str
    policy: Policy
    restart_when_unready: bool = False
    state: State = State.STARTING
    reason: str = "not started"
    since: float = 0.0
    restarts: int = 0
    draining: bool = False
    restart_times: list[float] = field(default_factory=list)
    restart_at: float | None = None
    _started_at: float = 0.0
    _was_ready: bool = False           # this incarnation has been ready
    _unreachable_since: float | None = None
    _unready_since: float | None = None

    def _set(self, state: State, reason: str, now: float) -> None:
        if state is not self.state or reason != self.reason:
            if state is not self.state:
                self.since = now
            self.state, self.reason = state, reason

    def started(self, now: float) -> None:
        """The adapter (re)started the processes."""
        if self.restart_at is not None:   # a restart, not the first start
            self.restarts += 1
            self.restart_times.append(now)
        self.restart_at = None
        self._started_at, self._was_ready = now, False
        self._unreachable_since = self._unready_since = None
        self._set(State.STARTING, "starting", now)

    def observe(self, now: float, exited: str | None, probes: list[ProbeResult]) -> str | None:
        """Fold in one health round. Returns why the replica failed (the adapter then kills
        what is left of it and calls failed()), or None."""
        if self.state in (State.RESTARTING, State.DEAD):
            return None
        if exited:
            return exited
        verdict = worst(probes)
        if not self._was_ready:
            if verdict.status is Probe.SERVING:
                self._was_ready = True
                self._ready(now)
            elif now - self._started_at > self.policy.startup_timeout_s:
                return (f"not ready {self.policy.startup_timeout_s:.0f}s after start"
                        + (f" ({verdict.detail})" if verdict.detail else ""))
            return None
        if verdict.status is Probe.UNREACHABLE:
            self._unreachable_since = self._unreachable_since if self._unreachable_since is not None else now
            if now - self._unreachable_since >= self.policy.unhealthy_after_s:
                return f"health check unanswered for {now - self._unreachable_since:.0f}s ({verdict.detail})"
            self._not_ready(f"health check unanswered: {verdict.detail}", now)
            return None
        self._unreachable_since = None
        if verdict.status is Probe.NOT_SERVING:
            self._unready_since = self._unready_since if self._unready_since is not None else now
            if (self.restart_when_unready and not self.draining
                    and now - self._unready_since >= self.policy.unready_after_s):
                return f"not ready for {now - self._unready_since:.0f}s: {verdict.detail or 'NOT_SERVING'}"
            self._not_ready(f"not ready: {verdict.detail or 'NOT_SERVING'}", now)
            return None
        self._unready_since = None
        self._ready(now)
        return None

    def _ready(self, now: float) -> None:
        if self.draining:
            self._set(State.DRAINING, "drained by an operator", now)
        else:
            self._set(State.READY, "", now)

    def _not_ready(self, reason: str, now: float) -> None:
        if self.draining:
            self._set(State.DRAINING, f"drained by an operator; {reason}", now)
        else:
            self._set(State.NOT_READY, reason, now)

    def failed(self, now: float, reason: str) -> float | None:
        """The replica failed: schedule a restart after the backoff (returns the delay), or
        give up (DEAD, returns None) after max_restarts restarts inside the window."""
        window = self.policy.restart_window_s
        recent = [t for t in self.restart_times if now - t < window]
        self.restart_times = recent       # bounded: at most max_restarts entries stay
        if len(recent) >= self.policy.max_restarts:
            self.restart_at = None
            self._set(State.DEAD, f"gave up after {len(recent)} restarts in {window:.0f}s; "
                                  f"last failure: {reason}", now)
            return None
        delay = self.policy.backoff_s(len(recent))
        self.restart_at = now + delay
        self._set(State.RESTARTING, f"{reason}; restart in {delay:.1f}s", now)
        return delay

    def restart_due(self, now: float) -> bool:
        return self.state is State.RESTARTING and self.restart_at is not None and now >= self.restart_at

    def drain(self, now: float) -> None:
        self.draining = True
        if self.state in (State.READY, State.NOT_READY):
            self._set(State.DRAINING, "drained by an operator", now)

    def undrain(self, now: float) -> None:
        self.draining = False
        if self.state is State.DRAINING:
            # READY again at once if the last round was healthy, else NOT_READY until it is.
            if self._unready_since is None and self._unreachable_since is None:
                self._set(State.READY, "", now)
            else:
                self._set(State.NOT_READY, "not ready", now)

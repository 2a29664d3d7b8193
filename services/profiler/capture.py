"""One capture session's state, as the profiler service tracks it (no I/O here)."""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from services.common import pb

C = pb.control
FINAL = (C.CAPTURE_STATE_DONE, C.CAPTURE_STATE_FAILED)
ACTIVE = (C.CAPTURE_STATE_STARTING, C.CAPTURE_STATE_RUNNING, C.CAPTURE_STATE_STOPPING)


def new_capture_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


@dataclass
class Target:
    name: str
    address: str
    worker: "pb.control.WorkerProfileStatus | None" = None
    error: str = ""
    started: bool = False            # the worker accepted StartProfile

    @property
    def final(self) -> bool:
        if not self.started:
            return True
        return self.worker is not None and self.worker.state in FINAL


@dataclass
class Capture:
    capture_id: str
    artifact_dir: str
    max_steps: int
    max_seconds: float
    targets: list[Target]
    sampling_ratio: float | None = None
    sampling: list["pb.control.SamplingChange"] = field(default_factory=list)
    started_unix: float = field(default_factory=time.time)
    started: float = field(default_factory=time.monotonic)
    ended: float = 0.0
    stop_requested: str = ""         # "stop" (Stop), or the profiler's own backstop reason
    finished: bool = False           # traces collected (or given up on), sampling restored

    @property
    def state(self) -> int:
        if self.finished:
            return C.CAPTURE_STATE_DONE if self.artifacts else C.CAPTURE_STATE_FAILED
        started = [t for t in self.targets if t.started]
        if not started:
            return C.CAPTURE_STATE_STARTING
        if self.stop_requested or any(t.worker is not None and t.worker.state in
                                      (C.CAPTURE_STATE_STOPPING, *FINAL) for t in started):
            return C.CAPTURE_STATE_STOPPING
        return C.CAPTURE_STATE_RUNNING

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    @property
    def artifacts(self) -> list[str]:
        return [t.worker.trace_path for t in self.targets
                if t.worker is not None and t.worker.state == C.CAPTURE_STATE_DONE and t.worker.trace_path]

    @property
    def stop_reason(self) -> str:
        if self.stop_requested:
            return self.stop_requested
        reasons = {t.worker.stop_reason for t in self.targets if t.worker is not None and t.worker.stop_reason}
        return ",".join(sorted(reasons))

    def to_proto(self, stopped_now: bool = False) -> "pb.control.CaptureStatus":
        end = self.ended or time.monotonic()
        msg = C.CaptureStatus(capture_id=self.capture_id, state=self.state, started_unix_s=self.started_unix,
                              elapsed_s=end - self.started, artifacts=self.artifacts,
                              sampling=self.sampling, artifact_dir=self.artifact_dir,
                              stop_reason=self.stop_reason, stopped_now=stopped_now)
        msg.bounds.max_steps, msg.bounds.max_seconds = self.max_steps, self.max_seconds
        for t in self.targets:
            ts = msg.targets.add(name=t.name, address=t.address, error=t.error)
            if t.worker is not None:
                ts.worker.CopyFrom(t.worker)
        return msg

"""Bounded torch.profiler captures around the worker's engine steps.

The gRPC loop (WorkerControl: `request_start`, `request_stop`, `snapshot`) only records
what it wants under a lock; the engine thread calls `tick` between steps and `run_step`
for each step. torch.profiler's CPU collection is thread-local (it records the ops of the
thread that started it), so each capture gets its own thread that starts the profiler and
runs the engine's steps while the capture lasts; when it ends, the engine thread runs its
steps itself again and the capture thread stops the profiler and writes the Chrome trace
in the background, so serving is not held up by either.

A capture ends at its first bound (steps or seconds), on StopProfile, or on shutdown.
"""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

from services.common import pb
from services.common.profiling import (MAX_CAPTURE_SECONDS, ProfileRequestError, check_bounds,
                                       check_capture_id, resolve_output_dir)

log = logging.getLogger("meshllm.worker.profiling")

STEP_RANGE = "meshllm.step"          # the record_function name of one engine step
_ACTIVE = (pb.control.CAPTURE_STATE_STARTING, pb.control.CAPTURE_STATE_RUNNING,
           pb.control.CAPTURE_STATE_STOPPING)


@dataclass
class _Capture:
    capture_id: str
    activities: list[int]
    max_steps: int
    max_seconds: float
    output_dir: str
    record_shapes: bool
    state: int = pb.control.CAPTURE_STATE_STARTING
    steps: int = 0
    started: float = 0.0             # monotonic, set when torch.profiler starts
    ended: float = 0.0
    stop_request: str = ""           # reason asked for by the gRPC side
    stop_reason: str = ""
    trace_path: str = ""
    trace_bytes: int = 0
    error: str = ""
    thread: "_CaptureThread | None" = field(default=None, repr=False)


class StepProfiler:
    def __init__(self, profile_dir: str, device: str) -> None:
        self.profile_dir = profile_dir
        self.device = device
        self._lock = threading.Lock()
        self._cap: _Capture | None = None
        # Read without the lock on the engine thread's hot path: a stale value costs at
        # most one unannotated step.
        self.active = False

    # ---- gRPC side ------------------------------------------------------------------

    def request_start(self, req: "pb.control.StartProfileRequest") -> "pb.control.WorkerProfileStatus":
        capture_id = check_capture_id(req.capture_id)
        max_steps, max_seconds = check_bounds(req.bounds.max_steps, req.bounds.max_seconds)
        on_gpu = self.device.startswith("cuda")
        activities = sorted(set(req.activities) - {pb.control.PROFILE_ACTIVITY_UNSPECIFIED})
        if not activities:
            activities = [pb.control.PROFILE_ACTIVITY_CPU] + ([pb.control.PROFILE_ACTIVITY_CUDA] if on_gpu else [])
        if pb.control.PROFILE_ACTIVITY_CUDA in activities and not on_gpu:
            raise ProfileRequestError("FAILED_PRECONDITION",
                                      f"CUDA activity asked for, but this worker runs on {self.device}")
        out = resolve_output_dir(req.output_dir, self.profile_dir)
        with self._lock:
            if self._cap is not None and self._cap.state in _ACTIVE:
                raise ProfileRequestError("ALREADY_EXISTS",
                                          f"capture {self._cap.capture_id} is still running on this worker")
            try:
                out.mkdir(parents=True, exist_ok=True, mode=0o700)
            except OSError as exc:
                raise ProfileRequestError("FAILED_PRECONDITION",
                                          f"cannot create {out}: {exc.strerror}") from None
            self._cap = _Capture(capture_id, activities, max_steps, max_seconds, str(out), req.record_shapes)
            self.active = True
            log.info("capture %s requested: max_steps %d max_seconds %.1f activities %s", capture_id,
                     max_steps, max_seconds, [pb.control.ProfileActivity.Name(a) for a in activities])
            return self._status_locked()

    def request_stop(self, capture_id: str = "", reason: str = "stop") -> "pb.control.WorkerProfileStatus":
        with self._lock:
            cap = self._cap
            if cap is not None and cap.state in _ACTIVE and capture_id not in ("", cap.capture_id):
                raise ProfileRequestError("NOT_FOUND", f"capture {capture_id} is not the one running")
            if cap is not None and not cap.stop_request:
                cap.stop_request = reason
            return self._status_locked()

    def snapshot(self) -> "pb.control.WorkerProfileStatus":
        with self._lock:
            return self._status_locked()

    def _status_locked(self) -> "pb.control.WorkerProfileStatus":
        cap = self._cap
        if cap is None:
            return pb.control.WorkerProfileStatus(state=pb.control.CAPTURE_STATE_IDLE, device=self.device)
        now = cap.ended or time.monotonic()
        return pb.control.WorkerProfileStatus(
            capture_id=cap.capture_id, state=cap.state, steps_captured=cap.steps,
            elapsed_s=(now - cap.started) if cap.started else 0.0, trace_path=cap.trace_path,
            stop_reason=cap.stop_reason, error=cap.error, activities=cap.activities,
            device=self.device, trace_bytes=cap.trace_bytes)

    # ---- engine thread --------------------------------------------------------------

    def tick(self) -> None:
        """Between steps: begin a requested capture, end one that is over its bounds."""
        if not self.active:
            return
        cap = self._cap
        if cap is None:
            return
        if cap.state == pb.control.CAPTURE_STATE_STARTING:
            if cap.stop_request:     # stopped before it began: nothing to write
                if cap.thread is None:
                    self._finish_empty(cap)
                else:
                    cap.thread.finish()
                return
            if cap.thread is None:
                # The capture thread starts the profiler (the first start in a process also
                # initialises Kineto, ~1.5 s) while this thread goes on running steps.
                cap.thread = _CaptureThread(self, cap)
                cap.thread.start()
        elif cap.state == pb.control.CAPTURE_STATE_RUNNING:
            elapsed = time.monotonic() - cap.started
            # A steps-only capture on an idle worker still ends, at the hard time cap.
            reason = (cap.stop_request
                      or ("max_steps" if cap.max_steps and cap.steps >= cap.max_steps else "")
                      or ("max_seconds" if elapsed >= (cap.max_seconds or MAX_CAPTURE_SECONDS) else ""))
            if reason:
                with self._lock:
                    cap.state, cap.stop_reason, cap.ended = (pb.control.CAPTURE_STATE_STOPPING, reason,
                                                             time.monotonic())
                log.info("capture %s stopping (%s) after %d steps, %.1fs", cap.capture_id, reason,
                         cap.steps, cap.ended - cap.started)
                cap.thread.finish()   # the capture thread stops the profiler and writes the trace

    def run_step(self, fn):
        """Run one engine step `fn()`: on the capture thread, inside a `meshllm.step` range,
        while a capture runs; here otherwise. Returns what `fn` returns."""
        self.tick()
        cap = self._cap
        if cap is None or cap.state != pb.control.CAPTURE_STATE_RUNNING:
            return fn()
        result = cap.thread.call(fn)
        cap.steps += 1
        self.tick()
        return result

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Engine thread, on exit: end a running capture and wait (bounded) for its file."""
        cap = self._cap
        if cap is None or cap.state not in _ACTIVE:
            return
        cap.stop_request = cap.stop_request or "shutdown"
        self.tick()
        if cap.thread is not None:
            cap.thread.finish()
            cap.thread.join(timeout_s)

    def _finish_empty(self, cap: _Capture) -> None:
        with self._lock:
            cap.state, cap.stop_reason, cap.error = (pb.control.CAPTURE_STATE_FAILED, cap.stop_request,
                                                     "stopped before the capture began")
            self.active = False

    def _fail(self, cap: _Capture, message: str) -> None:
        log.error("capture %s: %s", cap.capture_id, message)
        with self._lock:
            cap.state, cap.error = pb.control.CAPTURE_STATE_FAILED, message
            cap.ended = cap.ended or time.monotonic()
            self.active = False


class _CaptureThread(threading.Thread):
    """Owns one capture's torch.profiler: starts it, runs the steps the engine thread hands
    it (so their ops are recorded here), then stops it and writes the trace.

    Stopping (Kineto collects and post-processes every event: seconds for a long CPU
    capture) and writing happen here, after the engine thread has gone back to running
    steps itself. torch's C++ trace writer holds the GIL throughout, which would stall the
    engine thread, so the file is written by a forked child; if fork fails, here."""

    def __init__(self, owner: StepProfiler, cap: _Capture) -> None:
        super().__init__(name=f"profile-{cap.capture_id}", daemon=True)
        self.owner, self.cap = owner, cap
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._finishing = False

    def call(self, fn):
        """Engine thread: run `fn` here and return its result (or raise its exception)."""
        box: list = []
        done = threading.Event()
        self._calls.put((fn, box, done))
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def finish(self) -> None:
        """Engine thread: no more steps; stop the profiler and write the trace."""
        if not self._finishing:
            self._finishing = True
            self._calls.put(None)

    def run(self) -> None:
        import torch
        cap, owner = self.cap, self.owner
        kinds = {pb.control.PROFILE_ACTIVITY_CPU: torch.profiler.ProfilerActivity.CPU,
                 pb.control.PROFILE_ACTIVITY_CUDA: torch.profiler.ProfilerActivity.CUDA}
        try:
            prof = torch.profiler.profile(activities=[kinds[a] for a in cap.activities],
                                          record_shapes=cap.record_shapes)
            prof.start()
        except Exception as exc:  # noqa: BLE001 - reported through ProfileStatus
            owner._fail(cap, f"torch.profiler could not start: {exc}")
            return
        with owner._lock:
            if cap.state == pb.control.CAPTURE_STATE_STARTING:
                cap.started, cap.state = time.monotonic(), pb.control.CAPTURE_STATE_RUNNING
        log.info("capture %s running", cap.capture_id)
        while (item := self._calls.get()) is not None:
            fn, box, done = item
            try:
                with torch.profiler.record_function(STEP_RANGE):
                    box.append((True, fn()))
            except BaseException as exc:  # noqa: BLE001 - re-raised on the engine thread
                box.append((False, exc))
            done.set()
        t0 = time.monotonic()
        try:
            prof.stop()
        except Exception as exc:  # noqa: BLE001
            owner._fail(cap, f"torch.profiler could not stop: {exc}")
            return
        with owner._lock:
            if cap.state in (pb.control.CAPTURE_STATE_STARTING, pb.control.CAPTURE_STATE_RUNNING):
                cap.state = pb.control.CAPTURE_STATE_STOPPING   # stopped before its first step
                cap.stop_reason, cap.ended = cap.stop_request or "stop", time.monotonic()
        stop_s, t0 = time.monotonic() - t0, time.monotonic()
        name = f"worker-{socket.gethostname()}-{os.getpid()}-{cap.capture_id}.trace.json"
        path = os.path.join(cap.output_dir, name)
        try:
            _write_trace(prof, path)
            size = os.path.getsize(path)
        except Exception as exc:  # noqa: BLE001
            owner._fail(cap, f"writing the trace failed: {exc}")
            return
        with owner._lock:
            cap.trace_path, cap.trace_bytes, cap.state = path, size, pb.control.CAPTURE_STATE_DONE
            owner.active = False
        log.info("capture %s written: %s (%.1f MB; profiler stop %.1fs, write %.1fs)", cap.capture_id, path,
                 size / 1e6, stop_s, time.monotonic() - t0)


def _write_trace(prof, path: str, timeout_s: float = 120.0) -> None:
    """The Chrome trace of a stopped profiler to `path`, atomically (readers never see a
    partial file). A forked child runs torch's GIL-holding writer; the child touches nothing
    but the already collected events and leaves with os._exit."""
    tmp = path + ".part"
    try:
        pid = os.fork()
    except OSError:
        pid = -1
    if pid == 0:   # the child: no Python cleanup, no atexit, no flushing of inherited buffers
        code = 1
        try:
            prof.export_chrome_trace(tmp)
            code = 0
        finally:
            os._exit(code)
    try:
        if pid < 0:
            prof.export_chrome_trace(tmp)
        else:
            deadline = time.monotonic() + timeout_s
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    # A child forked from a threaded process can block on a lock another
                    # thread held at fork time: give up on it and write the file here.
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    status = -1
                    break
                time.sleep(0.02)
            if status == -1 or os.waitstatus_to_exitcode(status) != 0:
                prof.export_chrome_trace(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)

"""The worker's StepProfiler (real torch.profiler on the CPU), the shared capture checks and
the launcher's profiler flags."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from services.common import pb
from services.common.profiling import (DEFAULT_CAPTURE_SECONDS, MAX_CAPTURE_STEPS, ProfileRequestError,
                                       check_bounds, check_capture_id, resolve_output_dir)
from services.profiler.launch import profiler_argv
from services.worker.profiling import STEP_RANGE, StepProfiler

C = pb.control


def _request(root, capture_id="cap1", **bounds) -> "pb.control.StartProfileRequest":
    req = C.StartProfileRequest(capture_id=capture_id, output_dir=os.path.join(root, capture_id))
    req.bounds.max_steps = bounds.get("max_steps", 0)
    req.bounds.max_seconds = bounds.get("max_seconds", 0.0)
    return req


def _run_until_final(prof: StepProfiler, timeout_s: float = 60.0) -> "pb.control.WorkerProfileStatus":
    """Play the engine thread: steps of real torch work until the capture's file is written."""
    x = torch.randn(64, 64)
    deadline = time.monotonic() + timeout_s
    while prof.snapshot().state not in (C.CAPTURE_STATE_DONE, C.CAPTURE_STATE_FAILED):
        assert time.monotonic() < deadline, prof.snapshot()
        prof.tick()
        prof.run_step(lambda: torch.relu(x @ x))
        time.sleep(0.005)   # paced like a serving loop, so the warm-up thread gets the GIL
    return prof.snapshot()


def test_capture_ends_at_its_step_bound_and_writes_the_steps(tmp_path):
    prof = StepProfiler(str(tmp_path), "cpu")
    started = prof.request_start(_request(str(tmp_path), max_steps=4))
    assert started.state == C.CAPTURE_STATE_STARTING
    assert list(started.activities) == [C.PROFILE_ACTIVITY_CPU]
    done = _run_until_final(prof)
    assert done.state == C.CAPTURE_STATE_DONE and done.stop_reason == "max_steps"
    assert done.steps_captured == 4 and done.trace_bytes == os.path.getsize(done.trace_path)
    with open(done.trace_path) as f:
        events = json.load(f)["traceEvents"]
    assert sum(e.get("name") == STEP_RANGE for e in events) == 4
    assert not prof.active


def test_second_start_is_refused_until_the_first_is_written(tmp_path):
    prof = StepProfiler(str(tmp_path), "cpu")
    prof.request_start(_request(str(tmp_path), max_steps=2))
    with pytest.raises(ProfileRequestError) as err:
        prof.request_start(_request(str(tmp_path), "cap2", max_steps=2))
    assert err.value.code == "ALREADY_EXISTS"
    _run_until_final(prof)
    assert prof.request_start(_request(str(tmp_path), "cap2", max_steps=1)).capture_id == "cap2"


def test_stop_before_the_capture_begins_leaves_no_profiler_running(tmp_path):
    prof = StepProfiler(str(tmp_path), "cpu")
    prof.request_start(_request(str(tmp_path), max_seconds=30))
    prof.request_stop()
    prof.tick()
    status = prof.snapshot()
    assert status.state == C.CAPTURE_STATE_FAILED and "before the capture began" in status.error
    assert not prof.active


def test_bad_requests_are_refused_with_a_status(tmp_path):
    prof = StepProfiler(str(tmp_path), "cpu")
    outside = C.StartProfileRequest(capture_id="x", output_dir=str(tmp_path.parent / "elsewhere"))
    cuda = _request(str(tmp_path))
    cuda.activities.append(C.PROFILE_ACTIVITY_CUDA)
    for req, code in ((outside, "INVALID_ARGUMENT"), (cuda, "FAILED_PRECONDITION"),
                      (_request(str(tmp_path), capture_id="../up"), "INVALID_ARGUMENT"),
                      (_request(str(tmp_path), max_seconds=-1), "INVALID_ARGUMENT")):
        with pytest.raises(ProfileRequestError) as err:
            prof.request_start(req)
        assert err.value.code == code
    with pytest.raises(ProfileRequestError) as err:
        StepProfiler("", "cpu").request_start(_request(str(tmp_path)))
    assert err.value.code == "FAILED_PRECONDITION"


def test_bounds_and_ids():
    assert check_bounds(0, 0) == (0, DEFAULT_CAPTURE_SECONDS)
    assert check_bounds(5, 0) == (5, 0)
    for steps, secs in ((-1, 0), (MAX_CAPTURE_STEPS + 1, 0), (0, float("nan")), (0, 1e9)):
        with pytest.raises(ProfileRequestError):
            check_bounds(steps, secs)
    for bad in ("", "..", "a/b", "x" * 65):
        with pytest.raises(ProfileRequestError):
            check_capture_id(bad)


def test_output_dir_must_stay_inside_the_root(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(tmp_path, root / "escape")
    assert resolve_output_dir(str(root / "c1"), str(root)) == root / "c1"
    for bad in (str(root / ".." / "c1"), str(root / "escape" / "c1"), "relative/c1"):
        with pytest.raises(ProfileRequestError):
            resolve_output_dir(bad, str(root))


def test_launcher_gives_the_gateway_key_through_the_environment_only():
    args, env = profiler_argv(7000, {"worker0": "127.0.0.1:1"}, {"tokenizer": "127.0.0.1:2"}, "0.0.0.0:50051",
                              ["--admin-api-key", "secret-admin-1"], {})
    assert "secret-admin-1" not in " ".join(args)
    assert env == {"MESHLLM_CONTROL_API_KEY": "secret-admin-1"}
    assert args[args.index("--gateway-addr") + 1] == "127.0.0.1:50051"
    args, env = profiler_argv(7000, {}, {}, "h:1", ["--admin-api-key-file", "/k"], {})
    assert args[args.index("--control-api-key-file") + 1] == "/k" and env == {}
    # No admin key, or a TLS gateway: the gateway is left out of the sampling fan-out.
    for gw_args in ([], ["--admin-api-key", "secret-admin-1", "--ssl-certfile", "c.pem"]):
        args, _ = profiler_argv(7000, {}, {}, "h:1", gw_args, {})
        assert "--gateway-addr" not in args

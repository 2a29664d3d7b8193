"""Profiler control on a real mesh (SmolLM2 on the CPU): /profile/* on the gateway, the
profiler service's ProfilerControl, the workers' torch.profiler captures and run-time trace
sampling, with an OTLP receiver collecting the spans."""
from __future__ import annotations

import json
import os
import threading
import time

import grpc
import httpx
import pytest

from services.common import pb
from tests.integration.meshproc import start_mesh
from tests.integration.otlp_receiver import OtlpReceiver

ADMIN = "admin-key-h7p-0001"
USER = "user-key-h7p-0001"
C = pb.control


@pytest.fixture(scope="module")
def pmesh(smollm2_dir, tmp_path_factory):
    profile_dir = tmp_path_factory.mktemp("profiles")
    with OtlpReceiver() as rx:
        with pytest.MonkeyPatch.context() as mp:
            # The worker pipelines its steps as on a GPU: a capture must still begin (and end) at
            # a step boundary under streaming load.
            mp.setenv("MESHLLM_OVERLAP_STEPS", "on")
            m = start_mesh(str(smollm2_dir), "--max-model-len", "512", "--max-num-seqs", "8",
                           "--api-key", USER, "--admin-api-key", ADMIN, "--profile-dir", str(profile_dir),
                           "--otlp-traces-endpoint", rx.endpoint)
        m.rx, m.profile_dir = rx, str(profile_dir)
        m.http = httpx.Client(base_url=m.http_url, timeout=30.0,
                              headers={"Authorization": f"Bearer {ADMIN}"})
        try:
            yield m
        finally:
            m.http.close()
            m.stop()


def _complete(m, request_id: str | None = None, max_tokens: int = 8, stream: bool = False) -> int:
    headers = {"x-request-id": request_id} if request_id else {}
    body = {"model": m.model_name, "prompt": "The capital of France is", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream}
    if not stream:
        r = m.http.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["completion_tokens"]
    with m.http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
    return len(chunks)


class _Traffic:
    """Streaming requests in background threads until stopped; counts outcomes."""

    def __init__(self, m, threads: int = 2) -> None:
        self.m, self.ok, self.failed = m, 0, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if _complete(self.m, max_tokens=16, stream=True) >= 1:
                    self.ok += 1
            except Exception as exc:  # noqa: BLE001 - every failure is reported by the test
                self.failed.append(repr(exc))

    def wait_ok(self, n: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.ok < n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.ok >= n, f"only {self.ok} requests finished; failures: {self.failed[:3]}"

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def _status(m) -> dict:
    r = m.http.get("/profile/status")
    assert r.status_code == 200, r.text
    return r.json()


def _wait_state(m, states: tuple[str, ...], timeout_s: float = 60.0, pred=lambda s: True) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        s = _status(m)
        if s["state"] in states and pred(s):
            return s
        assert time.monotonic() < deadline, f"capture never reached {states}: {s}"
        time.sleep(0.1)


def _final(m) -> dict:
    return _wait_state(m, ("CAPTURE_STATE_DONE", "CAPTURE_STATE_FAILED"))


def _profiler_stub(m):
    return pb.control_grpc.ProfilerControlStub(grpc.insecure_channel(m.services()["profiler"]))


def _sampling(addr: str, metadata=()) -> float:
    with grpc.insecure_channel(addr) as ch:
        stub = pb.control_grpc.TelemetryControlStub(ch)
        return stub.GetTraceSampling(C.GetTraceSamplingRequest(), timeout=5, metadata=metadata).ratio


def _all_sampling(m) -> dict[str, float]:
    svc = m.services()
    out = {name: _sampling(svc[name]) for name in ("tokenizer", "scheduler", "worker-health")}
    out["gateway"] = _sampling(m.grpc_addr, (("authorization", f"Bearer {ADMIN}"),))
    return out


def test_capture_under_streaming_load_writes_a_chrome_trace_of_worker_steps(pmesh):
    traffic = _Traffic(pmesh)
    try:
        traffic.wait_ok(2)
        r = pmesh.http.post("/profile/start", json={"max_seconds": 60})
        assert r.status_code == 200, r.text
        capture_id = r.json()["capture_id"]
        # One capture at a time: refused on HTTP (409) and on gRPC (ALREADY_EXISTS).
        again = pmesh.http.post("/profile/start", json={"max_seconds": 5})
        assert again.status_code == 409, again.text
        with pytest.raises(grpc.RpcError) as err:
            _profiler_stub(pmesh).Start(C.StartCaptureRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        _wait_state(pmesh, ("CAPTURE_STATE_RUNNING",),
                    pred=lambda s: s["targets"][0]["worker"]["steps_captured"] >= 3)
        before = traffic.ok
        t0 = time.monotonic()
        r = pmesh.http.post("/profile/stop")
        took = time.monotonic() - t0
        assert r.status_code == 200 and r.json()["stopped_now"] is True, r.text
        assert took < 1.0, f"stop took {took:.2f}s"
        done = _final(pmesh)
        traffic.wait_ok(before + 2)   # serving went on while the trace was written
    finally:
        traffic.stop()
    assert not traffic.failed, traffic.failed[:3]
    assert done["capture_id"] == capture_id and done["state"] == "CAPTURE_STATE_DONE", done
    assert done["stop_reason"] == "stop"
    worker = done["targets"][0]["worker"]
    [path] = done["artifacts"]
    assert path == worker["trace_path"] and path.startswith(pmesh.profile_dir + os.sep)
    with open(path) as f:
        trace = json.load(f)
    steps = [e for e in trace["traceEvents"] if e.get("name") == "meshllm.step" and e.get("ph") == "X"
             and e.get("cat") == "user_annotation"]
    assert len(steps) == worker["steps_captured"] >= 3
    # The steps ran the model: torch ops appear inside them.
    assert any(e.get("cat") == "cpu_op" and e.get("name", "").startswith("aten::") for e in trace["traceEvents"])


def test_capture_bounded_by_seconds_or_steps_ends_without_stop(pmesh):
    r = pmesh.http.post("/profile/start", json={"max_seconds": 1.0})
    assert r.status_code == 200, r.text
    done = _final(pmesh)
    assert done["state"] == "CAPTURE_STATE_DONE" and done["stop_reason"] == "max_seconds", done
    assert os.path.isfile(done["artifacts"][0])

    traffic = _Traffic(pmesh, threads=1)
    try:
        traffic.wait_ok(1)
        r = pmesh.http.post("/profile/start", json={"max_steps": 3, "max_seconds": 60})
        assert r.status_code == 200, r.text
        done = _final(pmesh)
    finally:
        traffic.stop()
    assert not traffic.failed, traffic.failed[:3]
    assert done["stop_reason"] == "max_steps", done
    assert done["targets"][0]["worker"]["steps_captured"] == 3


def test_trace_sampling_change_applies_to_the_next_requests_and_is_restored(pmesh):
    assert set(_all_sampling(pmesh).values()) == {1.0}
    r = pmesh.http.post("/profile/start", json={"max_seconds": 60, "trace_sampling_ratio": 0.0})
    assert r.status_code == 200, r.text
    changes = {c["service"]: c for c in r.json()["sampling"]}
    assert set(changes) >= {"gateway", "tokenizer", "scheduler", "worker"}
    assert all(not c["error"] and c["ratio"] == 0.0 for c in changes.values()), changes
    assert set(_all_sampling(pmesh).values()) == {0.0}
    for i in range(2):
        _complete(pmesh, f"h7p-unsampled-{i}")
    pmesh.http.post("/profile/stop")
    done = _final(pmesh)
    assert all(c["restored"] for c in done["sampling"]), done["sampling"]
    assert set(_all_sampling(pmesh).values()) == {1.0}
    for i in range(2):
        _complete(pmesh, f"h7p-sampled-{i}")

    def request_ids(spans):
        return {s.attributes.get("meshllm.http_request_id") for s in spans if s.service.endswith("gateway")}
    spans = pmesh.rx.wait_for(lambda s: {f"h7p-sampled-{i}" for i in range(2)} <= request_ids(s))
    # Spans of one process export in order: the unsampled requests' would have come first.
    assert not {f"h7p-unsampled-{i}" for i in range(2)} & request_ids(spans)


def test_profile_routes_need_the_admin_key_and_validate_input(pmesh):
    url = pmesh.http_url
    assert httpx.get(f"{url}/profile/status").status_code == 401
    user = {"Authorization": f"Bearer {USER}"}
    assert httpx.get(f"{url}/profile/status", headers=user).status_code == 401
    assert httpx.post(f"{url}/profile/start", headers=user).status_code == 401
    assert _status(pmesh)["state"] in ("CAPTURE_STATE_IDLE", "CAPTURE_STATE_DONE")
    # The public gRPC port: TelemetryControl is admin-only too.
    for md in ((), (("authorization", f"Bearer {USER}"),)):
        with pytest.raises(grpc.RpcError) as err:
            _sampling(pmesh.grpc_addr, md)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for body, status in (({"max_seconds": -1}, 400), ({"max_steps": 10**9}, 400),
                         ({"activities": ["gpu"]}, 400), ({"targets": ["nope"]}, 400),
                         ({"surprise": 1}, 400), ({"trace_sampling_ratio": 2}, 400),
                         ({"activities": ["cuda"]}, 409)):   # a CPU worker refuses CUDA
        r = pmesh.http.post("/profile/start", json=body)
        assert r.status_code == status, (body, r.text)
    assert pmesh.http.post("/profile/start", content=b"{not json").status_code == 400


def test_simulated_worker_refuses_captures_with_a_reason(smollm2_dir, tmp_path):
    import re
    import select
    import subprocess
    import sys

    from services.common.procs import die_with_parent
    cmd = [sys.executable, "-m", "services.worker", "--simulate", "--model", str(smollm2_dir),
           "--zmq-addr", "tcp://127.0.0.1:0", "--grpc-port", "0", "--profile-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            preexec_fn=die_with_parent)
    try:
        line, deadline = "", time.monotonic() + 60
        while "worker listening" not in line:
            assert proc.poll() is None, f"worker exited with {proc.returncode}"
            assert time.monotonic() < deadline, "the simulated worker did not print its addresses"
            if select.select([proc.stdout], [], [], 1.0)[0]:
                line = proc.stdout.readline()
        addr = re.search(r"grpc=(\S+)", line).group(1)
        with grpc.insecure_channel(addr) as ch:
            stub = pb.control_grpc.WorkerControlStub(ch)
            req = C.StartProfileRequest(capture_id="sim", output_dir=str(tmp_path / "sim"))
            with pytest.raises(grpc.RpcError) as err:
                stub.StartProfile(req, timeout=10)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "simulated worker" in err.value.details()
            assert stub.ProfileStatus(C.ProfileStatusRequest(), timeout=10).state == C.CAPTURE_STATE_IDLE
    finally:
        proc.terminate()
        proc.wait(30)

"""Request lifecycle: client disconnects abort work in the scheduler; the launcher owns its services."""
from __future__ import annotations

import os
import signal
import time

import grpc
import httpx

from services.common import pb
from tests.integration.meshproc import alive, service_name, start_mesh


def scheduler_load(mesh) -> pb.engine.LoadInfo:
    with grpc.insecure_channel(mesh.services()["scheduler"]) as ch:
        return pb.engine_grpc.EngineStub(ch).GetLoad(pb.engine.GetLoadRequest(), timeout=10)


def wait_idle(mesh, timeout_s=10.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        load = scheduler_load(mesh)
        if load.num_running == 0 and load.num_waiting == 0:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"scheduler still busy {timeout_s}s after the client left: {scheduler_load(mesh)}")


def test_closing_a_stream_aborts_the_request_in_the_scheduler(mesh):
    body = {"model": mesh.model_name, "prompt": "Tell me a long story.", "max_tokens": 1500, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=mesh.http_url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                if got >= 3:
                    break
            assert scheduler_load(mesh).num_running == 1
    assert wait_idle(mesh) < 5.0


def test_client_timeout_on_a_non_streaming_request_aborts_it(mesh):
    body = {"model": mesh.model_name, "prompt": "Tell me a long story.", "max_tokens": 1500, "ignore_eos": True}
    with httpx.Client(base_url=mesh.http_url, timeout=1.5) as c:
        try:
            c.post("/v1/completions", json=body)
            raise AssertionError("a 1500-token completion should not finish in 1.5 s on this CPU")
        except httpx.TimeoutException:
            pass
    assert wait_idle(mesh) < 5.0


def test_grpc_cancel_aborts_the_request(mesh):
    with grpc.insecure_channel(mesh.grpc_addr) as ch:
        stub = pb.generation_grpc.GenerationStub(ch)
        call = stub.Generate(pb.generation.GenerateRequest(
            model=mesh.model_name, text="Once upon a time",
            sampling=pb.common.SamplingParams(max_tokens=1500, ignore_eos=True)), timeout=120)
        next(call)
        call.cancel()
    assert wait_idle(mesh) < 5.0


def test_killing_the_launcher_leaves_no_service_running(smollm2_dir, minilm_dir):
    m = start_mesh(str(smollm2_dir), "--max-model-len", "512", "--embedding-model", str(minilm_dir))
    pids = m.service_pids()
    names = {service_name(p) for p in pids}
    assert {"supervisor", "worker", "tokenizer", "scheduler", "embedder", "gateway"} <= names, names
    os.kill(m.proc.pid, signal.SIGKILL)
    m.proc.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"services still running after the launcher was killed: {left}"

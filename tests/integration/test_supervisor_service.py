"""`python -m services.supervisor` on its own: a replica that keeps failing is given up on
(DEAD, with the reason and the restart count), a bad spec is a clear error, and a killed
supervisor takes its children with it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import grpc

from services.common import pb
from services.common.ports import free_port
from tests.integration.meshproc import ROOT, alive, descendants_of


def _supervisor(tmp_path, spec: dict, *flags: str) -> tuple[subprocess.Popen, str]:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    port = free_port()
    # Logs go to a file: a pipe nobody reads while the test waits could fill and block them.
    log = open(tmp_path / f"supervisor-{port}.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "services.supervisor", "--spec", str(path), "--port", str(port),
                             "--health-interval-s", "0.2", *flags], cwd=ROOT, stdin=subprocess.DEVNULL,
                            stdout=log, stderr=log)
    proc.log = log
    return proc, f"127.0.0.1:{port}"


def _stderr(proc) -> str:
    proc.wait(30)
    proc.log.seek(0)
    return proc.log.read()


def _list(addr: str) -> dict[str, pb.supervisor.Replica]:
    with grpc.insecure_channel(addr) as ch:
        rs = pb.supervisor_grpc.SupervisorStub(ch).ListReplicas(pb.supervisor.ListReplicasRequest(), timeout=5)
    return {r.id: r for r in rs.replicas}


def _until(addr: str, pred, timeout_s: float = 60.0):
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            last = _list(addr)
            if pred(last):
                return last
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"condition not met in {timeout_s}s: {last}")


def _tokenizer(replica_id: str, model: str, port: int) -> dict:
    return {"id": replica_id, "kind": "REPLICA_KIND_TOKENIZER", "addr": f"127.0.0.1:{port}",
            "processes": [{"module": "tokenizer", "args": ["--model", model, "--port", str(port)],
                           "healthAddr": f"127.0.0.1:{port}", "healthService": "tokenizer"}]}


def test_a_replica_that_keeps_failing_ends_dead_and_its_healthy_neighbour_is_untouched(tmp_path, smollm2_dir):
    spec = {"replicas": [_tokenizer("broken", str(tmp_path / "no-such-model"), free_port()),
                         _tokenizer("good", str(smollm2_dir), free_port())]}
    proc, addr = _supervisor(tmp_path, spec, "--max-restarts", "2", "--backoff-initial-s", "0.1")
    try:
        seen = _until(addr, lambda rs: rs["broken"].state == pb.supervisor.REPLICA_STATE_DEAD
                      and rs["good"].state == pb.supervisor.REPLICA_STATE_READY)
        broken, good = seen["broken"], seen["good"]
        assert broken.restarts == 2 and "gave up after 2 restarts" in broken.reason
        assert "tokenizer" in broken.reason and "exited with code" in broken.reason
        assert not broken.pids
        assert good.restarts == 0 and len(good.pids) == 1
        children = descendants_of(proc.pid)
        assert children == list(good.pids), "the dead replica leaves no process behind"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0
    assert not alive(good.pids[0])


def test_a_killed_supervisor_takes_its_children_with_it(tmp_path, smollm2_dir):
    spec = {"replicas": [_tokenizer("tok", str(smollm2_dir), free_port())]}
    proc, addr = _supervisor(tmp_path, spec)
    try:
        pids = list(_until(addr, lambda rs: rs["tok"].state == pb.supervisor.REPLICA_STATE_READY)["tok"].pids)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), "PR_SET_PDEATHSIG: children must not outlive the supervisor"


def test_a_bad_spec_is_a_clear_error(tmp_path):
    bad = {"replicas": [{"id": "x", "processes": [{"module": "rm -rf /", "args": []}]}]}
    proc, _ = _supervisor(tmp_path, bad)
    err = _stderr(proc)
    assert proc.returncode == 2 and "module must be a service name" in err
    proc, _ = _supervisor(tmp_path, {"replicas": [{"id": "x", "nonsense": 1}]})
    err = _stderr(proc)
    assert proc.returncode == 2 and "nonsense" in err

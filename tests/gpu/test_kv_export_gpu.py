"""CUDA only: the direct hand-off's CUDA IPC path (services/worker/kv_export.py) between two
processes on one GPU: the decode side's KvTiers copies the prefill side's blocks device to device
and they equal what a plain mapping of the peer's cache shows (the CPU twin is
tests/unit/test_worker_kv_export.py's memfd case)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_ipc_hand_off_between_two_processes(tmp_path):
    portfile, donefile = tmp_path / "port", tmp_path / "done"
    proc = subprocess.Popen([sys.executable, "-m", "tests.unit.kv_export_peer", "prefill", str(portfile),
                             str(donefile), "mmap", "cuda"])
    try:
        deadline = time.monotonic() + 120
        while not (portfile.exists() and portfile.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "the peer did not start"
            time.sleep(0.05)
        addr = f"127.0.0.1:{portfile.read_text().split()[0]}"
        out = subprocess.run([sys.executable, "-m", "tests.unit.kv_export_peer", "decode", addr, "mmap", "cuda"],
                             capture_output=True, text=True, timeout=120)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert out.returncode == 0, (result, out.stderr[-2000:])
        assert result["loaded"] == 4 and result["same"] and result["untouched"]
    finally:
        donefile.write_text("1")
        proc.wait(30)

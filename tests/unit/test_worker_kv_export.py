"""The direct hand-off's shared KV cache (services/worker/kv_export.py) on the CPU: an exported
cache mapped through /proc/<pid>/fd shows the exporter's bytes, and a mapping that is not the
peer's (wrong token, another host, another model's shape) is refused. Between two real worker
processes: tests/integration/test_pd.py."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from services.worker.kv_export import ExportedCache, PeerCache

SHAPE = (2, 12, 4, 3, 8)   # [K/V, blocks, block_size, kv_heads, head_dim]


def test_a_mapped_export_shows_the_exporters_bytes():
    exp = ExportedCache(3, SHAPE, torch.float32, torch.device("cpu"))
    for layer in exp.layers:
        layer.copy_(torch.randn(SHAPE))
    peer = PeerCache(exp.describe(), SHAPE, torch.float32, torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(exp.layers, peer.layers))
    exp.layers[1][0, 5].fill_(7.0)   # shared memory: a later write shows through
    assert torch.equal(peer.layers[1][0, 5], torch.full_like(peer.layers[1][0, 5], 7.0))
    # A peer with more blocks is fine (only the per-block shape must match).
    PeerCache(exp.describe(), (2, 40, 4, 3, 8), torch.float32, torch.device("cpu")).close()
    peer.close()


@pytest.mark.parametrize("break_it", ["token", "boot_id", "shape", "dtype"])
def test_a_mapping_that_is_not_the_peers_cache_is_refused(break_it):
    exp = ExportedCache(2, SHAPE, torch.float32, torch.device("cpu"))
    desc = exp.describe()
    shape, dtype = SHAPE, torch.float32
    if break_it == "token":
        desc.token = bytes(32)
    elif break_it == "boot_id":
        desc.boot_id = "another-host"
    elif break_it == "shape":
        shape = (2, 12, 4, 3, 16)
    else:
        dtype = torch.bfloat16
    with pytest.raises(ValueError):
        PeerCache(desc, shape, dtype, torch.device("cpu"))


def _peer(tmp_path, transport: str):
    portfile, donefile = tmp_path / "port", tmp_path / "done"
    proc = subprocess.Popen([sys.executable, "-m", "tests.unit.kv_export_peer", "prefill", str(portfile),
                             str(donefile), transport])
    deadline = time.monotonic() + 60
    while not (portfile.exists() and portfile.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, "the peer did not start"
        time.sleep(0.05)
    port, has_nixl = portfile.read_text().split()
    return proc, donefile, f"127.0.0.1:{port}", has_nixl == "1"


@pytest.mark.parametrize("transport", ["mmap", "nixl"])
def test_a_handed_off_block_is_copied_from_another_process_over_each_transport(tmp_path, transport):
    """A decode-side process's KvTiers copies a prefill-side process's blocks (src ids) into its
    own (dst ids): through the mapped memfd, and through NIXL (UCX) as between two hosts. Both
    ends are subprocesses: NIXL's bundled libraries abort a process that already loaded
    grpc_tools' compiler (this test process may have), so it is never imported here."""
    proc, donefile, addr, has_nixl = _peer(tmp_path, transport)
    try:
        assert has_nixl == (transport == "nixl"), "NIXL must be installed (requirements.txt)"
        out = subprocess.run([sys.executable, "-m", "tests.unit.kv_export_peer", "decode", addr, transport],
                             capture_output=True, text=True, timeout=120)
        result = json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else {}
        assert out.returncode == 0, (result, out.stderr[-2000:])
        assert result["via"] == transport and result["loaded"] == 4 and result["same"] and result["untouched"]
    finally:
        donefile.write_text("1")
        proc.wait(30)

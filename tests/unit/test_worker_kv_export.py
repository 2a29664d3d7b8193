"""The direct hand-off's shared KV cache (services/worker/kv_export.py) on the CPU: an exported
cache mapped through /proc/<pid>/fd shows the exporter's bytes, and a mapping that is not the
peer's (wrong token, another host, another model's shape) is refused. Between two real worker
processes: tests/integration/test_pd.py."""
from __future__ import annotations

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


def _peer(tmp_path):
    import subprocess
    import sys
    import time
    portfile, donefile = tmp_path / "port", tmp_path / "done"
    proc = subprocess.Popen([sys.executable, "-m", "tests.unit.kv_export_peer", str(portfile), str(donefile)])
    deadline = time.monotonic() + 60
    while not (portfile.exists() and portfile.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, "the peer did not start"
        time.sleep(0.05)
    port, has_nixl = portfile.read_text().split()
    return proc, donefile, f"127.0.0.1:{port}", has_nixl == "1"


@pytest.mark.parametrize("transport", ["mmap", "nixl"])
def test_a_handed_off_block_is_copied_from_another_process_over_each_transport(tmp_path, transport):
    """The decode side's KvTiers copies a peer process's blocks (src ids) into its own (dst ids):
    through the mapped memfd, and through NIXL (UCX) as between two hosts."""
    from services.worker.kv_export import Peers
    from services.worker.kv_tiers import KvTiers, TierConfig
    from services.worker.plan import TierBlocks
    from tests.unit.kv_export_peer import LAYERS
    proc, donefile, addr, has_nixl = _peer(tmp_path)
    try:
        assert has_nixl, "NIXL must be installed (requirements.txt)"
        shape = (2, 16, 4, 3, 8)
        local = ExportedCache(LAYERS, shape, torch.float32, torch.device("cpu"))
        tiers = KvTiers(local.layers, 4, TierConfig(direct=True, direct_transport=transport), local)
        src, dst = [3, 4, 11, 19], [0, 7, 8, 15]
        tiers.start_loads([TierBlocks("r", dst, [], addr, src)])
        got = []
        for _ in range(200):
            got = tiers.take_loads(0.05)
            if got:
                break
        assert got and got[0].num_loaded == 4, got
        # The peer's bytes, read through a plain mapping of its cache.
        truth = Peers(None, shape, torch.float32, torch.device("cpu"), transport="mmap").get(addr)
        for mine, theirs in zip(local.layers, truth.layers):
            assert torch.equal(mine[:, dst], theirs[:, src])
            assert not mine[:, 1].any()   # nothing else was written
        tiers.close()
    finally:
        donefile.write_text("1")
        proc.wait(30)

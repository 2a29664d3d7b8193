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

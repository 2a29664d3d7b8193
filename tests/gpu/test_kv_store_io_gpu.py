"""CUDA only: kvstore saves and loads straight between the device and a real kvstore's memory
(services/worker/kv_store_io.py): the client's arena mapping is registered with CUDA, the saved
bytes equal the cache's, and a load into other blocks brings them back bit for bit (the CPU
twin is tests/unit/test_worker_kv_tiers.py's ArenaStore case); a block saved with a wrong device
checksum is refused by a load's GPU check and dropped by the store's check after the Commit."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ROOT = Path(__file__).resolve().parents[2]


def _corrupt_in_arena(addr: str, ns, block_hash: bytes) -> None:
    """Flip a byte of a stored block in the store's memory (tests/integration/test_kvstore.py's
    corrupt_in_arena, without that module's TLS imports)."""
    import mmap
    import os

    import grpc

    import services  # noqa: F401
    from meshllm.v1 import kv_pb2, kv_pb2_grpc
    with grpc.insecure_channel(addr) as ch:
        stub = kv_pb2_grpc.KvStoreStub(ch)
        opened = stub.OpenArena(kv_pb2.OpenArenaRequest(zero_copy=True), timeout=5)
        lease = kv_pb2.ShmWindow(lease_id=opened.lease_id)
        pin = stub.Pin(kv_pb2.PinRequest(namespace=ns, block_hashes=[block_hash], lease=lease), timeout=5)
        fd = os.open(opened.path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, opened.arena_bytes)
        finally:
            os.close(fd)
        mm[pin.blocks[0].offset + 100] ^= 0xFF
        mm.close()
        stub.Release(kv_pb2.ReleaseRequest(lease=lease, read_id=pin.read_id), timeout=5)
        stub.CloseArena(kv_pb2.CloseArenaRequest(window=lease), timeout=5)


def test_device_to_store_and_back_through_the_registered_arena(tmp_path):
    from services.common.kv_blocks import kv_pb2
    from services.common.kv_client import KvClient
    from services.common.ports import free_port
    from services.worker.kv_tiers import LAYOUT, KvTiers, TierConfig
    from services.worker.plan import TierBlocks

    port = free_port()
    log = open(tmp_path / "kvstore.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "services.kvstore", "--port", str(port), "--capacity-gb", "0.5"],
                            cwd=ROOT, stdout=log, stderr=log)
    client = None
    try:
        client = KvClient(f"127.0.0.1:{port}", timeout_s=10.0)
        deadline = time.monotonic() + 60
        while client.stats() is None:
            assert proc.poll() is None and time.monotonic() < deadline, open(tmp_path / "kvstore.log").read()[-2000:]
            time.sleep(0.2)
        layers, blocks, bs, kvh, hd = 4, 64, 16, 8, 128
        caches = [torch.randn((2, blocks, bs, kvh, hd), dtype=torch.bfloat16, device="cuda") for _ in range(layers)]

        def ns(block_size: int, block_bytes: int):
            return kv_pb2.KvNamespace(model_id="gpu-test", weights_fingerprint="x", dtype="bfloat16",
                                      kv_cache_dtype="bfloat16", block_size=block_size, num_layers=layers,
                                      tp_size=1, tp_rank=0, block_bytes=block_bytes, layout=LAYOUT)
        tiers = KvTiers(caches, bs, TierConfig(client=client, make_namespace=ns, load_timeout_s=30.0))
        src, dst = list(range(1, 21)), list(range(30, 50))
        hashes = [i.to_bytes(4, "little") + b"gpu" for i in src]
        tiers.save([TierBlocks("s", src, hashes)])
        assert tiers.flush_saves(60.0)
        [saved] = tiers.take_saves()
        assert saved.num_saved == len(src)
        assert client.transport == "arena"
        maps = list(tiers.store_io.maps._maps.values())
        assert maps and all(registered for _, _, _, registered in maps)   # cudaHostRegister took it
        tiers.start_loads([TierBlocks("l", dst, hashes)])
        got = []
        deadline = time.monotonic() + 60
        while not got and time.monotonic() < deadline:
            got = tiers.take_loads(1.0)
        assert got and got[0].num_loaded == len(dst)
        torch.cuda.synchronize()
        for c in caches:
            assert torch.equal(c[:, src].view(torch.int16), c[:, dst].view(torch.int16))
        # The checksums were the GPU's (kv_block_crc.py); a block corrupted in the store's memory
        # fails it where it landed: the load stops there (a miss, recomputed) and the store drops it.
        assert tiers.store_io.crc is not None
        gpu_crc = tiers.store_io.crc
        before = client.stats().corrupt_blocks
        _corrupt_in_arena(client.address, tiers.namespace, hashes[7])

        def load(into: list[int], names: list[bytes] = hashes) -> int:
            tiers.start_loads([TierBlocks("l", into, names)])
            done, end = [], time.monotonic() + 60
            while not done and time.monotonic() < end:
                done = tiers.take_loads(1.0)
            assert done
            return done[0].num_loaded
        assert load(dst) == 7
        assert client.stats().corrupt_blocks == before + 1 and client.lookup(tiers.namespace, hashes) == 7
        # The CPU's checksums (no GPU one) load the same leading blocks.
        tiers.store_io.crc = None
        assert load(list(range(50, 70))) == 7
        # A save with one wrong device checksum (block 2): its Commit answers before the store's
        # check, the GPU's check of a load refuses the block, and the store drops it.
        tiers.store_io.crc = gpu_crc

        def wrong_crc(flat: torch.Tensor) -> torch.Tensor:
            crcs = gpu_crc(flat).clone()
            crcs[2] ^= 1
            return crcs
        tiers.store_io.crc = wrong_crc
        bad = [i.to_bytes(4, "little") + b"gpu-bad" for i in src]
        tiers.save([TierBlocks("s2", src, bad)])
        assert tiers.flush_saves(60.0)
        [saved] = tiers.take_saves()
        assert saved.num_saved == len(src)
        tiers.store_io.crc = gpu_crc
        assert load(dst, bad) == 2
        deadline = time.monotonic() + 10
        while client.lookup(tiers.namespace, bad) != 2:
            assert time.monotonic() < deadline, "the block saved with a wrong checksum was never dropped"
            time.sleep(0.05)
        tiers.close()
    finally:
        if client is not None:
            client.close()
        proc.terminate()
        proc.wait(10)

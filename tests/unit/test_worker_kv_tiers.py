"""The worker's KV tiers (services/worker/kv_tiers.py) under the real scheduler core, both ends
through their wire edges as in the mesh: block bytes survive gather/scatter, a prompt computed by
one engine is fetched by another with token-identical greedy output, and a working set larger
than the device pool is served from host memory. The store here is a dict behind the KvClient's
interface (the real kvstore process is tests/integration/test_kv_tiers.py's)."""
from __future__ import annotations

import pytest
import torch

from services.common.kv_namespace import engine_namespace
from services.scheduler import wire as sched_wire
from services.scheduler.core import Request, Scheduler, SchedulerConfig
from services.worker.kv_tiers import LAYOUT, KvTiers, TierConfig
from services.worker.models import load_model
from services.worker.runner import ModelRunner
from services.worker.wire import ProtoRunner
from tests.unit.tiny_llama import VOCAB, make_tiny_llama

BS = 4


class DictStore:
    """The KvClient calls the worker and the scheduler make, over a dict (no arena here: the
    worker takes the copying calls)."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, bytes] = {}
        self.gets = 0

    def set_arena_hooks(self, on_map, on_unmap) -> None:
        pass

    def read_zero_copy(self, ns, hashes, consume):
        return None

    def write_zero_copy(self, ns, hashes, fill):
        return None

    def lookup(self, ns, hashes) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.blocks:
            n += 1
        return n

    def put(self, ns, blocks) -> int:
        for h, buf in blocks:
            data = bytes(memoryview(buf).cast("B"))
            assert len(data) == ns.block_bytes
            self.blocks[h] = data
        return len(blocks)

    def get_into(self, ns, hashes, dests) -> list[bool]:
        self.gets += 1
        found = []
        for h, d in zip(hashes, dests):
            data = self.blocks.get(h)
            if data is not None:
                memoryview(d).cast("B")[:] = data
            found.append(data is not None)
        return found


class ArenaStore(DictStore):
    """... and the zero-copy calls over one mapping, as the KvClient gives them on the kvstore's
    host: the worker copies blocks straight out of (and into) the store's memory (kv_store_io.py).
    Chunks of 5 blocks, each chunk's slots in two runs of adjacent ones."""

    CHUNK = 5

    def __init__(self, slots: int = 64, block_bytes: int = 0) -> None:
        super().__init__()
        self.slots, self.block_bytes = slots, block_bytes
        self.mm = None
        self.slot_of: dict[bytes, int] = {}
        self.next_slot = -1
        self.zero_copy_reads = self.zero_copy_writes = 0

    def set_arena_hooks(self, on_map, on_unmap) -> None:
        self._on_map = on_map

    def _map(self, ns) -> None:
        if self.mm is None:
            import mmap
            self.block_bytes = ns.block_bytes
            self.mm = mmap.mmap(-1, self.slots * ns.block_bytes)
            self._on_map(self.mm)

    def _view(self, slot: int) -> memoryview:
        return memoryview(self.mm)[slot * self.block_bytes:(slot + 1) * self.block_bytes]

    def lookup(self, ns, hashes) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.slot_of:
            n += 1
        return n

    def read_zero_copy(self, ns, hashes, consume):
        self._map(ns)
        found = []
        for i in range(0, len(hashes), self.CHUNK):
            views = [self._view(self.slot_of[h]).toreadonly() if h in self.slot_of else None
                     for h in hashes[i:i + self.CHUNK]]
            consume(i, views)
            found += [v is not None for v in views]
        self.zero_copy_reads += 1
        return found

    def write_zero_copy(self, ns, hashes, fill):
        self._map(ns)
        for i in range(0, len(hashes), self.CHUNK):
            idx = [j for j in range(i, min(i + self.CHUNK, len(hashes))) if hashes[j] not in self.slot_of]
            if not idx:
                continue
            slots = []
            for k in range(len(idx)):
                self.next_slot += 2 if k == 2 else 1   # a gap before the third: two runs
                slots.append(self.next_slot)
            fill(i, idx, [self._view(s) for s in slots])
            for j, s in zip(idx, slots):
                self.slot_of[hashes[j]] = s
                self.blocks[hashes[j]] = bytes(self._view(s))
        self.zero_copy_writes += 1
        return sum(h in self.slot_of for h in hashes)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-tiers"), seed=5)


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir)


def namespace_fn(tiny_dir, model):
    def make(block_size: int, block_bytes: int):
        return engine_namespace(tiny_dir, "tiny", dtype="float32", kv_cache_dtype="float32", block_size=block_size,
                                num_layers=model.cfg.num_layers, tp_size=1, tp_rank=0, block_bytes=block_bytes,
                                layout=LAYOUT)
    return make


class Engine:
    """The scheduler core and a runner, stepped as the adapter steps them (lookups answered at
    once from the store, an empty plan sent while fetches are under way)."""

    def __init__(self, model, num_blocks: int, tier: TierConfig | None, store: DictStore | None) -> None:
        self.runner = ModelRunner(model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=num_blocks, block_size=BS)
        if tier is not None:
            self.runner.enable_kv_tiers(tier)
        self.proto = ProtoRunner(self.runner)
        info = self.proto.hello(BS)
        self.store = store
        cfg = SchedulerConfig(max_model_len=256, block_size=BS, max_num_batched_tokens=64,
                              kv_tier=info.HasField("kv_namespace"))
        self.ns = info.kv_namespace if info.HasField("kv_namespace") else None
        self.core = Scheduler(cfg, info.num_kv_blocks, frozenset(), VOCAB, num_host_blocks=info.num_host_kv_blocks)
        self.after_lookup = lambda: None

    def run(self, prompts: dict[str, list[int]], max_tokens: int = 6) -> tuple[dict, dict]:
        core = self.core
        for rid, p in prompts.items():
            core.add_request(Request(rid, list(p), max_tokens))
        outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
        cached: dict[str, int] = {}
        for _ in range(2000):
            for rid, hashes in core.take_lookups():
                core.on_tier_lookup(rid, self.store.lookup(self.ns, hashes))
                self.after_lookup()
            if not core.has_work():
                break
            plan = core.schedule()
            if plan.is_empty() and not core.loading:
                continue
            result = self.proto.execute(sched_wire.plan_to_proto(plan).plan)
            for out in core.update(plan, sched_wire.result_from_proto(result)):
                outputs[out.request_id].extend(out.new_token_ids)
                if out.new_token_ids:
                    cached.setdefault(out.request_id, out.num_cached_tokens)
        assert not core.has_work()
        self.runner.tiers and self.runner.tiers.flush_saves(5.0)
        return outputs, cached


def long_prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB, (n,), generator=g).tolist()


def test_gather_scatter_moves_every_layer_of_a_block(model):
    runner = ModelRunner(model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=16, block_size=BS)
    for c in runner.kv_caches:
        c.copy_(torch.randn_like(c))
    tiers = KvTiers(runner.kv_caches, BS, TierConfig(offload_bytes=0))
    data = tiers.gather([3, 7])
    assert data.shape[0] == 2 and data[0].numel() == tiers.block_bytes
    tiers.scatter([10, 11], data)
    for c in runner.kv_caches:
        assert torch.equal(c[:, 10], c[:, 3]) and torch.equal(c[:, 11], c[:, 7])
        assert not torch.equal(c[:, 10], c[:, 7])


@pytest.mark.parametrize("store_kind", [DictStore, ArenaStore])
def test_a_prompt_computed_by_one_engine_is_fetched_by_another(tiny_dir, model, store_kind):
    store = store_kind()
    tier = lambda: TierConfig(client=store, make_namespace=namespace_fn(tiny_dir, model))  # noqa: E731
    p = long_prompt(1, 61)                                          # 15 full blocks + 1
    cold, _ = Engine(model, 64, None, None).run({"a": p})
    first, _ = Engine(model, 64, tier(), store).run({"a": p})
    assert first == cold and len(store.blocks) == 15
    b = Engine(model, 64, tier(), store)
    again, cached = b.run({"b": p})
    assert again["b"] == cold["a"]
    assert cached["b"] == 60 and cached["b"] >= 0.9 * len(p), (cached, {k: v for k, v in b.core.stats().items() if "kvstore" in k})
    assert b.core.stats()["kvstore_loaded_blocks"] == 15
    if store_kind is ArenaStore:   # both ways through the store's memory, no copying call
        assert store.zero_copy_writes >= 1 and store.zero_copy_reads >= 1 and store.gets == 0


def test_a_corrupted_store_only_costs_a_recompute(tiny_dir, model):
    store = DictStore()
    tier = lambda: TierConfig(client=store, make_namespace=namespace_fn(tiny_dir, model))  # noqa: E731
    p = long_prompt(2, 41)
    cold, _ = Engine(model, 64, None, None).run({"a": p})
    Engine(model, 64, tier(), store).run({"a": p})
    keys = list(store.blocks)
    b = Engine(model, 64, tier(), store)
    # Found by the lookup, gone (or corrupt: the client reports both as a miss) when fetched.
    b.after_lookup = lambda: store.blocks.pop(keys[6])
    out, cached = b.run({"b": p})
    assert out["b"] == cold["a"] and cached["b"] == 24
    assert b.core.stats()["kvstore_failed_blocks"] == 4


def test_host_offload_serves_a_working_set_larger_than_the_device_pool(model):
    prompts = {f"r{i}": long_prompt(10 + i, 37) for i in range(4)}   # 9 blocks each, 36 in all
    cold = {}
    for rid, p in prompts.items():
        cold.update(Engine(model, 64, None, None).run({rid: p})[0])
    e = Engine(model, 20, TierConfig(offload_bytes=64 * 1024 * 1024), None)
    assert e.runner.tiers.num_slots > 36
    for rid, p in prompts.items():
        assert e.run({rid: p})[0] == {rid: cold[rid]}
    # Second round: every prompt's blocks left the device long ago; they come back from host memory.
    for rid, p in prompts.items():
        out, cached = e.run({rid + "'": p})
        assert out[rid + "'"] == cold[rid] and cached[rid + "'"] == 36
    assert e.runner.tiers.stats["host_load_blocks"] >= 4 * 9 - 20
    assert e.core.stats()["host_hit_blocks"] >= 4 * 9 - 20

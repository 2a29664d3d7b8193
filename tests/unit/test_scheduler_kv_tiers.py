"""The scheduler core's KV tiers (docs/kv_tiers.md): tier-1 host offload and tier-2 (kvstore)
lookups, fetches and saves, driven against a fake worker whose KV cache, host slots and store
hold real token values, so a block filled from the wrong place fails the worker's own check."""
from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.core import Request, RequestStatus, Scheduler, SchedulerConfig
from tests.unit.scheduler_sim import EOS, VOCAB, FakeWorker, drive
from tests.unit.test_scheduler_features import check_invariants, prompt, solo

BS = 4


@dataclass
class Loaded:
    request_id: str
    num_loaded: int
    num_requested: int


class TierWorker(FakeWorker):
    """FakeWorker plus tier 1 (host slots) and tier 2 (a dict by hash). A fetch is reported one
    plan later (the real worker fetches in the background); `fail_after` cuts fetches short."""

    def __init__(self, store: dict | None = None, fail_after: int | None = None) -> None:
        super().__init__(BS)
        self.host: dict[int, list] = {}
        self.store = {} if store is None else store
        self.fail_after = fail_after
        self._reports: list[Loaded] = []
        self.offloads = self.host_loads = self.fetched = 0

    def run(self, plan):
        reports, self._reports = self._reports, []
        for block, slot in plan.host_offloads:
            self.host[slot] = list(self.kv[block])
            self.offloads += 1
        for block, slot in plan.host_loads:
            self.kv[block] = list(self.host[slot])
            self.host_loads += 1
        for t in plan.tier_loads:
            n = 0
            for block, h in zip(t.block_ids, t.block_hashes):
                if h not in self.store or (self.fail_after is not None and n >= self.fail_after):
                    break
                self.kv[block] = list(self.store[h])
                n += 1
            self.fetched += n
            self._reports.append(Loaded(t.request_id, n, len(t.block_ids)))
        result = super().run(plan)
        for t in plan.tier_saves:
            for block, h in zip(t.block_ids, t.block_hashes):
                assert None not in self.kv[block], "a block saved before it was computed"
                self.store[h] = list(self.kv[block])
        result.kv_loads = reports
        return result


def make(num_blocks=64, **kw) -> Scheduler:
    host = kw.pop("num_host_blocks", 0)
    cfg = SchedulerConfig(max_model_len=256, block_size=BS, **kw)
    return Scheduler(cfg, num_blocks, frozenset({EOS}), VOCAB, num_host_blocks=host)


def answer_lookups(s: Scheduler, store: dict) -> None:
    for rid, hashes in s.take_lookups():
        n = 0
        while n < len(hashes) and hashes[n] in store:
            n += 1
        s.on_tier_lookup(rid, n)


def run_one(s, w, rid, tokens, max_tokens=3, store=None):
    s.add_request(Request(rid, list(tokens), max_tokens))
    if store is not None:
        answer_lookups(s, store)
    outputs, _, plans = drive(s, w)
    check_invariants(s)
    return outputs[rid], plans


# ---- tier 1 -------------------------------------------------------------------------------

def test_evicted_blocks_go_to_host_and_come_back_as_hits():
    s, w = make(num_blocks=12, num_host_blocks=32), TierWorker()
    long = prompt(1, 33)                       # 8 full blocks + 1 token
    first, _ = run_one(s, w, "a", long)
    for i in range(3):                         # other prompts push "a"'s blocks out of the device
        run_one(s, w, f"x{i}", prompt(10 + i, 33))
    assert w.offloads >= 8
    assert s.kv.find_cached_prefix(Request("probe", list(long), 1)) == []
    again, plans = run_one(s, w, "b", long)
    assert again == first == solo(long, 3)
    assert w.host_loads == 8
    new = next(r for p in plans for r in p.new_requests if r.request_id == "b")
    assert new.num_computed_tokens == 32
    assert s.stats()["host_hit_blocks"] == 8


def test_a_slot_loaded_in_a_plan_is_not_overwritten_by_its_offloads():
    # Two host slots only: admitting b (a host hit) evicts device blocks in the same plan.
    s, w = make(num_blocks=5, num_host_blocks=2), TierWorker()
    a = prompt(3, 9)                           # 2 full blocks + 1
    run_one(s, w, "a", a, max_tokens=2)
    run_one(s, w, "x", prompt(4, 17), max_tokens=2)   # evicts a's blocks into both slots
    out, plans = run_one(s, w, "b", a, max_tokens=2)  # the worker checks every slot it reads
    assert out == solo(a, 2)
    for p in plans:
        loaded = {slot for _, slot in p.host_loads}
        assert not loaded & {slot for _, slot in p.host_offloads}


# ---- tier 2 -------------------------------------------------------------------------------

def test_a_prompt_saved_by_one_engine_is_fetched_by_another():
    store: dict = {}
    long = prompt(7, 41)                       # 10 full blocks + 1
    s1, w1 = make(kv_tier=True), TierWorker(store)
    first, plans = run_one(s1, w1, "a", long, store=store)
    assert len(store) == 10 and sum(len(t.block_ids) for p in plans for t in p.tier_saves) == 10
    s2, w2 = make(kv_tier=True), TierWorker(store)
    s2.add_request(Request("b", list(long), 3))
    assert s2.requests["b"].status is RequestStatus.LOOKUP and not s2.has_work()
    answer_lookups(s2, store)
    plan = s2.schedule()
    assert [len(t.block_ids) for t in plan.tier_loads] == [10] and not plan.new_requests
    assert s2.requests["b"].status is RequestStatus.LOADING
    s2.update(plan, w2.run(plan))
    out, reasons, plans2 = drive(s2, w2)
    assert out["b"] == first == solo(long, 3)
    new = next(r for p in plans2 for r in p.new_requests if r.request_id == "b")
    assert new.num_computed_tokens == 40 and w2.fetched == 10
    assert not any(p.tier_saves for p in plans2)   # what came from the tier is not saved again
    st = s2.stats()
    assert st["kvstore_loaded_blocks"] == 10 and st["kvstore_failed_blocks"] == 0
    check_invariants(s2)


def test_a_fetch_cut_short_is_recomputed_from_the_first_missing_block():
    store: dict = {}
    long = prompt(8, 41)
    run_one(make(kv_tier=True), TierWorker(store), "a", long, store=store)
    s, w = make(kv_tier=True), TierWorker(store, fail_after=4)
    out, plans = run_one(s, w, "b", long, store=store)
    assert out == solo(long, 3)
    new = next(r for p in plans for r in p.new_requests if r.request_id == "b")
    assert new.num_computed_tokens == 16
    assert s.stats()["kvstore_failed_blocks"] == 6
    # the recomputed blocks are saved (the store already holds them; a Put says so)
    assert sum(len(t.block_ids) for p in plans for t in p.tier_saves) == 6


def test_lookup_finding_nothing_or_a_short_prompt_costs_no_fetch():
    s, w = make(kv_tier=True), TierWorker({})
    s.add_request(Request("tiny", prompt(1, 3), 2))    # no full block: no lookup
    assert s.requests["tiny"].status is RequestStatus.WAITING and not s.take_lookups()
    out, plans = run_one(s, w, "miss", prompt(2, 21), store={})
    assert out == solo(prompt(2, 21), 3) and not any(p.tier_loads for p in plans)


def test_a_request_aborted_while_loading_keeps_its_blocks_until_the_fetch_ends():
    store: dict = {}
    long = prompt(9, 41)
    run_one(make(kv_tier=True), TierWorker(store), "a", long, store=store)
    s, w = make(num_blocks=16, kv_tier=True), TierWorker(store)
    s.add_request(Request("b", list(long), 3))
    answer_lookups(s, store)
    plan = s.schedule()
    held = list(s.requests["b"].block_ids)
    s.abort(["b"])
    assert "b" not in s.requests and all(s.pool.blocks[b].ref_count == 1 for b in held)
    s.update(plan, w.run(plan))                 # the fetch is reported with the next result
    assert "b" in s.loading
    plan = s.schedule()
    s.update(plan, w.run(plan))
    assert not s.loading and all(s.pool.blocks[b].ref_count == 0 for b in held)
    assert s.pool.num_free == 16


def test_a_request_aborted_during_its_lookup_is_forgotten():
    s = make(kv_tier=True)
    s.add_request(Request("b", prompt(5, 21), 3))
    s.abort(["b"])
    s.on_tier_lookup("b", 5)
    assert not s.requests and not len(s.waiting) and s.take_pending_outputs()[0].finish_reason == "abort"


def test_many_requests_sharing_a_stored_prefix_on_a_small_pool():
    store: dict = {}
    shared = prompt(11, 24)
    run_one(make(kv_tier=True), TierWorker(store), "seed", shared + [5], store=store)
    s, w = make(num_blocks=24, kv_tier=True, max_num_seqs=4, num_host_blocks=8), TierWorker(store)
    expect = {}
    for i in range(8):
        p = shared + prompt(100 + i, 5 + i)
        expect[f"r{i}"] = solo(p, 4)
        s.add_request(Request(f"r{i}", p, 4))
    answer_lookups(s, store)
    outputs, _, _ = drive(s, w, async_depth=2)
    assert outputs == expect
    check_invariants(s)
    assert s.pool.num_free == 24 and not s.loading


# ---- prefill/decode hand-off (docs/pd.md) ---------------------------------------------------

@dataclass
class Saved:
    request_id: str
    num_blocks: int
    num_saved: int


class SavingWorker(TierWorker):
    """Reports each plan's saves with the next result, as the real worker's saver does."""

    def __init__(self, store, drop: bool = False) -> None:
        super().__init__(store)
        self._saves: list[Saved] = []
        self.drop = drop

    def run(self, plan):
        reports, self._saves = self._saves, [Saved(t.request_id, len(t.block_ids), 0 if self.drop else len(t.block_ids))
                                             for t in plan.tier_saves]
        result = super().run(plan)
        result.kv_saves = reports
        return result


def test_prefill_only_then_decode_elsewhere_gives_the_colocated_output():
    store: dict = {}
    p = prompt(21, 45)                                   # 11 full blocks + 1
    want = solo(p, 6)
    pre, wp = make(kv_tier=True), SavingWorker(store)
    r = Request("a", list(p), 6)
    r.prefill_only = True
    pre.add_request(r)
    answer_lookups(pre, store)
    first = drive(pre, wp)[0]["a"]
    assert first == want[:1]                             # one token, then the hand-off
    assert not pre.requests and pre.pool.num_free == 64 and len(store) == 11
    # The end of the prefill-only request carries how many blocks the store holds.
    pre2, wp2 = make(kv_tier=True), SavingWorker(store)
    r2 = Request("b", list(p), 6)
    r2.prefill_only = True
    pre2.add_request(r2)
    answer_lookups(pre2, store)
    seen = []
    for _ in range(50):
        if not pre2.has_work():
            break
        plan = pre2.schedule()
        seen += pre2.update(plan, wp2.run(plan))
    handoff = [o for o in seen if o.handoff_blocks >= 0]
    assert len(handoff) == 1 and handoff[0].handoff_blocks == 11 and handoff[0].finish_reason == "length"
    # The decode engine: the first token as a resumed output, the blocks named by the hand-off.
    dec, wd = make(kv_tier=True), SavingWorker(store)
    r3 = Request("c", list(p), 6)
    r3.append_output(first[0])
    r3.handoff, r3.kv_tier_blocks = True, 11
    dec.add_request(r3)
    assert not dec.take_lookups()                        # no lookup: the hand-off said how many
    outs, _, plans = drive(dec, wd)
    assert first + outs["c"] == want
    new = next(x for pl in plans for x in pl.new_requests if x.request_id == "c")
    assert new.num_computed_tokens == 44 and new.num_output_tokens == 1


def test_dropped_saves_hand_off_nothing_and_a_failing_policy_fails_the_decode():
    store: dict = {}
    p = prompt(22, 33)
    pre, wp = make(kv_tier=True), SavingWorker(store, drop=True)
    r = Request("a", list(p), 4)
    r.prefill_only = True
    pre.add_request(r)
    answer_lookups(pre, store)
    seen = []
    for _ in range(50):
        if not pre.has_work():
            break
        plan = pre.schedule()
        seen += pre.update(plan, wp.run(plan))
    assert [o.handoff_blocks for o in seen if o.handoff_blocks >= 0] == [0]
    dec = Scheduler(SchedulerConfig(max_model_len=256, block_size=BS, kv_tier=True, kv_load_failure_policy="fail"),
                    64, frozenset({EOS}), VOCAB)
    r2 = Request("b", list(p), 4)
    r2.append_output(seen[0].new_token_ids[0])
    r2.handoff, r2.kv_tier_blocks = True, 8               # claims blocks the store does not have
    dec.add_request(r2)
    outs, reasons, _ = drive(dec, SavingWorker({}))
    assert reasons["b"] == "error" and dec.pool.num_free == 64


class DeadPeerWorker(SavingWorker):
    """Direct hand-offs never arrive (the peer is unreachable); kvstore fetches work."""

    def __init__(self, store) -> None:
        super().__init__(store)
        self.loads: list[tuple[str, int]] = []   # (peer, blocks) of every load planned

    def run(self, plan):
        self.loads += [(t.peer, len(t.block_ids)) for t in plan.tier_loads]
        direct = [t for t in plan.tier_loads if t.peer]
        plan.tier_loads = [t for t in plan.tier_loads if not t.peer]
        result = super().run(plan)
        self._reports += [Loaded(t.request_id, 0, len(t.block_ids)) for t in direct]
        return result


def _drive_with_lookups(s, w, store, rid):
    outs, plans = [], []
    for _ in range(100):
        answer_lookups(s, store)
        if not s.has_work():
            break
        plan = s.schedule()
        plans.append(plan)
        outs += [t for o in s.update(plan, w.run(plan)) if o.request_id == rid for t in o.new_token_ids]
    return outs, plans


def test_a_direct_hand_off_that_fails_is_fetched_from_the_kvstore_or_recomputed():
    store: dict = {}
    p = prompt(23, 45)                                   # 11 full blocks + 1
    want = solo(p, 6)
    pre = make(kv_tier=True)
    run_one(pre, SavingWorker(store), "a", p, max_tokens=1, store=store)   # the prefill engine's saves
    assert len(store) == 11
    for kv_tier in (True, False):
        dec = make(kv_tier=kv_tier)
        r = Request("c", list(p), 6)
        r.append_output(want[0])
        r.handoff, r.kv_tier_blocks = True, 11
        r.peer, r.src_block_ids = "127.0.0.1:1", list(range(11))
        dec.add_request(r)
        w = DeadPeerWorker(store)
        outs, plans = _drive_with_lookups(dec, w, store, "c")
        assert [want[0], *outs] == want
        loads = w.loads
        assert loads[0] == ("127.0.0.1:1", 11)                      # the direct copy, which failed
        if kv_tier:   # ... then the kvstore, which has the prefill engine's saves
            assert loads[1:] == [("", 11)]
            assert dec.tier_stats["direct_failed_kvstore"] == 1 and dec.tier_stats["kvstore_loaded_blocks"] == 11
            computed = [x.num_computed_tokens for pl in plans for x in pl.new_requests if x.request_id == "c"]
            assert computed[-1] == 44
        else:         # no kvstore: recomputed
            assert len(loads) == 1 and dec.tier_stats["direct_failed_recompute"] == 1
        assert not dec.requests and not dec.lookups and not dec.loading
        check_invariants(dec)

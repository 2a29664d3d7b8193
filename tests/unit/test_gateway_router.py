"""The router's policy on handmade loads and prompts (services/gateway/clients/router.py)."""
import pytest

from services.gateway.clients.router import ReplicaLoad, Router, RouterConfig

BS = 16


def loads(**tokens: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(rid, n) for rid, n in tokens.items()]


def prompt(seed: int, n_tokens: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 for i in range(n_tokens)]


def test_least_outstanding_tokens_wins():
    r = Router(RouterConfig(block_size=BS))
    assert r.choose(loads(a=900, b=100, c=500), [1, 2, 3]).replica_id == "b"


def test_ties_alternate_so_sequential_traffic_spreads():
    r = Router(RouterConfig(block_size=BS))
    picks = [r.choose(loads(a=0, b=0), prompt(i, 5)).replica_id for i in range(6)]
    assert picks == ["a", "b", "a", "b", "a", "b"]


def test_repeated_prefix_goes_to_the_replica_that_saw_it():
    r = Router(RouterConfig(block_size=BS))
    system = prompt(1, 4 * BS)
    first = r.choose(loads(a=0, b=0), system + [5, 6, 7])
    assert first.reason == "least_loaded"
    # The other replica is now less loaded, yet the shared prefix sticks.
    again = r.choose(loads(**{first.replica_id: 300, ("b" if first.replica_id == "a" else "a"): 0}),
                     system + [9, 9, 9, 9])
    assert (again.replica_id, again.reason) == (first.replica_id, "affinity")


def test_longest_matching_prefix_decides():
    r = Router(RouterConfig(block_size=BS))
    base = prompt(2, 2 * BS)
    r.choose(loads(a=0), base)                               # base -> a
    r.choose(loads(b=0), base + prompt(3, 2 * BS))           # base + x -> b (only b ready)
    d = r.choose(loads(a=0, b=0), base + prompt(3, 2 * BS) + [1])
    assert (d.replica_id, d.reason) == ("b", "affinity")


def test_affinity_yields_when_the_affine_replica_is_much_busier():
    r = Router(RouterConfig(block_size=BS, busy_ratio=1.5, busy_slack_tokens=100))
    p = prompt(4, 3 * BS)
    r.choose(loads(a=0, b=0), p)                              # -> a (tie, first)
    assert r.choose(loads(a=250, b=100), p).reason == "affinity"       # 250 <= 1.5*100+100
    d = r.choose(loads(a=251, b=100), p)                               # 251 > 250
    assert (d.replica_id, d.reason) == ("b", "affinity_busy")
    # The prefix now maps to b: b holds it cached as well.
    assert r.choose(loads(a=0, b=0), p).replica_id == "b"


def test_short_prompts_have_no_affinity():
    r = Router(RouterConfig(block_size=BS))
    assert r.prefix_hashes(list(range(BS - 1))) == []
    assert len(r.prefix_hashes(list(range(3 * BS + 5)))) == 3
    assert len(r.prefix_hashes(list(range(100 * BS)))) == r.config.max_affinity_blocks


def test_excluded_and_missing_replicas_are_never_chosen():
    r = Router(RouterConfig(block_size=BS))
    p = prompt(5, 2 * BS)
    r.choose(loads(a=0), p)                                    # affinity -> a
    assert r.choose(loads(a=0, b=500), p, exclude=["a"]).replica_id == "b"
    assert r.choose(loads(b=0, c=0), p).replica_id in ("b", "c")  # a is not ready: ignored
    assert r.choose(loads(a=0), p, exclude=["a"]) is None
    assert r.choose([], p) is None


def test_forget_replica_drops_its_affinity():
    r = Router(RouterConfig(block_size=BS))
    p = prompt(6, 2 * BS)
    r.choose(loads(a=0, b=0), p)
    assert r.num_affinity_entries == 2
    r.forget_replica("a")
    assert r.num_affinity_entries == 0
    assert r.choose(loads(a=10, b=0), p).reason == "least_loaded"


def test_affinity_table_is_bounded():
    r = Router(RouterConfig(block_size=BS, max_entries=5))
    for i in range(20):
        r.choose(loads(a=0, b=0), prompt(100 + i, 2 * BS))
    assert r.num_affinity_entries == 5


def test_bad_config_is_refused():
    with pytest.raises(ValueError):
        RouterConfig(busy_ratio=0.5)
    with pytest.raises(ValueError):
        RouterConfig(block_size=0)

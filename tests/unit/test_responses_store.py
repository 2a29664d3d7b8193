"""The stored-responses map: per-owner namespaces, LRU under count and byte bounds, expiry."""
from services.gateway.openai.responses_store import ResponseStore


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_one_owner_cannot_read_or_delete_another_owners_response():
    store = ResponseStore(10, 1 << 20, 60)
    assert store.put("alice", "resp_1", {"id": "resp_1"}, [])
    assert store.get("bob", "resp_1") is None and not store.delete("bob", "resp_1")
    assert store.get("alice", "resp_1").body == {"id": "resp_1"}


def test_the_least_recently_used_goes_first_past_the_count():
    store = ResponseStore(2, 1 << 20, 60)
    store.put("", "a", {}, [])
    store.put("", "b", {}, [])
    store.get("", "a")               # a is now the most recently used
    store.put("", "c", {}, [])
    assert store.get("", "b") is None and store.get("", "a") and store.get("", "c")
    assert len(store) == 2


def test_the_byte_bound_evicts_and_an_entry_over_it_alone_is_not_kept():
    store = ResponseStore(100, 200, 60)
    for i in range(10):
        store.put("", f"r{i}", {"text": "x" * 50}, [])
        assert store.bytes <= 200
    assert store.get("", "r9") and store.get("", "r0") is None
    assert not store.put("", "big", {"text": "x" * 300}, [])
    assert store.get("", "big") is None and store.bytes <= 200


def test_entries_expire_and_replacing_one_keeps_the_byte_count_right():
    clock = Clock()
    store = ResponseStore(10, 1 << 20, 30, clock=clock)
    store.put("", "a", {"v": 1}, None)
    store.put("", "a", {"v": 22}, [{"role": "user", "content": "x"}])
    assert len(store) == 1 and store.bytes == store.get("", "a").size
    clock.now = 31
    assert store.get("", "a") is None and store.bytes == 0


def test_zero_entries_stores_nothing():
    store = ResponseStore(0, 1 << 20, 60)
    assert not store.put("", "a", {}, []) and store.get("", "a") is None


def test_items_are_found_by_id_in_the_owners_responses_only():
    store = ResponseStore(10, 1 << 20, 60)
    store.put("alice", "r1", {"output": [{"id": "msg_a", "type": "message"}]}, [],
              [{"id": "msg_in", "type": "message"}])
    assert store.find_item("alice", "msg_a")["type"] == "message"
    assert store.find_item("alice", "msg_in") is not None
    assert store.find_item("bob", "msg_a") is None and store.find_item("alice", "nope") is None

"""KV tiers on a real mesh (docs/kv_tiers.md): two SmolLM2 engines (`--data-parallel-size 2`), the
kvstore the launcher starts, and tier-1 host offload over a small device pool. A long prompt
computed on one replica is loaded from the kvstore by the other (drain moves it there), and
again after the supervisor restarts a killed worker; a kvstore killed during loads and saves
costs recomputes only, and is used again once restarted; host memory serves a working set the
device pool cannot hold. Outputs are greedy and compared token for token with the cold run."""
from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time

import httpx
import pytest

from tests.integration.meshproc import service_name, start_mesh, stop_checked
from tests.integration.test_supervisor_failures import replicas, wait_recovered

ADMIN = "admin-key-kvt-0001"
AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}
NUM_BLOCKS = 120          # per engine: 1,920 tokens, so a few long prompts evict each other
PROMPT_WORDS = 420        # ~430 tokens: 26 full blocks of 16


@pytest.fixture(scope="module")
def mesh(smollm2_dir):
    m = start_mesh(str(smollm2_dir), "--data-parallel-size", "2", "--max-model-len", "2048",
                   "--num-kv-blocks", str(NUM_BLOCKS), "--kv-offload-gb", "0.25", "--max-num-seqs", "8",
                   "--admin-api-key", ADMIN)
    m.seen = set(m.service_pids())
    yield m
    stop_checked(m, m.seen)


def passage(seed: int, words: int = PROMPT_WORDS) -> str:
    vocab = ["river", "stone", "lantern", "harbor", "meadow", "engine", "copper", "willow", "signal", "orbit",
             "canvas", "thunder", "pepper", "marble", "falcon", "silver", "garden", "puzzle", "ribbon", "glacier"]
    x = seed * 7919 + 17
    out = []
    for _ in range(words):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(vocab[x % len(vocab)])
    return f"Document {seed}: " + " ".join(out) + "\nSummary in one sentence:"


def complete(mesh, prompt: str, max_tokens: int = 12) -> dict:
    r = httpx.post(f"{mesh.http_url}/v1/completions", timeout=120, headers=AS_ADMIN,
                   json={"model": mesh.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                         "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    return {"ids": body["choices"][0]["token_ids"], "prompt_tokens": body["usage"]["prompt_tokens"],
            "cached": (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0}


def drain(mesh, replica: str, undrain: bool = False) -> None:
    r = httpx.post(f"{mesh.http_url}/drain", headers=AS_ADMIN, timeout=30,
                   json={"replica": replica, "undrain": undrain})
    assert r.status_code == 200, r.text


def routable(mesh) -> dict[str, bool]:
    """The gateway's own view of which replicas take new requests (it follows the supervisor's
    watch, so it lags a drain)."""
    text = httpx.get(f"{mesh.http_url}/metrics", timeout=10).text
    return {rid: float(v) == 1.0 for rid, v in
            re.findall(r'^meshllm:engine_replica_routable\{replica="([^"]+)"\} (\S+)$', text, re.M)}


def only(mesh, replica: str) -> None:
    """Route everything to `replica` (the other one drained), once the gateway sees it so."""
    other = "engine-1" if replica == "engine-0" else "engine-0"
    drain(mesh, replica, undrain=True)
    drain(mesh, other)
    deadline = time.monotonic() + 30
    while (view := routable(mesh)).get(replica) is not True or view.get(other) is not False:
        assert time.monotonic() < deadline, f"the gateway still routes {view} after draining {other}"
        time.sleep(0.05)


def saves_ended(mesh, engine: str) -> float:
    """Blocks whose kvstore save ended (kept or dropped), on `engine`'s worker."""
    i = engine.removeprefix("engine-")
    addr = mesh.services()["worker-metrics" if i == "0" else f"worker-{i}-metrics"]
    text = httpx.get(f"http://{addr}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(
        r'^meshllm:kv_tier_(?:saved|dropped)_blocks_total\{tier="kvstore"\} (\S+)$', text, re.M))


def complete_saved(mesh, engine: str, prompt: str, max_tokens: int = 12) -> dict:
    """complete() on `engine` (the one routed to), returning once its worker has ended the
    kvstore saves of the prompt's full blocks (they are put after the response, on a thread)."""
    before = saves_ended(mesh, engine)
    out = complete(mesh, prompt, max_tokens)
    wait_saves_ended(mesh, engine, before + out["prompt_tokens"] // 16 - out["cached"] // 16)
    return out


def complete_all_saved(mesh, engine: str, prompts: list[str], max_tokens: int = 12) -> list[dict]:
    """complete_saved() of several prompts sent at once (batched greedy == solo)."""
    before = saves_ended(mesh, engine)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: complete(mesh, p, max_tokens), prompts))
    wait_saves_ended(mesh, engine, before + sum(out["prompt_tokens"] // 16 - out["cached"] // 16 for out in outs))
    return outs


def wait_saves_ended(mesh, engine: str, want: float) -> None:
    deadline = time.monotonic() + 30
    while saves_ended(mesh, engine) < want:
        assert time.monotonic() < deadline, f"{engine} did not end its kvstore saves"
        time.sleep(0.05)


def reset_device_caches(mesh) -> None:
    r = httpx.post(f"{mesh.http_url}/reset_prefix_cache", headers=AS_ADMIN, timeout=30)
    assert r.status_code == 200, r.text


def engine_metric(mesh, name: str, engine: str, tier: str | None = None) -> float:
    """A scheduler counter of one engine, read from the launcher's metrics endpoints."""
    total = 0.0
    for url in mesh_metric_urls(mesh, "scheduler"):
        text = httpx.get(url, timeout=10).text
        for m in re.finditer(rf'^{re.escape(name)}\{{([^}}]*)\}} (\S+)$', text, re.M):
            labels = m.group(1)
            if f'engine="{engine}"' in labels and (tier is None or f'tier="{tier}"' in labels):
                total += float(m.group(2))
    return total


def mesh_metric_urls(mesh, service: str) -> list[str]:
    log = open(mesh.log_path).read()
    return [f"http://{a}/metrics" for a in sorted(set(re.findall(rf" {service}(?:-\d+)?-metrics=(127\.0\.0\.1:\d+)", log)))]


def test_a_prompt_computed_on_one_replica_is_loaded_by_the_other(mesh):
    p = passage(1)
    only(mesh, "engine-0")
    cold = complete_saved(mesh, "engine-0", p)
    assert cold["cached"] < 0.2 * cold["prompt_tokens"]
    only(mesh, "engine-1")
    warm = complete(mesh, p)
    assert warm["ids"] == cold["ids"]
    assert warm["cached"] >= 0.9 * warm["prompt_tokens"], warm
    assert engine_metric(mesh, "meshllm:kv_tier_prefix_hit_blocks_total", "1", "kvstore") >= 0.9 * warm["prompt_tokens"] // 16


def test_after_a_worker_is_killed_its_restart_loads_the_prompt_from_the_tier(mesh):
    p = passage(2)
    only(mesh, "engine-0")
    cold = complete_saved(mesh, "engine-0", p)
    engine = replicas(mesh)["engine-0"]
    worker = next(pid for pid in engine.pids if service_name(pid) == "worker")
    os.kill(worker, signal.SIGKILL)
    wait_recovered(mesh, "engine-0", engine.restarts)
    deadline = time.monotonic() + 60
    while True:   # the gateway routes to it again once it sees it ready
        try:
            warm = complete(mesh, p)
            break
        except AssertionError:
            assert time.monotonic() < deadline
            time.sleep(0.5)
    assert warm["ids"] == cold["ids"] and warm["cached"] >= 0.9 * warm["prompt_tokens"], warm


def test_host_offload_serves_a_working_set_larger_than_the_device_pool(mesh):
    only(mesh, "engine-1")
    prompts = [passage(10 + i) for i in range(6)]      # 6 x 27 blocks > 120 in the pool
    first = [complete(mesh, p, max_tokens=4) for p in prompts]
    host_before = engine_metric(mesh, "meshllm:kv_tier_prefix_hit_blocks_total", "1", "host")
    again = complete(mesh, prompts[0], max_tokens=4)    # long evicted from the device pool
    assert again["ids"] == first[0]["ids"] and again["cached"] >= 0.9 * again["prompt_tokens"]
    assert engine_metric(mesh, "meshllm:kv_tier_prefix_hit_blocks_total", "1", "host") - host_before >= 20


def test_killing_the_kvstore_during_loads_and_saves_costs_only_recomputes(mesh):
    only(mesh, "engine-0")
    stored = [passage(30 + i) for i in range(2)]
    saved = complete_all_saved(mesh, "engine-0", stored)        # saved to the tier by engine-0
    expect = {p: out["ids"] for p, out in zip(stored, saved)}
    only(mesh, "engine-1")
    fresh = [passage(40 + i) for i in range(2)]                  # computed and saved during the kill
    kv = replicas(mesh)["kvstore-0"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = {p: pool.submit(complete, mesh, p) for p in [*stored, *fresh]}
        time.sleep(0.3)
        os.kill(kv.pids[0], signal.SIGKILL)
        results = {p: f.result(timeout=180) for p, f in futures.items()}
    for p in stored:
        assert results[p]["ids"] == expect[p]
    only(mesh, "engine-0")
    with concurrent.futures.ThreadPoolExecutor(len(fresh)) as pool:   # engine-0 never saw them: computed again
        again = dict(zip(fresh, pool.map(lambda p: complete(mesh, p), fresh)))
    for p in fresh:   # the same greedy output
        assert again[p]["ids"] == results[p]["ids"]
    wait_recovered(mesh, "kvstore-0", kv.restarts)
    # The restarted (empty) kvstore is used again: a new prompt goes to the tier and across.
    p = passage(50)
    deadline = time.monotonic() + 60
    while True:
        only(mesh, "engine-0")
        cold = complete_saved(mesh, "engine-0", p)
        only(mesh, "engine-1")
        warm = complete(mesh, p)
        if warm["cached"] >= 0.9 * warm["prompt_tokens"]:
            break
        assert time.monotonic() < deadline, "the restarted kvstore was not used again"
        p = passage(int(time.monotonic()))
        time.sleep(1.0)
    assert warm["ids"] == cold["ids"]
    reset_device_caches(mesh)

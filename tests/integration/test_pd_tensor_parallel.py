"""Prefill/decode disaggregation with tensor-parallel engines on a real mesh (docs/pd.md): `meshllm
serve --prefill-replicas 1 --decode-replicas 1 --tensor-parallel-size 2`, each engine's worker
with its rank 1, the hand-off direct (decode rank r copies prefill rank r's shard of the blocks).

The model is a random 2-layer Llama over SmolLM2's vocabulary and tokenizer: SmolLM2-135M's 9
heads / 3 KV heads do not split over 2 ranks, and over 3 this mesh would run six ranks of the
whole model on two cores. The expected tokens come from the same weights run whole (tensor
parallel size 1) in this process; tests/unit/test_worker_tp_kv.py covers the kvstore path and the
failures at the worker level."""
from __future__ import annotations

import re
import shutil
import time

import httpx
import pytest

from services.common import pb
from services.worker.models import load_model
from services.worker.runner import ModelRunner
from services.worker.wire import ProtoRunner
from tests.integration.meshproc import children_of, start_mesh, stop_checked
from tests.integration.test_kv_tiers import passage
from tests.unit.tiny_llama import make_tiny_llama
from tests.worker_driver import MiniScheduler

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    path = make_tiny_llama(tmp_path_factory.mktemp("pd-tp") / "tiny", seed=11, vocab=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, path / name)
    return path


def whole_model_tokens(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    runner = ModelRunner(load_model(model_dir), model_name="tiny", kv_cache_bytes=0, num_kv_blocks=128,
                         block_size=16)
    sched = MiniScheduler(ProtoRunner(runner).execute, 16, 128, budget=256)
    for i, p in enumerate(prompts):
        sched.add(f"r{i}", p, MAX_TOKENS, pb.common.SamplingParams(temperature=0, ignore_eos=True))
    got = sched.run()
    return [got[f"r{i}"] for i in range(len(prompts))]


def complete(m, prompt: str) -> dict:
    body = {"model": m.model_name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(f"{m.http_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def direct_handoffs(m) -> float:
    text = httpx.get(f"{m.http_url}/metrics", timeout=10).text
    found = re.search(r'^meshllm:gateway_pd_handoffs_total{outcome="direct"} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _is_rank0_worker(pid: int) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    return b"services.worker" in argv and b"--tp-rank" not in argv


ADMIN = "admin-key-pdtp-0001"


def kvstore_blocks(m) -> int:
    from services.common.kv_client import KvClient
    client = KvClient(m.services()["kvstore"])
    try:
        return client.stats().blocks
    finally:
        client.close()


def test_tp2_prefill_and_decode_engines_hand_off_every_ranks_shard(tiny_dir):
    m = start_mesh(str(tiny_dir), "--prefill-replicas", "1", "--decode-replicas", "1", "--tensor-parallel-size", "2",
                   "--max-model-len", "256", "--num-kv-blocks", "128", "--admin-api-key", ADMIN, ready_timeout_s=120)
    seen = set(m.service_pids())
    try:
        workers = [pid for pid in m.service_pids() if _is_rank0_worker(pid)]
        assert len(workers) == 2 and all(len(children_of(pid)) == 1 for pid in workers)   # each with its rank 1
        deadline = time.monotonic() + 60   # until the gateway routes to both engines
        while complete(m, passage(99, 30))["usage"]["prompt_tokens_details"]["cached_tokens"] == 0:
            assert time.monotonic() < deadline, "no hand-off carried blocks"
            time.sleep(0.5)
        before = direct_handoffs(m)
        bodies = [complete(m, passage(7 + i, 40 + 20 * i)) for i in range(3)]
        want = whole_model_tokens(tiny_dir, [b["choices"][0]["prompt_token_ids"] for b in bodies])
        for body, tokens in zip(bodies, want):
            assert body["choices"][0]["token_ids"] == tokens
            n = body["usage"]["prompt_tokens"]
            # The decode engine's ranks got every full block: they computed only the last partial one.
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
        assert direct_handoffs(m) >= before + 3
        # Every rank saved its shard to the kvstore; a tiers reset flushes every rank's namespace.
        deadline = time.monotonic() + 30
        while kvstore_blocks(m) == 0:
            assert time.monotonic() < deadline, "no rank saved to the kvstore"
            time.sleep(0.2)
        r = httpx.post(f"{m.http_url}/reset_prefix_cache", json={"tiers": True}, timeout=60,
                       headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200, r.text
        assert r.json()["num_tier_blocks_flushed"] > 0 and kvstore_blocks(m) == 0, "a rank's blocks were left"
    finally:
        stop_checked(m, seen)

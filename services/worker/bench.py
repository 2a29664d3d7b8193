"""Worker-only decode throughput: ModelRunner.execute on handmade plans (plan.py), no sockets.

  .venv/bin/python -m services.worker.bench --model DIR [--batch 1 16] [--prompt-len 64] [--tokens 64]
"""
from __future__ import annotations

import argparse
import os
import random
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the worker's main() does, before torch loads
import torch  # noqa: E402

from services.worker.models import load_model  # noqa: E402
from services.worker.plan import CachedRequest, NewRequest, SamplingConfig, StepPlan  # noqa: E402
from services.worker.runner import ModelRunner  # noqa: E402


def bench_decode(runner: ModelRunner, batch: int, prompt_len: int, tokens: int, vocab: int) -> dict:
    bs = runner.block_size
    blocks_per_req = -(-(prompt_len + tokens + 1) // bs)
    rng = random.Random(batch)
    free = list(range(runner.num_blocks))
    rng.shuffle(free)
    greedy = SamplingConfig()
    plan = StepPlan(0, [NewRequest(f"b{i}", [rng.randrange(vocab) for _ in range(prompt_len)],
                                   [free.pop() for _ in range(blocks_per_req)], greedy,
                                   num_scheduled_tokens=prompt_len) for i in range(batch)], [], [])
    t0 = time.perf_counter()
    res = runner.execute(plan)
    assert res.error is None, res.error
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for step in range(1, tokens):
        plan = StepPlan(step, [], [CachedRequest(f"b{i}", [], prompt_len + step - 1, 1) for i in range(batch)], [])
        res = runner.execute(plan)
        assert res.error is None, res.error
    decode_s = time.perf_counter() - t0
    runner.execute(StepPlan(tokens, [], [], [f"b{i}" for i in range(batch)]))
    n = batch * (tokens - 1)
    return {"batch": batch, "prefill_s": prefill_s, "decode_tok_s": n / decode_s,
            "step_ms": 1000 * decode_s / (tokens - 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    model = load_model(a.model, a.device, getattr(torch, a.dtype), max_model_len=4096)
    runner = ModelRunner(model, model_name="bench", kv_cache_bytes=1 << 30)
    runner.hello(16)
    bench_decode(runner, 1, 16, 4, model.cfg.vocab_size)  # warm-up
    for b in a.batch:
        r = bench_decode(runner, b, a.prompt_len, a.tokens, model.cfg.vocab_size)
        print(f"batch {r['batch']:3d}: decode {r['decode_tok_s']:8.1f} tok/s  "
              f"({r['step_ms']:.1f} ms/step), prefill {r['prefill_s'] * 1000:.0f} ms "
              f"[{torch.get_num_threads()} threads, {model.dtype}, {model.device}]", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

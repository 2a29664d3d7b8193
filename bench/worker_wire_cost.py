"""Host cost of the worker's protobuf edge per decode step at batch 256 (256 CachedRequests in,
256 SampledOutputs out), before and after the worker got its own wire edge (wire.py, plan.py).

  .venv/bin/python bench/worker_wire_cost.py [--batch 256] [--steps 2000]

before: the runner read the pb StepPlan's fields itself and built the pb StepResult, which the
        engine then copied into a WorkerReply to serialize (reproduced below, field access for
        field access, from runner.py / server.py as they were).
after:  wire.request_from_bytes -> plan.py dataclasses, the same reads on those, a StepResult
        dataclass, wire.result_reply.
Both include parsing and serializing. Only the worker's side: no scheduler, no socket, no model.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common import pb  # noqa: E402
from services.worker import wire  # noqa: E402
from services.worker.plan import SampledOutput, SamplingConfig, StepResult  # noqa: E402

VOCAB, NUM_BLOCKS, BLOCK, MAX_LEN = 128256, 100_000, 16, 4096


@dataclass
class _State:  # what the runner keeps per request (RequestState), as far as these reads go
    request_id: str
    block_ids: list[int]
    num_known: int
    num_pending: int = 0
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


def runner_reads(plan, requests: dict) -> int:
    """The plan reads of ModelRunner.submit (_needs_host_tokens, _validate, _apply) and of the
    engine's step accounting, on cached requests; `plan` is a pb message or a plan.py value (the
    field names are the same). -> tokens scheduled."""
    for r in plan.cached_requests:                                   # _needs_host_tokens (GPU)
        st = requests.get(r.request_id)
        if st is not None and st.num_pending and st.sampling.has_penalties:
            break
    finished, seen, total = set(plan.finished_ids), set(), 0
    for r in plan.cached_requests:                                   # _validate
        rid = r.request_id
        if rid in seen:
            raise ValueError(rid)
        seen.add(rid)
        st = requests.get(rid)
        if st is None or rid in finished:
            raise ValueError(rid)
        for b in r.new_block_ids:
            if not 0 <= b < NUM_BLOCKS:
                raise ValueError(b)
        start, count = r.num_computed_tokens, r.num_scheduled_tokens
        end = start + count
        if start < 0 or count < 1 or end > st.num_known or end > MAX_LEN or \
                end > (len(st.block_ids) + len(r.new_block_ids)) * BLOCK:
            raise ValueError(rid)
        total += r.num_scheduled_tokens
    scheduled = []
    for r in plan.cached_requests:                                   # _apply
        st = requests[r.request_id]
        st.block_ids.extend(r.new_block_ids)
        scheduled.append((st, r.num_computed_tokens, r.num_scheduled_tokens))
    return sum(r.num_scheduled_tokens for r in plan.cached_requests) + len(plan.new_requests)  # engine stats


def before(payload: bytes, requests: dict, tokens: list[int]) -> tuple[int, int]:
    t0 = time.perf_counter_ns()
    req = pb.step.WorkerRequest()
    req.ParseFromString(payload)
    plan = req.plan
    runner_reads(plan, requests)
    t1 = time.perf_counter_ns()
    result = pb.step.StepResult(step_id=plan.step_id, forward_ns=1000)   # old ModelRunner.collect
    for r, tok in zip(plan.cached_requests, tokens):
        out = result.outputs.add(request_id=r.request_id)
        out.token_ids.append(tok)
    sum(len(o.token_ids) for o in result.outputs)                        # engine stats
    pb.step.WorkerReply(result=result).SerializeToString()               # old Engine._reply_step
    return t1 - t0, time.perf_counter_ns() - t1


def after(payload: bytes, requests: dict, tokens: list[int]) -> tuple[int, int]:
    t0 = time.perf_counter_ns()
    plan = wire.request_from_bytes(payload, VOCAB)
    runner_reads(plan, requests)
    t1 = time.perf_counter_ns()
    result = StepResult(plan.step_id, [SampledOutput(r.request_id, [tok], [])                # ModelRunner.collect
                                       for r, tok in zip(plan.cached_requests, tokens)], 1000)
    sum(len(o.token_ids) for o in result.outputs)
    wire.result_reply(result)
    return t1 - t0, time.perf_counter_ns() - t1


def measure(fn, batch: int, steps: int) -> tuple[float, float]:
    """-> median (decode us, encode us) per step over `steps` decode steps."""
    ids = [f"req-{i:05d}-{'x' * 20}" for i in range(batch)]  # gateway ids are ~30 characters
    requests = {rid: _State(rid, list(range(i * 8, i * 8 + 8)), 10**6) for i, rid in enumerate(ids)}
    tokens = [1000 + i for i in range(batch)]
    dec, enc = [], []
    for step in range(steps):
        msg = pb.step.StepPlan(step_id=step)
        for i, rid in enumerate(ids):
            if (i + step) % 16 == 0:   # one request in 16 crosses a block boundary this step
                msg.cached_requests.add(request_id=rid, new_block_ids=[step % NUM_BLOCKS],
                                        num_computed_tokens=100, num_scheduled_tokens=1)
            else:
                msg.cached_requests.add(request_id=rid, num_computed_tokens=100, num_scheduled_tokens=1)
        d, e = fn(pb.step.WorkerRequest(plan=msg).SerializeToString(), requests, tokens)
        dec.append(d)
        enc.append(e)
        if step % 64 == 0:
            for st in requests.values():
                del st.block_ids[8:]   # keep the tables short, as finished requests would
    return statistics.median(dec) / 1e3, statistics.median(enc) / 1e3


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=2000)
    a = p.parse_args()
    measure(after, a.batch, 50)   # warm-up
    rows = {name: measure(fn, a.batch, a.steps) for name, fn in (("before", before), ("after", after))}
    for name, (d, e) in rows.items():
        print(f"{name:6s}: decode {d:7.1f} us  encode {e:7.1f} us  total {d + e:7.1f} us per step "
              f"({a.batch} cached requests)")
    (bd, be), (ad, ae) = rows["before"], rows["after"]
    print(f"after / before: decode {ad / bd:.2f}x, encode {ae / be:.2f}x, total {(ad + ae) / (bd + be):.2f}x")
    out = Path(__file__).resolve().parent / "results" / "worker_wire_cost.json"
    out.write_text(json.dumps({
        "schema": 1, "bench": "worker_wire_cost", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "batch": a.batch, "steps": a.steps, "machine": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()},
        "us_per_step": {name: {"decode": d, "encode": e, "total": d + e} for name, (d, e) in rows.items()},
        "ratio_after_over_before": {"decode": ad / bd, "encode": ae / be, "total": (ad + ae) / (bd + be)}},
        indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

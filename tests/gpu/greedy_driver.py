"""Greedy continuations with top-2 logprobs through a runner's execute (or submit / collect) on
step.proto plans, identical on CPU and GPU (one prefill step for every prompt, then decode steps),
for the SmolLM2 parity check."""
from __future__ import annotations

from services.common import pb


def greedy_with_top2(runner, prompts: list[list[int]], max_new: int, pipelined: bool = False):
    """-> (tokens [P][max_new], top2 [P][max_new] of ((id, logprob), (id, logprob))).
    `runner`: anything that takes pb plans and gives pb results: a ModelRunner behind
    services.worker.wire.ProtoRunner, or tp_worker's ZMQ client.
    pipelined: submit step N+1 before collecting step N, as the worker's engine loop does."""
    bs = runner.block_size
    plan = pb.step.StepPlan(step_id=0)
    next_block = 0
    for i, p in enumerate(prompts):
        n = -(-(len(p) + max_new) // bs)
        sp = pb.common.SamplingParams(temperature=0.0, logprobs=2)
        plan.new_requests.add(request_id=f"p{i}", token_ids=p, block_ids=range(next_block, next_block + n),
                              num_scheduled_tokens=len(p), sampling=sp)
        next_block += n
    toks = [[] for _ in prompts]
    top2 = [[] for _ in prompts]
    def take(res):
        if res.HasField("error"):
            raise RuntimeError(res.error.message)
        for out in res.outputs:
            i = int(out.request_id[1:])
            toks[i].append(out.token_ids[0])
            top2[i].append([(t.token_id, t.logprob) for t in out.logprobs[0].top])

    pending = None
    for step in range(max_new):
        if not pipelined:  # anything with execute(plan): the runner, or tp_worker's ZMQ client
            take(runner.execute(plan))
        else:
            submitted = runner.submit(plan)
            if pending is not None:
                take(runner.collect(pending))
            pending = submitted
        plan = pb.step.StepPlan(step_id=step + 1)
        for i, p in enumerate(prompts):
            plan.cached_requests.add(request_id=f"p{i}", num_computed_tokens=len(p) + step,
                                     num_scheduled_tokens=1)
    if pending is not None:
        take(runner.collect(pending))
    runner.execute(pb.step.StepPlan(step_id=max_new + 1, finished_ids=[f"p{i}" for i in range(len(prompts))]))
    return toks, top2


def compare(ref_toks, ref_top2, got_toks, got_top2) -> dict:
    """Per prompt: match, or the first diverging output index and the top-2 gaps there."""
    rows = []
    for i, (a, b) in enumerate(zip(ref_toks, got_toks)):
        j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        row = {"prompt": i, "match": j is None}
        if j is not None:
            (r1, r1lp), (r2, r2lp) = ref_top2[i][j][:2]
            (g1, g1lp), (g2, g2lp) = got_top2[i][j][:2]
            row.update(diverges_at=j, ref_top2=[r1, r2], ref_gap=r1lp - r2lp, got_top2=[g1, g2],
                       got_gap=g1lp - g2lp)
        rows.append(row)
    return {"matches": sum(r["match"] for r in rows), "prompts": len(rows), "rows": rows}

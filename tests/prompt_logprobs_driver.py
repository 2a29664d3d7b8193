"""Drives a ModelRunner through its wire edge with protobuf plans that prefill every prompt a
fixed number of tokens per step, for the prompt-logprob tests (tests/unit and tests/gpu)."""
from __future__ import annotations

from services.common import pb
from services.worker.runner import ModelRunner
from services.worker.wire import ProtoRunner


def run_chunked(runner: ModelRunner, prompts: dict[str, list[int]], chunk: int,
                k: int | None) -> tuple[dict[str, list], dict[str, int]]:
    """Every prompt prefilled `chunk` tokens per step (all of them in each step) -> the prompt
    logprobs each got (in arrival order) and its first sampled token."""
    wire = ProtoRunner(runner)
    blocks = iter(range(runner.num_blocks))
    tables = {rid: [next(blocks) for _ in range(-(-len(p) // runner.block_size))] for rid, p in prompts.items()}
    done = dict.fromkeys(prompts, 0)
    got: dict[str, list] = {rid: [] for rid in prompts}
    first: dict[str, int] = {}
    step = 0
    while any(done[r] < len(p) for r, p in prompts.items()):
        plan = pb.step.StepPlan(step_id=step)
        for rid, p in prompts.items():
            n = min(chunk, len(p) - done[rid])
            if n <= 0:
                continue
            if done[rid] == 0:
                sp = pb.common.SamplingParams(max_tokens=1)
                if k is not None:
                    sp.prompt_logprobs = k
                plan.new_requests.add(request_id=rid, token_ids=p, block_ids=tables[rid], sampling=sp,
                                      num_computed_tokens=0, num_scheduled_tokens=n)
            else:
                plan.cached_requests.add(request_id=rid, num_computed_tokens=done[rid], num_scheduled_tokens=n)
            done[rid] += n
        result = wire.execute(plan)
        assert not result.HasField("error"), result.error.message
        for out in result.outputs:
            got[out.request_id].extend(out.prompt_logprobs)
            if out.token_ids:
                first[out.request_id] = out.token_ids[0]
        step += 1
    wire.execute(pb.step.StepPlan(step_id=step, finished_ids=list(prompts)))
    return got, first

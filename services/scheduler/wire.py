"""Conversion between protobuf messages and the scheduler core's value types."""
from __future__ import annotations

from services.common import finish, pb
from services.scheduler.core import Request, RequestOutput, StepPlan, StepResult

_ERROR = {
    "invalid_argument": pb.common.ERROR_CODE_INVALID_ARGUMENT,
    "resource_exhausted": pb.common.ERROR_CODE_RESOURCE_EXHAUSTED,
    "unavailable": pb.common.ERROR_CODE_UNAVAILABLE,
    "internal": pb.common.ERROR_CODE_INTERNAL,
}


def request_from_submit(msg: pb.engine.EngineSubmit) -> Request:
    sp = msg.sampling
    if msg.HasField("kv_handoff"):   # prefill/decode disaggregation (docs/pd.md)
        h = msg.kv_handoff
        req = _request(msg, sp)
        req.prefill_only = h.prefill_only
        if h.resume_token_ids:
            for t in h.resume_token_ids:
                req.append_output(t)
            req.handoff = True
            req.kv_tier_blocks = max(0, h.num_kv_blocks)
            if h.peer and len(h.src_block_ids) >= req.kv_tier_blocks:   # direct (docs/pd.md)
                req.peer, req.src_block_ids = h.peer, list(h.src_block_ids)
                req.lease_deadline_ns = h.lease_deadline_unix_ns
            elif h.peer:
                req.kv_tier_blocks = 0   # malformed: recompute
        return req
    return _request(msg, sp)


def _request(msg: pb.engine.EngineSubmit, sp) -> Request:
    return Request(
        request_id=msg.request_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        max_tokens=sp.max_tokens,
        sampling=sp,
        min_tokens=sp.min_tokens,
        stop_token_ids=frozenset(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        priority=msg.priority,
        cache_salt=msg.cache_salt,
        wants_prompt_logprobs=sp.HasField("prompt_logprobs"),
        trace=msg.trace if msg.HasField("trace") else None,
    )


def plan_to_proto(plan: StepPlan) -> pb.step.WorkerRequest:
    msg = pb.step.StepPlan(step_id=plan.step_id, finished_ids=plan.finished_ids)
    for r in plan.new_requests:
        nr = msg.new_requests.add(request_id=r.request_id, token_ids=r.token_ids, block_ids=r.block_ids,
                                  num_computed_tokens=r.num_computed_tokens,
                                  num_scheduled_tokens=r.num_scheduled_tokens,
                                  num_output_tokens=r.num_output_tokens)
        if r.sampling is not None:
            nr.sampling.CopyFrom(r.sampling)
        if r.trace is not None:
            nr.trace.CopyFrom(r.trace)
    add = msg.cached_requests.add
    for r in plan.cached_requests:
        # Hot path (every running request, every step): pass only non-empty fields.
        if r.num_spec_tokens:
            add(request_id=r.request_id, new_block_ids=r.new_block_ids, num_computed_tokens=r.num_computed_tokens,
                num_scheduled_tokens=r.num_scheduled_tokens, num_spec_tokens=r.num_spec_tokens)
        elif r.new_block_ids:
            add(request_id=r.request_id, new_block_ids=r.new_block_ids, num_computed_tokens=r.num_computed_tokens,
                num_scheduled_tokens=r.num_scheduled_tokens)
        else:
            add(request_id=r.request_id, num_computed_tokens=r.num_computed_tokens,
                num_scheduled_tokens=r.num_scheduled_tokens)
    if plan.host_offloads or plan.host_loads or plan.tier_loads or plan.tier_saves:   # KV tiers
        for b, slot in plan.host_offloads:
            msg.host_offloads.add(block_id=b, slot=slot)
        for b, slot in plan.host_loads:
            msg.host_loads.add(block_id=b, slot=slot)
        for t in plan.tier_loads:
            msg.tier_loads.add(request_id=t.request_id, block_ids=t.block_ids, block_hashes=t.block_hashes,
                               peer=t.peer, src_block_ids=t.src_block_ids,
                               lease_deadline_unix_ns=t.lease_deadline_ns)
        for t in plan.tier_saves:
            msg.tier_saves.add(request_id=t.request_id, block_ids=t.block_ids, block_hashes=t.block_hashes)
    return pb.step.WorkerRequest(plan=msg)


def result_from_proto(msg: pb.step.StepResult) -> StepResult:
    error = (msg.error.message or "worker error") if msg.HasField("error") else None
    # SampledOutput messages already have the fields the core reads (request_id, token_ids,
    # logprobs): handing them over as they are saves a copy per request per step.
    return StepResult(step_id=msg.step_id, error=error, sampled=list(msg.outputs),
                      kv_loads=list(msg.kv_loads) if msg.kv_loads else [],
                      kv_saves=list(msg.kv_saves) if msg.kv_saves else [])


def outputs_to_proto(step_id: int, outputs: list[RequestOutput]) -> pb.engine.OutputBatch:
    batch = pb.engine.OutputBatch(step_id=step_id)
    add = batch.outputs.add
    for o in outputs:
        # Hot path: zero-valued fields are left out (cheaper to build, same on the wire).
        ro = add(request_id=o.request_id, new_token_ids=o.new_token_ids, num_prompt_tokens=o.num_prompt_tokens,
                 stop_token_id=o.stop_token_id)
        if o.finish_reason is not None:
            ro.finish_reason = finish.to_proto(o.finish_reason)
        if o.num_cached_tokens:
            ro.num_cached_tokens = o.num_cached_tokens
        if o.handoff_blocks >= 0:
            ro.handoff.num_kv_blocks = o.handoff_blocks
            if o.handoff_peer:
                ro.handoff.peer = o.handoff_peer
                ro.handoff.block_ids.extend(o.handoff_block_ids)
                ro.handoff.lease_deadline_unix_ns = o.handoff_deadline_ns
        if o.logprobs:
            ro.logprobs.extend(o.logprobs)
        if o.prompt_logprobs:
            ro.prompt_logprobs.extend(o.prompt_logprobs)
        if o.timing is not None:
            t = ro.timing
            t.queued_unix_ns, t.first_scheduled_unix_ns, t.first_token_unix_ns, t.finished_unix_ns = o.timing
        if o.error_code is not None:
            ro.error.code = _ERROR.get(o.error_code, pb.common.ERROR_CODE_INTERNAL)
            ro.error.message = o.error_message
    return batch

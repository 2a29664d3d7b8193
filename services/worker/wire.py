"""Conversion between step.proto messages and the worker's value types (plan.py).

This is the worker's whole protobuf edge: the engine loop decodes each WorkerRequest here and
encodes each reply here; the runners, sampling, kernels and step tracing see only plan.py's
dataclasses. Torch-free, so the simulated worker shares it.
"""
from __future__ import annotations

import logging

from google.protobuf.message import DecodeError

from services.common import pb
from services.common.sampling_rules import MAX_LOGPROBS, SamplingRuleError, check_engine_sampling
from services.common.structured import grammar_of, kind_of
from services.worker.plan import (INTERNAL, INVALID_ARGUMENT, CachedRequest, Hello, NewRequest, SamplingConfig,
                                  StepPlan, StepResult, TierBlocks, TraceContext, WorkerInfo)

log = logging.getLogger(__name__)

_ERROR = {INVALID_ARGUMENT: pb.common.ERROR_CODE_INVALID_ARGUMENT, INTERNAL: pb.common.ERROR_CODE_INTERNAL}


class WireError(ValueError):
    """Bytes that are no WorkerRequest, or an empty one: answered with zmq_link.error_reply."""


def sampling_from_proto(sp: pb.common.SamplingParams, vocab_size: int) -> SamplingConfig:
    """A SamplingParams as the sampler's config; zero values mean "default" (see common.proto).
    The gateway has validated it already; check_engine_sampling (the one rulebook) stands between
    the worker and bad bytes on its link: SamplingRuleError, and the plan is refused."""
    check_engine_sampling(sp, vocab_size)
    return SamplingConfig(
        temperature=float(sp.temperature),
        top_p=1.0 if sp.top_p == 0.0 else float(sp.top_p),
        top_k=sp.top_k if sp.top_k > 0 else 0,
        min_p=float(sp.min_p),
        presence_penalty=float(sp.presence_penalty),
        frequency_penalty=float(sp.frequency_penalty),
        repetition_penalty=1.0 if sp.repetition_penalty == 0.0 else float(sp.repetition_penalty),
        seed=sp.seed if sp.HasField("seed") else None,
        # More top logprobs than the public limit are clamped: only the worker's work is bounded here.
        logprobs=min(sp.logprobs, MAX_LOGPROBS, vocab_size) if sp.HasField("logprobs") else None,
        prompt_logprobs=(min(sp.prompt_logprobs, MAX_LOGPROBS, vocab_size)
                         if sp.HasField("prompt_logprobs") else None),
        logit_bias=tuple((int(t), float(b)) for t, b in sorted(sp.logit_bias.items())),
        min_tokens=max(0, sp.min_tokens),
        stop_token_ids=tuple(int(t) for t in sp.stop_token_ids if 0 <= t < vocab_size),
        ignore_eos=sp.ignore_eos,
        structured=structured_from_proto(sp) if sp.HasField("structured") else None,
    )


def structured_from_proto(sp: pb.common.SamplingParams) -> tuple[str, str]:
    """(kind, grammar text) of a set constraint. The gateway validated it (structured.check); one
    that still fails to convert gives the grammar "" so that only its own request ends (the runner
    forces EOS), never the plan with the other requests of its step."""
    so = sp.structured
    kind = kind_of(so) or ""
    try:
        return kind, grammar_of(so)
    except Exception as exc:  # noqa: BLE001 - llguidance raises ValueError, a bad proto others
        log.warning("structured output (%s) not convertible: %s", kind, type(exc).__name__)
        return kind, ""


def plan_from_proto(msg: pb.step.StepPlan, vocab_size: int) -> StepPlan:
    """One pass over the plan. Bad sampling parameters give a plan marked `invalid` (no
    requests) rather than an exception, so the runner rejects it in its place among the steps."""
    new = []
    for r in msg.new_requests:
        try:
            sampling = sampling_from_proto(r.sampling, vocab_size)
        except SamplingRuleError as exc:
            return StepPlan(msg.step_id, [], [], [], invalid=f"request {r.request_id}: {exc}")
        t = r.trace
        new.append(NewRequest(r.request_id, list(r.token_ids), list(r.block_ids), sampling, r.num_computed_tokens,
                              r.num_scheduled_tokens, r.num_output_tokens,
                              TraceContext(t.traceparent, t.tracestate) if t.traceparent else None))
    # Hot path (every running request, every step): positional arguments, one comprehension, and
    # no list() of an empty repeated field (measured: 4x the cost of the rest of the row).
    cached = [CachedRequest(r.request_id, list(nb) if (nb := r.new_block_ids) else [], r.num_computed_tokens,
                            r.num_scheduled_tokens, r.num_spec_tokens) for r in msg.cached_requests]
    plan = StepPlan(msg.step_id, new, cached, list(msg.finished_ids))
    if msg.host_offloads or msg.host_loads or msg.tier_loads or msg.tier_saves:   # KV tiers (kv_tiers.py)
        plan.host_offloads = [(c.block_id, c.slot) for c in msg.host_offloads]
        plan.host_loads = [(c.block_id, c.slot) for c in msg.host_loads]
        plan.tier_loads = [_tier_blocks(t) for t in msg.tier_loads]
        plan.tier_saves = [_tier_blocks(t) for t in msg.tier_saves]
    return plan


def _tier_blocks(t: pb.step.KvTierBlocks) -> TierBlocks:
    return TierBlocks(t.request_id, list(t.block_ids), list(t.block_hashes), t.peer, list(t.src_block_ids),
                      t.lease_deadline_unix_ns)


def request_from_bytes(payload: bytes, vocab_size: int) -> Hello | StepPlan:
    req = pb.step.WorkerRequest()
    try:
        req.ParseFromString(payload)
    except DecodeError:
        raise WireError("undecodable WorkerRequest") from None
    kind = req.WhichOneof("kind")
    if kind == "plan":
        return plan_from_proto(req.plan, vocab_size)
    if kind == "hello":
        return Hello(req.hello.block_size)
    raise WireError("empty WorkerRequest")


def _fill_result(msg: pb.step.StepResult, result: StepResult) -> None:
    msg.step_id = result.step_id
    msg.forward_ns = result.forward_ns
    add = msg.outputs.add
    for o in result.outputs:
        out = add(request_id=o.request_id)
        if o.prompt_logprobs:
            _fill_prompt_logprobs(out.prompt_logprobs, o.prompt_logprobs)
        toks = o.token_ids
        if not toks:  # a prompt chunk short of the prompt's end
            continue
        # One sampled token per output: append beats passing a list to add() (measured, 30%).
        if len(toks) == 1:
            out.token_ids.append(toks[0])
        else:
            out.token_ids.extend(toks)
        if o.num_draft_tokens:
            out.num_draft_tokens = o.num_draft_tokens
        for lp in o.logprobs:
            m = out.logprobs.add(token_id=lp.token_id, logprob=lp.logprob)
            for tid, val in lp.top:
                m.top.add(token_id=tid, logprob=val)
    if result.error is not None:
        msg.error.code = _ERROR[result.error.code]
        msg.error.message = result.error.message
    for r in result.kv_loads:
        msg.kv_loads.add(request_id=r.request_id, num_loaded=r.num_loaded, num_requested=r.num_requested,
                         bytes=r.bytes, duration_ns=r.duration_ns)
    for r in result.kv_saves:
        msg.kv_saves.add(request_id=r.request_id, num_blocks=r.num_blocks, num_saved=r.num_saved)


def _fill_prompt_logprobs(field, lps) -> None:
    for lp in lps:
        m = field.add(position=lp.position, token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank)
        for tid, val in lp.top:
            m.top.add(token_id=tid, logprob=val)


def result_to_proto(result: StepResult) -> pb.step.StepResult:
    msg = pb.step.StepResult()
    _fill_result(msg, result)
    return msg


def result_reply(result: StepResult) -> bytes:
    """The serialized WorkerReply of a step (built in place: no copy of the result message)."""
    reply = pb.step.WorkerReply()
    reply.result.SetInParent()
    _fill_result(reply.result, result)
    return reply.SerializeToString()


def info_to_proto(info: WorkerInfo) -> pb.step.WorkerInfo:
    msg = pb.step.WorkerInfo(num_kv_blocks=info.num_kv_blocks, block_size=info.block_size,
                             max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                             eos_token_ids=info.eos_token_ids, model_name=info.model_name, device=info.device,
                             num_host_kv_blocks=info.num_host_kv_blocks, kv_export_addr=info.kv_export_addr)
    if info.kv_namespace is not None:
        msg.kv_namespace.CopyFrom(info.kv_namespace)
    return msg


def info_reply(info: WorkerInfo) -> bytes:
    return pb.step.WorkerReply(info=info_to_proto(info)).SerializeToString()


class ProtoRunner:
    """A runner behind this edge in one process: step.proto plans in, step.proto results out,
    converted exactly as the engine converts them off its socket. For tests and benchmarks that
    build protobuf plans (by hand, or with the scheduler's wire.plan_to_proto)."""

    def __init__(self, runner) -> None:
        self.runner = runner

    @property
    def block_size(self) -> int:
        return self.runner.block_size

    def hello(self, block_size: int) -> pb.step.WorkerInfo:
        return info_to_proto(self.runner.hello(block_size))

    def submit(self, msg: pb.step.StepPlan):
        return self.runner.submit(plan_from_proto(msg, self.runner.vocab_size))

    def collect(self, pending) -> pb.step.StepResult:
        return result_to_proto(self.runner.collect(pending))

    def execute(self, msg: pb.step.StepPlan) -> pb.step.StepResult:
        return self.collect(self.submit(msg))

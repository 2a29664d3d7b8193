"""Drives a ModelRunner with the real scheduler core, synchronously or pipelined like the worker's
engine loop (submit step N+1, then collect step N), for the overlap tests on CPU and GPU. Plans
and results cross the worker's wire edge (wire.ProtoRunner) as they do over ZMQ."""
from __future__ import annotations

from collections import deque

import torch

from services.common import pb
from services.scheduler import wire
from services.scheduler.core import Request, Scheduler, SchedulerConfig
from services.worker.runner import ModelRunner
from services.worker.wire import ProtoRunner

BLOCK = 4
NEW = 10


def sampling_mix(i: int) -> pb.common.SamplingParams:
    """Greedy, seeded random, penalties, logprobs: one kind per request, in turn."""
    kind = i % 4
    if kind == 0:
        return pb.common.SamplingParams(ignore_eos=True)
    if kind == 1:
        return pb.common.SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True)
    if kind == 2:
        return pb.common.SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, ignore_eos=True)
    return pb.common.SamplingParams(temperature=0.7, seed=7 + i, logprobs=3, ignore_eos=True)


def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(4, vocab, (int(torch.randint(3, 14, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def run(model, ps, samplings, *, overlap: bool, num_blocks=64, budget=64, executor=None, depth=None,
        tokenizer_path=None, watch=None, spec=None, new_tokens=NEW, prefix_caching=False, max_seqs=8,
        draft_model=None, draft_blocks=None):
    """Drive the runner with the scheduler core, `depth` plans in flight (default: 2 with overlap,
    else 1) in the engine's order (submit N+1, then collect N). Without overlap the runner reads
    every step's tokens at its submit. `watch(runner)` may wrap the runner's methods to observe it;
    `spec` (a SpecConfig) turns speculative decoding on in both the scheduler and the runner;
    `draft_model` (a loaded model) is method draft_model's drafter, with `draft_blocks` blocks
    (default: the target's count).
    -> (outputs, logprobs, scheduler, most unresolved steps)."""
    runner = ModelRunner(model, model_name="tiny", kv_cache_bytes=0, num_kv_blocks=num_blocks, block_size=BLOCK,
                         tokenizer_path=tokenizer_path)
    info = runner.hello(BLOCK)
    if spec is not None:
        from services.worker.spec.decoder import SpecDecoder
        draft = None
        if draft_model is not None:
            from services.worker.spec.draft_model import DraftModel
            draft = DraftModel(draft_model, draft_blocks or info.num_kv_blocks, BLOCK)
        runner.enable_spec(SpecDecoder(spec, draft=draft))
    if watch is not None:
        watch(runner)
    if executor is not None:
        runner.gpu = executor(runner)
    runner.overlap = overlap
    wired = ProtoRunner(runner)
    cfg = SchedulerConfig(max_model_len=128, max_num_batched_tokens=budget, max_num_seqs=max_seqs, block_size=BLOCK,
                          enable_prefix_caching=prefix_caching,
                          num_spec_tokens=spec.num_speculative_tokens if spec is not None else 0)
    s = Scheduler(cfg, info.num_kv_blocks, frozenset(info.eos_token_ids), info.vocab_size)
    for i, (p, sp) in enumerate(zip(ps, samplings)):
        s.add_request(Request(f"r{i}", list(p), new_tokens, sampling=sp, ignore_eos=True))
    outputs: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    depth = depth or (2 if overlap else 1)
    inflight: deque = deque()
    max_unresolved = 0

    def finish():
        plan, handle = inflight.popleft()
        result = wired.collect(handle)
        assert not result.HasField("error"), result.error.message
        for out in s.update(plan, wire.result_from_proto(result)):   # what a client gets (trimmed at a stop)
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.logprobs:
                logprobs.setdefault(out.request_id, []).extend(lp.logprob for lp in out.logprobs)

    while inflight or s.has_work():
        if len(inflight) < depth and s.has_work():
            plan = s.schedule()
            if not plan.is_empty():
                msg = wire.plan_to_proto(plan).plan
                inflight.append((plan, wired.submit(msg)))
                max_unresolved = max(max_unresolved, runner.num_unresolved)
                if len(inflight) < depth:
                    continue
            else:
                for out in s.take_pending_outputs():
                    outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if inflight:
            finish()
    s.runner = runner   # for tests that read the runner (e.g. its speculative decoding counts)
    return outputs, logprobs, s, max_unresolved

"""Device-fed speculative steps: n-gram drafts proposed on the device (or suffix and draft-model
chains checked there: spec/device_chains.py) while the previous step still runs, so a speculating
step keeps its overlap with the host (MRv2's design: the next step is planned before this one's
acceptance is known, and the accepted count is fed forward on the device).

A step is device-fed when every row is a decode row of a request whose sampling reads no host
token history (greedy or random; no penalties, no grammar, min_tokens reached), at most one step
is in flight, and no row ends a host-verified run still in flight. Such a row's step is read
first (spec/steps.read_first) and the plan asked again: a step with prefill rows (a request
arriving) is a host step with host drafts, and without that second ask every step after it would
stay on the host, each one reading its predecessor before it is built. The host decides only how many drafts each row may get (the verify width
q, from the acceptance measured so far and the step times: measured submit-to-submit periods per
width, else the calibrated cost; device drafts cost no sync, so none is priced) and the block
tables; the device (spec/device_ngram.py) proposes from each request's
device row, and the executor (gpu_fed.py) writes the input ids, positions, KV slots and context
lengths from the device lengths before replaying the verify (or decode) CUDA graph. Behind the
sampler the device appends each row's accepted drafts and bonus token to its row. The host reads
the step one step later, like any other, together with the drafts it verified.

Host bookkeeping while such a step is in flight: a request's num_computed_tokens is a lower bound
(as if nothing was accepted), `dev_slack` is the most the last fed step can have moved it, and
the pending token of a step with drafts sits at no fixed sample row (spec_pending), so a step
built on the host reads the previous step first (spec/steps.read_first), as after any verify
step. A fed step of width 1 samples into the previous-token buffer like a plain step, so the
step after it may be a plain overlapped host step. Random rows draw with the seed of their true
position (sampling.SampleRow.window / shift)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from services.worker.spec.decoder import accepted_prefix
from services.worker.spec.dynamic_k import MIN_GAIN, expected_run

FED_SLOTS = 64            # requests with a device row at once
MAX_FED_ROWS = 32         # rows of a device-fed step with drafts (the verify graphs' largest batch)
HOST_PROBE_EVERY = 64     # steps: how often chains leave one step to the host path to measure it


def enabled() -> bool:
    """MESHLLM_DEVICE_DRAFTS=0 turns device-fed steps off (benchmarks compare both)."""
    return os.environ.get("MESHLLM_DEVICE_DRAFTS", "1") != "0"


@dataclass
class FedPlan:
    width: int                 # q: tokens per row (1 + the most drafts)
    ks: dict[str, int]         # request id -> drafts it may get (<= width - 1)


@dataclass
class FedStep:
    """What resolving a device-fed step needs besides its sampled tokens."""
    drafts: torch.Tensor | list   # [n, q - 1] host copy of the drafts each row verified (NO_DRAFT pad)
    rows: list[tuple[int, int]]   # per row: (offset of its sampled tokens, how many)
    ks: list[int]


def chains_enabled() -> bool:
    """Device-fed suffix and draft-model steps (chains): on unless MESHLLM_DEVICE_CHAINS=0 (the
    host path then serves those methods, as the benchmark's `suffix_host` compares). On GPUs
    too since measured on the H200; host_path_pays picks the host path per batch where that
    measures faster."""
    return os.environ.get("MESHLLM_DEVICE_CHAINS", "1") != "0"


def device_proposer(cfg, max_len: int, device: torch.device):
    """The device side of a method's drafts: n-gram rows searched on the device, or the suffix
    proposer's host chains or the draft model's device ones checked there (spec/device_chains.py)."""
    if cfg.method == "ngram":
        from services.worker.spec.device_ngram import DeviceNgram
        return DeviceNgram(cfg.prompt_lookup_min, cfg.prompt_lookup_max, max_len, cfg.num_speculative_tokens + 1,
                           FED_SLOTS, device)
    from services.worker.spec.device_chains import DeviceChains
    return DeviceChains(cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max, max_len,
                        cfg.num_speculative_tokens + 1, FED_SLOTS, device)


def eligible(st) -> bool:
    """Can the request's rows be sampled without host tokens (no history-reading processors)?"""
    cfg = st.sampling
    return not cfg.has_penalties and st.matcher is None and st.num_output_tokens >= cfg.min_tokens


def fed_plan(runner, plan) -> FedPlan | None:
    """Run this plan as a device-fed step? Decided before the plan is validated (no state is
    touched): anything unusual answers None and the plan takes the host path."""
    spec = runner.spec
    dev = getattr(spec, "device", None)
    if (dev is None or runner.tp_spec is not None or not runner.overlap or len(runner._unresolved) > 1
            or plan.invalid or plan.new_requests or not plan.cached_requests):
        return None
    bs = runner.block_size
    limit = runner.model.max_model_len
    if runner.gpu is not None:
        limit = min(limit, runner.gpu.max_blocks * bs)
    rows, must_feed, new_slots = [], False, 0
    for r in plan.cached_requests:
        st = runner.requests.get(r.request_id)
        if st is None or r.num_scheduled_tokens != 1 or not eligible(st):
            return None
        start = max(r.num_computed_tokens, st.num_computed_tokens)
        if start + 1 != st.num_known:
            return None
        if st.spec_pending and not st.dev_live:   # a host verify run's end: only the host can say
            return None
        # The end of a device-verified run: its position and token are known on the device only.
        must_feed |= st.spec_pending
        new_slots += r.request_id not in dev.slot
        p_hi = start + st.dev_slack                  # the furthest the row's known token can be
        cap = min((len(st.block_ids) + len(r.new_block_ids)) * bs, limit)
        rows.append((r.request_id, min(r.num_spec_tokens, cap - 1 - p_hi), p_hi))
    if new_slots > len(dev._free):
        return None
    n = len(rows)
    ws = [w for w in widths(runner, n) if all(p + w <= limit for _, _, p in rows)]
    if not ws:
        return None
    width = _choose_width(spec, rows, n, ws)
    if width > 1 and getattr(dev, "chain_len", 0) and host_path_pays(spec, rows, n, width):
        return None   # host drafts after a sync: measured faster for chains at this batch
    if width == 1 and not must_feed:   # nothing to draft and nothing to feed: a plain overlapped step
        # ... and no host drafts either: the same measures said drafting does not pay this step
        # (else the host path's cost model would sync and draft what this declined).
        spec.fed_declined_at = spec.acceptance.clock
        return None
    return FedPlan(width, {rid: max(0, min(width - 1, room)) for rid, room, _ in rows})


def host_path_pays(spec, rows: list[tuple[str, int, int]], n: int, width: int) -> bool:
    """Chains (suffix, draft model) against the host path, both measured: should this step of n
    rows take the host path (a sync, then the proposer's drafts from every token) instead of a
    device-fed step of `width`? Yes when host speculating steps of about n rows have emitted more
    tokens a second (SpecDecoder.host_spec_rate) than fed steps of this width are expected to
    (their measured period; the acceptance and chain hit rates measured so far). Where the host
    path is not measured, one step in HOST_PROBE_EVERY is left to it (the same answer for every
    ask of that step), once fed steps of this width are. A fixed dynamic_k table, or fed steps not
    measured, say no. On the H200 (SmolLM2) the host path was the faster at one row (a fed step's
    host side outweighed its GPU step) and chains at 32 (docs/speculative_decoding.md)."""
    fed_t = spec.period(n, width)
    if fed_t is None or spec.cfg.fixed_k(n) is not None:
        return False
    host = spec.host_spec_rate(n)
    clock = spec.acceptance.clock
    if host is None:
        if clock - spec.host_probe_at >= HOST_PROBE_EVERY:
            spec.host_probe_at = clock
        return spec.host_probe_at == clock
    return host > (n + _drafts_worth(_row_rates(spec, rows), width)) / fed_t


def _row_rates(spec, rows: list[tuple[str, int, int]]) -> list[tuple[float, float, int]]:
    """(hit rate, acceptance, room) per row, from what was measured so far."""
    acc = spec.acceptance
    return [(acc.hit(rid), acc.rate(rid), room) for rid, room, _ in rows]


def _drafts_worth(vals: list[tuple[float, float, int]], width: int) -> float:
    """Tokens a step of this width is expected to emit beyond one a row: the j-th draft of a row
    with acceptance a and hit rate h is worth h * a^j."""
    return sum(h * expected_run(a, min(width - 1, room)) for h, a, room in vals)


def widths(runner, n: int) -> list[int]:
    """The verify widths a device-fed step of n rows may use (1: no drafts)."""
    k = runner.spec.cfg.num_speculative_tokens
    if runner.gpu is None:
        return list(range(1, k + 2))
    if n > MAX_FED_ROWS:
        return [1]
    from services.worker.gpu_verify import verify_widths   # imports triton: GPU only
    return [1, *verify_widths(k)]


def _choose_width(spec, rows: list[tuple[str, int, int]], n: int, widths: list[int]) -> int:
    """The width with the most emitted tokens per second (the j-th draft of a request with
    acceptance a and hit rate h is worth h * a^j tokens); 1 unless a width gains MIN_GAIN."""
    fixed = spec.cfg.fixed_k(n)
    if fixed is not None:
        return next((w for w in widths if w >= fixed + 1), widths[-1]) if fixed else 1
    if spec.spec_cost is None:        # not calibrated: draft fully
        return widths[-1]
    vals = _row_rates(spec, rows)
    # Step times: measured periods where there are some (the loop's host side included), else the
    # calibrated GPU time plus the host time plain steps are measured to add.
    gpu_plain = (spec.plain_cost or spec.spec_cost).cost(n)
    plain_t = spec.period(n, 1) or gpu_plain
    extra = plain_t - gpu_plain
    # A draft model's chain: about 2 (w - 1) draft steps (the step in flight's tokens, then the drafts).
    draft_step = spec.draft_cost.cost(n) if spec.draft_cost is not None else 0.0
    best_w, best = 1, MIN_GAIN * n / plain_t
    for w in widths:
        if w == 1:
            continue
        rate = (n + _drafts_worth(vals, w)) / (spec.period(n, w) or spec.spec_cost.cost(n * w, n) + extra + draft_step * 2 * (w - 1))
        if rate > best:
            best_w, best = w, rate
    return best_w


@torch.inference_mode()
def launch(runner, scheduled, fed: FedPlan):
    """Propose on the device, run the step fed from the device, sample, append the accepted
    tokens on the device -> (the sampler's handle, the FedStep to resolve it with); nothing waits
    for the device."""
    from services.worker.sampling import SampleRow, sample_async, to_device
    dev = runner.spec.device
    device = runner.model.device
    q = fed.width
    n = len(scheduled)
    sync, slots, ks = [], [], []
    for s in scheduled:
        st = s.state
        rid = st.request_id
        slots.append(dev.assign(rid))
        ks.append(fed.ks[rid])
        if not st.dev_live:
            sync.append((rid, st.token_ids, st.pending_row if st.num_pending else -1))
    dev.sync(sync, runner.gpu.prev_tokens if runner.gpu is not None else runner._cpu_prev)
    starts = [s.start for s in scheduled]
    # Chains (spec/device_chains.py): the suffix proposer's, made on the host while the step before
    # runs, or the draft model's, drafted on the device before this step's forward.
    chain, chains_dev = [], None
    if q > 1 and getattr(dev, "chain_len", 0):
        if runner.spec.draft is not None:
            chains_dev = dev.draft_chains(runner.spec.draft, scheduled, ks)
        else:
            chain = dev.host_chains(runner.spec, scheduled, ks)
    if runner.gpu is not None:   # one kernel proposes and writes the inputs (gpu_fed.py)
        from services.worker.gpu_fed import run_fed   # imports triton: GPU only
        caps = [min(len(s.state.block_ids) * runner.block_size, runner.model.max_model_len) for s in scheduled]
        up = to_device([*slots, *ks, *caps, *starts, *chain], torch.long, device)
        meta = up[:4 * n].view(4, n)
        slots_t = meta[0]
        logits, drafts, shift = run_fed(runner.gpu, dev, [s.state.block_ids for s in scheduled], caps, meta, q,
                                        chains=up[4 * n:].view(n, -1) if chain else chains_dev)
        offsets = [(i * q, q) for i in range(n)]
        d_host = drafts.to("cpu", non_blocking=True) if device.type == "cuda" else drafts.clone()
    else:   # the torch twin, read back (free on a CPU) and run through the reference forward
        slots_t = to_device(slots, torch.long, device)
        span = max(len(s.state.token_ids) + s.state.num_pending + s.state.dev_slack for s in scheduled) + 1
        ks_t = to_device(ks, torch.long, device)
        if chain or chains_dev is not None:
            chains_t = torch.tensor(chain).view(n, -1) if chain else chains_dev
            drafts, length = dev.propose(slots_t, ks_t, q - 1, span, chains=chains_t)
        else:
            drafts, length = dev.propose(slots_t, ks_t, q - 1, span)
        logits, offsets, d_host = _forward_cpu(runner, scheduled, dev.inputs(slots_t, length), drafts, length)
        shift = length - 1 - to_device(starts, torch.long, device)
    # Random rows draw at position p + 1 + j; the host knows p up to the last fed step's drafts.
    rows = [None] * sum(w for _, w in offsets)
    for i, (s, (off, w)) in enumerate(zip(scheduled, offsets)):
        st = s.state
        done = st.num_output_tokens + st.num_pending
        if st.sampling.greedy:   # no seed, no position: one row object serves every position
            rows[off:off + w] = [SampleRow(st.sampling, [], done, st.base_seed)] * w
        else:
            rows[off:off + w] = [SampleRow(st.sampling, [], done + j, st.base_seed, position=s.start + 1 + j,
                                           window=st.dev_slack, shift=shift[i:i + 1]) for j in range(w)]
    # Without drafts each row's token lands at a fixed row of the previous-token buffer, as a plain
    # step's: the next step can be built on the host (its position is exact once this one's
    # predecessor is read).
    handle = sample_async(logits, rows, runner.model.cfg.eos_token_ids, out=runner._prev_out(n) if q == 1 else None)
    sampled = handle.device_tokens
    if runner.gpu is None:   # packed rows -> [n, q], NO_DRAFT where a row ran fewer
        grid = torch.full((n * q,), -1, dtype=torch.long)
        dest = [0] * len(rows)
        for i, (off, w) in enumerate(offsets):
            dest[off:off + w] = range(i * q, i * q + w)
        grid.index_copy_(0, torch.tensor(dest, dtype=torch.long), sampled)
        sampled = grid
    if runner.gpu is not None:
        from services.worker.kernels.spec_fed import commit   # imports triton: GPU only
        commit(dev.hist, dev.hlen, slots_t, drafts, sampled.view(n, q), lead=dev.lead, max_len=dev.max_len)
    else:
        dev.commit(slots_t, drafts, sampled.view(n, q))
    for i, (s, k) in enumerate(zip(scheduled, ks)):
        st = s.state
        st.num_computed_tokens = s.start + 1       # a lower bound until the step is read
        st.num_pending += 1
        st.pending_row = i if q == 1 else -1
        st.spec_pending = q > 1
        st.dev_live = True
        st.dev_slack = k
    runner.spec.fed()
    if any(ks):
        runner.spec.stepped()
    return handle, FedStep(d_host, offsets, ks)


def _forward_cpu(runner, scheduled, tok0, drafts, length):
    """The CPU twin: the device's choices read back (free on a CPU) and run packed through the
    reference forward -> (logits of every row, (offset, count) per row, drafts)."""
    from services.worker.attention import SeqSchedule
    p_all, t_all, d_all = (length - 1).tolist(), tok0.tolist(), drafts.tolist()
    rows = []
    for s, p, t, d in zip(scheduled, p_all, t_all, d_all):
        cap = min(len(s.state.block_ids) * runner.block_size, runner.model.max_model_len)
        p = min(p, cap - 1)      # only a finished request's step in flight can be past its end
        rows.append((s.state.block_ids, p, [t, *[x for x in d if x >= 0][:max(0, cap - 1 - p)]]))
    ids, positions, seqs, offsets = [], [], [], [None] * len(rows)
    # Single-token sequences first (attention.py's order).
    for i in sorted(range(len(rows)), key=lambda i: len(rows[i][2]) != 1):
        blocks, p, toks = rows[i]
        offsets[i] = (len(ids), len(toks))
        ids.extend(toks)
        positions.extend(range(p, p + len(toks)))
        seqs.append(SeqSchedule(blocks, p, len(toks)))
    logits, _ = runner._forward_reference(ids, positions, seqs, list(range(len(ids))))
    return logits, offsets, drafts.clone()


def resolve(runner, step, tokens) -> None:
    """Read a device-fed step into the requests' host state (runner._resolve's twin)."""
    fed = step.fed
    d_all = fed.drafts.tolist() if isinstance(fed.drafts, torch.Tensor) else fed.drafts
    spec = runner.spec
    for s, (off, w), d, k in zip(step.sampling_seqs, fed.rows, d_all, fed.ks):
        st = s.state
        rid = st.request_id
        toks = tokens[off:off + w]
        drafts = []
        for x in d[:w - 1]:
            if x < 0:
                break
            drafts.append(x)
        a = accepted_prefix(drafts, [t.token_id for t in toks])
        toks = toks[:a + 1]
        s.drafts = drafts                      # what this row verified (SampledOutput.num_draft_tokens)
        if k:
            spec.acceptance.found(rid, bool(drafts))
        if drafts:
            spec.observe(rid, len(drafts), a)
        st.num_pending -= 1
        if not st.num_pending:                 # else a later step in flight set them
            st.spec_pending = False
            st.dev_slack = 0
        for tok in toks:
            st.token_ids.append(tok.token_id)
            st.num_output_tokens += 1
        if runner.requests.get(rid) is st:     # not finished (or preempted and started again) since
            spec.extend(rid, [t.token_id for t in toks])
            if rid in spec.device.synced:      # the device row holds exactly these tokens
                spec.device.synced[rid] = len(st.token_ids)
        st.num_computed_tokens = max(st.num_computed_tokens, len(st.token_ids) + st.num_pending - 1)
        step.sampled[rid] = toks

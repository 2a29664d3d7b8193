"""Speculative decoding in the runner: a proposer per request, fed every token the request gets;
per step, the drafts of the decode rows the scheduler gave a budget (how many: dynamic_k.py, or
the config's dynamic_k table); after the step, the accepted prefix of each row's drafts.

Verification (verify.py): every draft position is sampled by the ordinary sampler with the seed
of its position, so a row emits its accepted drafts plus one token, exactly the tokens plain
decoding would have drawn (greedy, seeded, penalties, logit_bias and grammar masks included).

Proposals need the previous step's token on the host: a step with drafts reads the previous
step's tokens before its forward (one host/device sync); the cost model decides whether that
pays. A request whose grammar (structured output) refuses a draft has its drafts cut there."""
from __future__ import annotations

import logging
import time

import torch

from services.common.spec_config import SpecConfig
from services.worker.metrics import (SPEC_ACCEPTED, SPEC_ACCEPTED_AT, SPEC_DRAFTED, SPEC_DRAFTED_AT,
                                     SPEC_FED_STEPS, SPEC_ROWS, SPEC_STEPS)
from services.worker.spec.dynamic_k import (MIN_GAIN, REVISIT_STEPS, AcceptanceTracker, StepCostModel, VerifyCostModel,
                                            choose_k, choose_uniform_k, expected_run)
from services.worker.spec.ngram import NgramProposer
from services.worker.spec.suffix import SuffixProposer
from services.worker.spec.suffix_cache import SuffixCache

log = logging.getLogger(__name__)

EXPLORE_ROWS = 8     # never-asked requests proposed for per step
MAX_BACKOFF = 64     # steps: the longest wait after syncs that drafted nothing
PERIOD_REVISIT = 256  # steps: a device-fed width's measured period is forgotten after this


def accepted_prefix(drafts: list[int], sampled: list[int]) -> int:
    """How many leading drafts equal the tokens sampled at their positions (sampled[j] is the
    token after draft j - 1; sampled has one more entry than drafts)."""
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return a


class SpecDecoder:
    def __init__(self, cfg: SpecConfig, model_name: str = "", draft=None, follower: bool = False) -> None:
        """`draft`: the loaded spec.draft_model.DraftModel, for method draft_model (only).
        `follower`: a tensor-parallel rank > 0, which verifies rank 0's drafts and proposes none
        (no proposers, no draft model: runner.tp_spec brings rank 0's choices)."""
        if not follower and (cfg.method == "draft_model") != (draft is not None):
            raise ValueError("speculative-config: method draft_model needs its loaded draft model (and only it)")
        self.cfg = cfg
        self.follower = follower
        self.draft = draft
        self.draft_cost: StepCostModel | None = None   # a draft decode step per batch (calibrate)
        # What a speculating step loses with its overlap: the host's time to build a step (the
        # runner measures it while steps overlap; 0 without overlap, where nothing is lost) ...
        self.plain_host_s = 0.0
        # ... or, once measured, what speculating steps of about this batch exposed: from the
        # previous step's tokens read to this one launched (resolving the previous step, the
        # proposals, a bigger build), per batch bucket (batch.bit_length()): (seconds, clock).
        self._spec_host: dict[int, tuple[float, int]] = {}
        # Device-fed steps (device_steps.py): the measured period from a step's submit to the next
        # one's, per (batch bucket, width) (1: no drafts): what the whole loop (scheduler included)
        # takes for such steps, which the GPU-only calibration does not see.
        self._period: dict[tuple[int, int], tuple[float, int]] = {}
        # Host speculating steps (drafts proposed on the host after a sync) keep their period at
        # width 0 of the same table, and here the tokens their rows accepted, per batch bucket
        # (an EWMA, clock): measured against plain steps' periods they say whether drafting has
        # paid at this batch, whatever the cost model expected (host_spec_pays).
        self._host_gain: dict[int, tuple[float, int]] = {}
        self.fed_declined_at = -1        # the clock of a step whose device-fed width choice was 1 (no drafts)
        self.host_probe_at = -(1 << 30)  # the clock of the last step chains left to the host path to measure it
        self._wasted = 0                 # syncs in a row whose proposals the cost model declined
        self._declined = False           # the last drafts() call declined proposals it had
        self._backoff_until = 0          # worth_trying says no before this step (acceptance.clock)
        self.cache = (SuffixCache(cfg.suffix_max_depth, cfg.suffix_cache_outputs)
                      if cfg.method == "suffix" else None)
        self.proposers: dict[str, object] = {}
        self.device = None        # spec.device_ngram.DeviceNgram: n-gram drafts on the device (runner.enable_spec)
        self.acceptance = AcceptanceTracker(prior=0.5)
        # Set by calibrate(); until then every proposal is verified.
        self.spec_cost: StepCostModel | VerifyCostModel | None = None
        self.plain_cost: StepCostModel | None = None
        labels = (model_name, cfg.method)
        self._drafted, self._accepted = SPEC_DRAFTED.labels(*labels), SPEC_ACCEPTED.labels(*labels)
        self._steps, self._rows = SPEC_STEPS.labels(*labels), SPEC_ROWS.labels(*labels)
        self._fed = SPEC_FED_STEPS.labels(*labels)
        self.fed_steps = 0               # device-fed steps (spec/device_steps.py)
        self._unflushed: list[tuple[int, int]] = []   # (drafted, accepted) per row observed (flush_metrics)
        self._drafted_at = [SPEC_DRAFTED_AT.labels(*labels, str(j + 1)) for j in range(cfg.num_speculative_tokens)]
        self._accepted_at = [SPEC_ACCEPTED_AT.labels(*labels, str(j + 1)) for j in range(cfg.num_speculative_tokens)]
        self.drafted = self.accepted = 0

    # ---- proposers ------------------------------------------------------------------------
    def start(self, request_id: str, token_ids: list[int], num_output_tokens: int) -> None:
        if self.follower:
            return
        if self.draft is not None:
            self.draft.start(request_id, token_ids)
        elif self.cfg.method == "ngram":
            self.proposers[request_id] = NgramProposer(self.cfg.prompt_lookup_min, self.cfg.prompt_lookup_max,
                                                       token_ids)
        else:
            p = SuffixProposer(self.cfg.suffix_max_depth, self.cfg.suffix_min_prob, self.cache,
                               token_ids[:len(token_ids) - num_output_tokens])
            p.extend(token_ids[len(token_ids) - num_output_tokens:])
            self.proposers[request_id] = p

    def extend(self, request_id: str, tokens: list[int]) -> None:
        if self.follower:
            return
        if self.draft is not None:
            self.draft.extend(request_id, tokens)
            return
        p = self.proposers.get(request_id)
        if p is not None:
            p.extend(tokens)

    def finish(self, request_id: str) -> None:
        if self.device is not None:
            self.device.release(request_id)
        if self.draft is not None:
            self.draft.finish(request_id)
        p = self.proposers.pop(request_id, None)
        if isinstance(p, SuffixProposer):
            p.finish()
        self.acceptance.forget(request_id)

    def reset(self, num_blocks: int, block_size: int) -> None:
        """A (re)connecting scheduler: every request is gone (the draft's pool follows the cache)."""
        for rid in list(self.proposers):
            self.finish(rid)
        if self.device is not None:
            self.device.clear()
        if self.draft is not None:
            self.draft.reset(num_blocks, block_size)

    # ---- per step ---------------------------------------------------------------------------
    def drafts(self, rows: list[tuple[str, int]], base_tokens: int, batch: int) -> dict[str, list[int]]:
        """rows: (request id, most drafts allowed) of the step's decode rows with a budget;
        base_tokens: the step's tokens without drafts; batch: its sequences -> drafts per row.
        A step that read the previous one's tokens (paid the sync), had proposals and still
        drafted nothing (the cost model declined them: worth_trying's estimate was wrong) makes
        the next syncs wait: 1, 2, 4 .. MAX_BACKOFF steps in a row of such steps. Steps where the
        proposers found nothing do not count: the hit rate already prices them."""
        self._declined = False
        out = self._drafts(rows, base_tokens, batch)
        if rows and self.cfg.fixed_k(batch) is None and (out or self._declined):
            self._wasted = 0 if out else self._wasted + 1
            if self._wasted:
                self._backoff_until = self.acceptance.clock + min(MAX_BACKOFF, 1 << (self._wasted - 1))
        return out

    def _drafts(self, rows: list[tuple[str, int]], base_tokens: int, batch: int) -> dict[str, list[int]]:
        if self.draft is not None:
            k = self._draft_k(rows, base_tokens, batch)
            self._declined = not k
            return self.draft.propose([(rid, min(room, k)) for rid, room in rows]) if k else {}
        # At most EXPLORE_ROWS never-asked rows a step: a wave of new requests (prior rates, hit
        # rate 1) does not make every step sync and propose for all of them before the acceptance
        # measured on the first ones has said whether drafting pays.
        unseen = 0
        asked = []
        for rid, room in rows:
            if room <= 0 or rid not in self.proposers:
                continue
            if not self.acceptance.seen(rid):
                unseen += 1
                if unseen > EXPLORE_ROWS:
                    continue
            asked.append((rid, room))
        proposals = {rid: self.proposers[rid].propose(room) for rid, room in asked}
        for rid, p in proposals.items():   # how often reading the previous step found something to draft
            self.acceptance.found(rid, bool(p))
        proposals = {rid: p for rid, p in proposals.items() if p}
        if not proposals:
            return {}
        fixed = self.cfg.fixed_k(batch)
        if fixed is not None:
            return {rid: p[:fixed] for rid, p in proposals.items() if fixed}
        if self.spec_cost is None:        # not calibrated: every proposal is verified
            return proposals
        ids = list(proposals)
        ks = choose_k(self.spec_cost, base_tokens, [(self.acceptance.rate(r), len(proposals[r])) for r in ids],
                      plain=self.plain_cost, sync_s=self.sync_s(batch), rows=batch)
        self._declined = not any(ks)
        return {rid: proposals[rid][:k] for rid, k in zip(ids, ks) if k}

    def worth_trying(self, rows: list[tuple[str, int]], base_tokens: int, batch: int) -> bool:
        """Before the previous step's tokens are read (a sync) to propose from them: would any
        draft pay if every row had a full proposal? False keeps the step's overlap."""
        fixed = self.cfg.fixed_k(batch)
        if fixed is not None:
            return fixed > 0
        if self.spec_cost is None:
            return True
        if self.acceptance.clock < self._backoff_until:   # the last syncs' proposals were declined
            return False
        if self.fed_declined_at == self.acceptance.clock:   # this step's device-fed choice: no drafts
            return False
        if self.host_spec_pays(batch) is False:
            return False
        if self.draft is not None:
            return self._draft_k(rows, base_tokens, batch) > 0
        # Cheap enough for every step at any batch (no allocation search): the m rows most likely
        # to pay (rate x how often they have a draft), each drafting k, for a few m and k. The
        # sync is paid whether or not the proposers then find anything, hence the hit weights.
        acc = self.acceptance
        vals = []
        for r, room in rows:
            a, h = acc.rate(r), acc.hit(r)
            vals.append((a * h, a, h, room))
        vals.sort(reverse=True)
        plain = batch / (self.plain_cost or self.spec_cost).cost(base_tokens)
        sync_s = self.sync_s(batch)
        k_max = max(room for _, room in rows)
        for k in sorted({1, 2, k_max}):
            gain, tokens = 0.0, 0
            sizes = {1, 8, 32, len(vals)}
            for m, (_, a, h, room) in enumerate(vals, 1):
                kk = min(k, room)
                gain += h * expected_run(a, kk)
                tokens += kk
                if m in sizes and (batch + gain) / (self.spec_cost.cost(base_tokens + tokens, batch) + sync_s) \
                        > MIN_GAIN * plain:
                    return True
        return False

    def _draft_k(self, rows: list[tuple[str, int]], base_tokens: int, batch: int) -> int:
        """The draft model's K for this step (one for every row: it drafts in lock-step)."""
        k_max = max((room for _, room in rows), default=0)
        fixed = self.cfg.fixed_k(batch)
        if fixed is not None:
            return min(fixed, k_max)
        if self.spec_cost is None or self.draft_cost is None:   # not calibrated: draft fully
            return k_max
        # The draft catches up first on every token since each row's last draft: after a stretch
        # without drafts a forward of that backlog (as large as the target's prefill of it when
        # the model drafts for itself). Priced beyond the one token a row a step of drafting has.
        backlog = self.draft.backlog(r for r, _ in rows)
        catch_up = max(0.0, self.draft_cost.cost(backlog) - self.draft_cost.cost(len(rows))) if backlog else 0.0
        return choose_uniform_k(self.spec_cost, base_tokens, [(self.acceptance.rate(r), room) for r, room in rows],
                                self.draft_cost, plain=self.plain_cost, sync_s=self.sync_s(batch) + catch_up,
                                rows=batch)

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """One row's verified run; the metrics take it at the next flush_metrics (once a step:
        a counter's inc takes a lock, and a step of 32 rows had ~600 of them)."""
        self.acceptance.update(request_id, drafted, accepted)
        self.drafted += drafted
        self.accepted += accepted
        self._unflushed.append((drafted, accepted))

    def flush_metrics(self) -> None:
        """Counters for the rows observed since the last flush (the runner calls it when a step is read)."""
        rows = self._unflushed
        if not rows:
            return
        self._unflushed = []
        self._drafted.inc(sum(d for d, _ in rows))
        self._accepted.inc(sum(a for _, a in rows))
        self._rows.inc(len(rows))
        k = len(self._drafted_at)
        drafted_at, accepted_at = [0] * k, [0] * k
        for d, a in rows:
            for j in range(min(d, k)):
                drafted_at[j] += 1
                accepted_at[j] += j < a
        for j in range(k):
            if drafted_at[j]:
                self._drafted_at[j].inc(drafted_at[j])
            if accepted_at[j]:
                self._accepted_at[j].inc(accepted_at[j])

    def stepped(self) -> None:
        self._steps.inc()

    def fed(self) -> None:
        self.fed_steps += 1
        self._fed.inc()

    def host_time(self, seconds: float) -> None:
        """The host's time to build and launch an overlapped step (an EWMA)."""
        self.plain_host_s = seconds if not self.plain_host_s else 0.9 * self.plain_host_s + 0.1 * seconds

    def spec_host_time(self, batch: int, seconds: float) -> None:
        """What a speculating step of `batch` sequences exposed: from the previous step's tokens
        read to its own launch (an EWMA per batch bucket). One sample moves it at most 4x: a
        slow step (a collection pause, a first shape) is not the rule."""
        b = batch.bit_length()
        old = self.sync_s(batch) if b in self._spec_host else None
        floor = max(old or 0.0, self.plain_host_s)
        if floor > 0:
            seconds = min(seconds, 4 * floor)
        self._spec_host[b] = (seconds if old is None else 0.8 * old + 0.2 * seconds, self.acceptance.clock)

    def sync_s(self, batch: int) -> float:
        """The host time a speculating step of `batch` sequences is expected to expose: measured
        on speculating steps of about that batch, else the plain steps' build time (a floor:
        without drafts there is less to build). A measure not renewed drifts back to the floor
        over REVISIT_STEPS, as acceptance rates do: a size where speculating stopped is tried again."""
        entry = self._spec_host.get(batch.bit_length())
        if entry is None:
            return self.plain_host_s
        s, at = entry
        age = self.acceptance.clock - at
        if age >= REVISIT_STEPS:
            return self.plain_host_s
        if age > 0:
            s += (self.plain_host_s - s) * age / REVISIT_STEPS
        return max(self.plain_host_s, s)

    def step_period(self, batch: int, width: int, seconds: float) -> None:
        """The time from a step's submit to the next one's (an EWMA per batch bucket and width;
        one sample moves it at most 4x)."""
        key = (batch.bit_length(), width)
        old = self._period.get(key)
        if old is None or self.acceptance.clock - old[1] >= PERIOD_REVISIT:   # none, or forgotten: start anew
            self._period[key] = (seconds, self.acceptance.clock)
            return
        seconds = min(seconds, 4 * old[0])
        self._period[key] = (0.8 * old[0] + 0.2 * seconds, self.acceptance.clock)

    def host_spec_step(self, batch: int, accepted: int) -> None:
        """A host speculating step of `batch` sequences was read: its rows accepted `accepted` drafts."""
        b = batch.bit_length()
        old = self._host_gain.get(b)
        fresh = old is None or self.acceptance.clock - old[1] >= PERIOD_REVISIT
        g = accepted if fresh else 0.8 * old[0] + 0.2 * accepted
        self._host_gain[b] = (g, self.acceptance.clock)

    def host_spec_pays(self, batch: int) -> bool | None:
        """Have host speculating steps of about this batch emitted tokens faster than plain steps,
        both measured (periods from submit to submit, the whole loop included) within
        PERIOD_REVISIT steps? None when either is not measured: the cost model decides, so a batch
        where speculating stopped paying is tried again once its measure is forgotten."""
        spec_t, plain_t = self.period(batch, 0), self.period(batch, 1)
        gain = self._host_gain.get(batch.bit_length())
        if spec_t is None or plain_t is None or gain is None or self.acceptance.clock - gain[1] >= PERIOD_REVISIT:
            return None
        return (batch + gain[0]) / spec_t >= batch / plain_t

    def host_spec_rate(self, batch: int) -> float | None:
        """Tokens per second of host speculating steps of about this batch (their rows plus the
        drafts they accepted, over their measured period), or None when not measured within
        PERIOD_REVISIT steps (device_steps.host_path_pays)."""
        spec_t = self.period(batch, 0)
        gain = self._host_gain.get(batch.bit_length())
        if spec_t is None or gain is None or self.acceptance.clock - gain[1] >= PERIOD_REVISIT:
            return None
        return (batch + gain[0]) / spec_t

    def period(self, batch: int, width: int) -> float | None:
        """The measured period of such steps, or None when not measured in PERIOD_REVISIT steps
        (the cost model's estimate stands in, so a width that stopped paying is tried again)."""
        entry = self._period.get((batch.bit_length(), width))
        if entry is None or self.acceptance.clock - entry[1] >= PERIOD_REVISIT:
            return None
        return entry[0]

    # ---- cost model -------------------------------------------------------------------------
    def calibrate(self, runner, max_tokens: int = 512) -> None:
        """Time the runner's forward at start-up (no request is running: the KV cache is free):
        plain decode steps of B one-token sequences (CUDA graphs on a GPU) and verify-shaped
        steps of B sequences x 2 and x (K + 1) tokens, as far as max_tokens allows (B x 2 alone
        past that), for the cost models: plain steps by tokens, verify steps by tokens and rows
        (VerifyCostModel). On the CPU both kinds run the same forward: the plain points are
        verify points too."""
        t0 = time.perf_counter()
        plain, spec = [], []
        q = self.cfg.num_speculative_tokens + 1
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b * 2 <= max_tokens]
        for b in sizes:
            plain.append((b, _time_step(runner, b, 1)))
            spec.append((b, b * 2, _time_step(runner, b, 2)))
            if b * q <= max_tokens:
                spec.append((b, b * q, _time_step(runner, b, q)))
        if runner.gpu is None:
            spec += [(b, b, sec) for b, sec in plain]
        self.plain_cost = StepCostModel(_monotone(plain))
        self.spec_cost = VerifyCostModel(spec, plain=self.plain_cost)
        if self.draft is not None:
            self.draft_cost = StepCostModel(_monotone([(b, self.draft.time_step(b)) for b in sizes]))
        log.info("speculative decoding (%s, up to %d drafts): step cost calibrated in %.2fs: plain %s, "
                 "verify (rows, tokens, ms) %s", self.cfg.method, self.cfg.num_speculative_tokens,
                 time.perf_counter() - t0, [(t, round(s * 1e3, 2)) for t, s in plain],
                 [(b, t, round(s * 1e3, 2)) for b, t, s in spec])


def _monotone(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """One point per token count (the fastest), never cheaper with more tokens (timing noise)."""
    best: dict[int, float] = {}
    for t, s in points:
        best[t] = min(s, best.get(t, s))
    out, floor = [], 0.0
    for t in sorted(best):
        floor = max(floor, best[t])
        out.append((t, floor))
    return out


@torch.inference_mode()
def _time_step(runner, num_seqs: int, tokens_each: int, reps: int = 2) -> float:
    """Median seconds of one forward + logits of `num_seqs` sequences of `tokens_each` tokens at
    positions 0.. (the first blocks for all: garbage KV there is overwritten before any request
    reads it)."""
    from services.worker.attention import SeqSchedule
    ids = [0] * (num_seqs * tokens_each)
    positions = list(range(tokens_each)) * num_seqs
    table = list(range(-(-tokens_each // runner.block_size)))
    seqs = [SeqSchedule(table, 0, tokens_each) for _ in range(num_seqs)]
    rows = list(range(tokens_each - 1, len(ids), tokens_each)) if tokens_each == 1 else list(range(len(ids)))
    times = []
    for _ in range(reps + 1):
        if runner.gpu is not None:
            torch.cuda.synchronize()
        t = time.perf_counter()
        if runner.gpu is not None:
            runner.gpu.run(ids, positions, seqs, rows, None)
            torch.cuda.synchronize()
        else:
            runner._forward_reference(ids, positions, seqs, rows, None)
        times.append(time.perf_counter() - t)
    times = sorted(times[1:])
    return times[len(times) // 2]

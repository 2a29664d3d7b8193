"""How many draft tokens to verify, per request and per step, from the step cost measured at
start-up and the acceptance measured so far.

With acceptance rate a (the chance that a draft token is accepted given the ones before it were),
k drafts emit on average 1 + a + ... + a^k tokens, so the j-th draft token is worth a^j extra
tokens. A step of T tokens costs t(T) (interpolated from the measured points); verifying drafts
adds their tokens to T. Drafts are handed out greedily, always to the request whose next draft
token is worth the most, while the batch's emitted tokens per second still grows; the gains a^j
fall with j, so the greedy choice is the best one. When nothing is worth its cost (a large batch,
a low acceptance) every request gets k = 0 and the step is the plain decode step: at high
concurrency with nothing accepted, speculation costs nearly nothing.

AcceptanceTracker keeps each request's rate (an EWMA of accepted / proposed per step), starting
from the method's running rate over recent requests."""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field

MIN_GAIN = 1.02        # a step must emit at least 2% more tokens per second to speculate at all


@dataclass
class StepCostModel:
    """Measured (tokens in the step, seconds) points; linear between them, and beyond the last."""
    points: list[tuple[int, float]]

    def __post_init__(self) -> None:
        self.points = sorted(self.points)
        if not self.points or any(t <= 0 or s <= 0 for t, s in self.points):
            raise ValueError("the step cost model needs points with tokens > 0 and seconds > 0")
        self._xs = [t for t, _ in self.points]     # cost() runs many times per step

    def cost(self, tokens: int, rows: int | None = None) -> float:
        """Seconds of a step of `tokens` tokens (`rows`: ignored, a curve of tokens alone)."""
        pts = self.points
        if len(pts) == 1:
            return pts[0][1] * max(tokens, 1) / pts[0][0] if tokens > pts[0][0] else pts[0][1]
        i = bisect.bisect_left(self._xs, tokens)
        if i == 0:
            return pts[0][1]
        (t0, s0), (t1, s1) = pts[min(i, len(pts) - 1) - 1], pts[min(i, len(pts) - 1)]
        return s0 + (s1 - s0) * (tokens - t0) / (t1 - t0)


@dataclass
class VerifyCostModel:
    """Seconds of a step that verifies drafts, from its tokens and its sequences (rows). A curve
    of tokens alone mixes row counts: 256 decode rows with 11 drafts would be priced like 64 rows
    of 4 tokens, far below the plain step of 256 rows, when the verify step pays every row's
    attention (and, above the verify graphs' 32 rows, runs eagerly). Per calibrated row count b:
    the cost of one token a row, c(b), and a cost per extra token, fitted through its points
    (b x 2 and b x (K + 1) tokens; b x 1 too on the CPU); linear in rows between row counts;
    past the largest, c grows as the plain step does."""
    points: list[tuple[int, int, float]]        # (rows, tokens, seconds)
    plain: StepCostModel | None = None

    def __post_init__(self) -> None:
        by_rows: dict[int, list[tuple[int, float]]] = {}
        for b, t, sec in self.points:
            if b <= 0 or t < b or sec <= 0:
                raise ValueError("the verify cost model needs points with rows > 0, tokens >= rows, seconds > 0")
            by_rows.setdefault(b, []).append((t, sec))
        if not by_rows:
            raise ValueError("the verify cost model needs points")
        fits: dict[int, tuple[float, float, float] | None] = {}   # rows -> (mean tokens, mean seconds, slope)
        for b, pts in by_rows.items():
            mt = sum(t for t, _ in pts) / len(pts)
            ms = sum(x for _, x in pts) / len(pts)
            var = sum((t - mt) ** 2 for t, _ in pts)
            slope = max(0.0, sum((t - mt) * (x - ms) for t, x in pts) / var) if var else None
            fits[b] = (mt, ms, slope)
        sloped = [b for b, f in fits.items() if f[2] is not None]
        self._lines: list[tuple[int, float, float]] = []     # (rows, seconds at one token a row, per extra token)
        for b in sorted(fits):
            mt, ms, slope = fits[b]
            if slope is None:   # one token count measured at this row count: the nearest row count's slope
                near = min(sloped, key=lambda r: (abs(r - b), -r)) if sloped else None
                slope = fits[near][2] if near is not None else 0.0
            self._lines.append((b, max(ms + slope * (b - mt), 1e-6), slope))

    def cost(self, tokens: int, rows: int | None = None) -> float:
        lines = self._lines
        rows = max(1, rows if rows is not None else lines[0][0])
        if rows <= lines[0][0]:
            _, one, slope = lines[0]
        elif rows >= lines[-1][0]:
            b, one, slope = lines[-1]
            if rows > b:
                one *= self.plain.cost(rows) / self.plain.cost(b) if self.plain is not None else rows / b
        else:
            k = next(i for i, line in enumerate(lines) if line[0] >= rows)
            (b0, c0, s0), (b1, c1, s1) = lines[k - 1], lines[k]
            w = (rows - b0) / (b1 - b0)
            one, slope = c0 + (c1 - c0) * w, s0 + (s1 - s0) * w
        return one + slope * max(0, tokens - rows)


def expected_run(a: float, k: int) -> float:
    """Tokens a run of k drafts is expected to add at per-token acceptance a: a + a^2 + .. + a^k."""
    if k <= 0:
        return 0.0
    if a >= 1.0:
        return float(k)
    return a * (1.0 - a ** k) / (1.0 - a)


def choose_k(cost: StepCostModel | VerifyCostModel, base_tokens: int, requests: list[tuple[float, int]],
             plain: StepCostModel | None = None, sync_s: float = 0.0, rows: int | None = None) -> list[int]:
    """requests: (acceptance rate, drafts available) per decoding request; base_tokens: the step's
    tokens without drafts; `cost`: the time of a step that verifies drafts, `plain` (default:
    the same) of one that does not (on a GPU a plain decode step replays a CUDA graph); sync_s:
    what a speculating step adds for giving up its overlap with the host (the host's time to
    build a step, which a plain step hides behind the one before); rows: the step's sequences
    (default: the requests).
    -> K per request (0: no speculation for it this step)."""
    rows = rows if rows is not None else len(requests)
    ks = [0] * len(requests)
    # Every sequence of the step emits its token whether or not it drafts: the rows without a
    # proposal count too (counting only the proposing ones overstated what drafting a few of 32
    # rows gains against the step it slows down).
    emitted = float(max(rows, len(requests)))
    tokens = base_tokens
    best, best_ks = emitted / (cost.cost(tokens, rows) + sync_s), list(ks)
    heap = [(-a, i) for i, (a, avail) in enumerate(requests) if avail > 0 and a > 0]
    heapq.heapify(heap)
    since_best = 0
    # Hand out drafts by value; keep the allocation with the best rate seen (the cost curve may
    # have steps, so a few more drafts can pay where one does not: look up to 16 ahead).
    while heap and since_best < 16:
        neg_gain, i = heapq.heappop(heap)
        ks[i] += 1
        emitted -= neg_gain
        tokens += 1
        a, avail = requests[i]
        if ks[i] < avail:
            heapq.heappush(heap, (-(a ** (ks[i] + 1)), i))
        rate = emitted / (cost.cost(tokens, rows) + sync_s)
        if rate > best:
            best, best_ks, since_best = rate, list(ks), 0
        else:
            since_best += 1
    ks = best_ks
    plain_rate = max(rows, len(requests)) / (plain or cost).cost(base_tokens)
    if best < MIN_GAIN * plain_rate:
        return [0] * len(requests)
    return ks


def choose_uniform_k(cost: StepCostModel | VerifyCostModel, base_tokens: int, requests: list[tuple[float, int]],
                     draft_cost: StepCostModel, plain: StepCostModel | None = None, sync_s: float = 0.0,
                     rows: int | None = None) -> int:
    """A draft model drafts every row in lock-step (K decode steps of the draft for the batch),
    so its K is one number for the step: the K that maximises emitted tokens per second, where
    a step costs the target's verify of base + drafts tokens plus K draft steps of the batch;
    0 unless it beats the plain step by MIN_GAIN. requests: (acceptance rate, drafts available)."""
    n = len(requests)
    if not n:
        return 0
    plain_rate = n / (plain or cost).cost(base_tokens)
    best_k, best = 0, MIN_GAIN * plain_rate
    step = draft_cost.cost(n)
    for k in range(1, max(avail for _, avail in requests) + 1):
        ks = [min(k, avail) for _, avail in requests]
        emitted = n + sum(expected_run(a, kk) for (a, _), kk in zip(requests, ks))
        rate = emitted / (cost.cost(base_tokens + sum(ks), rows if rows is not None else n) + k * step + sync_s)
        if rate > best:
            best_k, best = k, rate
    return best_k


REVISIT_STEPS = 32      # a rate not updated for this many steps is back at the prior
HIT_PRIOR_REVISIT = 256 # the method's hit rate not updated for this many steps is back at 1


@dataclass
class AcceptanceTracker:
    """Per-request acceptance rates, and the method's over recent requests (their prior). A rate
    drifts back to the prior while it is not updated (REVISIT_STEPS), so a request whose drafts
    stopped paying is tried again later: a low rate is never final."""
    prior: float = 0.5
    weight: float = 0.3          # EWMA weight of the newest step
    rates: dict[str, float] = field(default_factory=dict)
    updated: dict[str, int] = field(default_factory=dict)
    hits: dict[str, float] = field(default_factory=dict)   # EWMA: the proposer had a draft when asked
    found_at: dict[str, int] = field(default_factory=dict)
    # The method's hit rate over recent asks: what a request not asked yet is expected to have
    # (random text gives n-gram and suffix proposers nothing: after a few empty asks an unseen
    # request no longer looks like one sure to draft). Drifts back to 1 over HIT_PRIOR_REVISIT.
    _hit_prior: float = 1.0
    _hit_prior_at: int = 0
    clock: int = 0               # steps (tick)

    def tick(self) -> None:
        self.clock += 1

    def rate(self, request_id: str) -> float:
        r = self.rates.get(request_id)
        if r is None:
            return self.prior
        age = self.clock - self.updated.get(request_id, self.clock)
        return r + (self.prior - r) * min(1.0, age / REVISIT_STEPS) if age > 0 else r

    def seen(self, request_id: str) -> bool:
        """Was its proposer ever asked?"""
        return request_id in self.hits or request_id in self.rates

    def hit_prior(self) -> float:
        age = self.clock - self._hit_prior_at
        return self._hit_prior + (1.0 - self._hit_prior) * min(1.0, age / HIT_PRIOR_REVISIT)

    def hit(self, request_id: str) -> float:
        """How often its proposer had a draft when asked (the method's hit rate until it was
        asked; drifts back to that while not asked, like the rate to the prior)."""
        prior = self.hit_prior()
        h = self.hits.get(request_id)
        if h is None:
            return prior
        age = self.clock - self.found_at.get(request_id, self.clock)
        return h + (prior - h) * min(1.0, age / REVISIT_STEPS) if age > 0 else h

    def found(self, request_id: str, had_draft: bool) -> None:
        old = self.hit(request_id)
        self.hits[request_id] = (1 - self.weight) * old + self.weight * float(had_draft)
        self.found_at[request_id] = self.clock
        self._hit_prior = 0.9 * self.hit_prior() + 0.1 * float(had_draft)
        self._hit_prior_at = self.clock

    def update(self, request_id: str, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        # The per-token rate a, not the share of drafts accepted (k drafts accept a + ... + a^k
        # on average, so the share underestimates a: 0.51 for a = 0.72 at k = 4). A run is a
        # geometric trial censored at k: `accepted` successes, then one failure unless all were
        # accepted; successes / trials is the maximum-likelihood a.
        share = accepted / (accepted + (1 if accepted < proposed else 0))
        old = self.rate(request_id)
        self.rates[request_id] = (1 - self.weight) * old + self.weight * share
        self.updated[request_id] = self.clock
        self.prior = 0.9 * self.prior + 0.1 * share

    def forget(self, request_id: str) -> None:
        self.rates.pop(request_id, None)
        self.updated.pop(request_id, None)
        self.hits.pop(request_id, None)
        self.found_at.pop(request_id, None)

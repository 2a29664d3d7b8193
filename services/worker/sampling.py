"""Token sampling over a batch of logits rows, one row per request that samples this step.

Order of operations (per row): logit_bias -> min_tokens (mask stop ids) -> repetition /
presence / frequency penalties -> the structured-output bitmask (structured.py; where it allows
only stop tokens, min_tokens yields to it: the grammar is complete) -> greedy argmax, or temperature -> top-k -> top-p -> min-p ->
draw. Returned logprobs are those of the model's raw distribution (log_softmax of the
unprocessed logits), like vLLM's default `raw_logprobs`.

Randomness: each draw uses a generator seeded from (request seed, position of the token
being sampled), so a seeded request gives the same tokens alone or in any batch, and even
after a preemption. Unseeded requests get a random base seed when they are created.

On a GPU nothing here waits for the device: small per-step tensors go up through pinned
memory, and `sample_async` only enqueues the copies of its results to pinned host memory plus
an event, so the runner can launch the next step before reading this one's tokens
(`SampleHandle.result()` waits for that event alone, not for work queued after it).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from services.worker.plan import SamplingConfig

_MASK64 = (1 << 64) - 1


def new_base_seed(cfg: SamplingConfig, rng: random.Random | None = None) -> int:
    """The request's base seed: its own, or a random one drawn once at creation from `rng`
    (tensor-parallel ranks share one seeded rng, so they draw the same noise)."""
    return cfg.seed if cfg.seed is not None else (rng or random).getrandbits(63)


def step_seed(base_seed: int, position: int) -> int:
    """Seed of the draw for the token at `position` (splitmix64 of base and position)."""
    z = (base_seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class SampleRow:
    """What the sampler needs to know about one request for one step."""

    cfg: SamplingConfig
    token_ids: list[int]       # every known token (prompt + outputs) before this draw
    num_output_tokens: int     # outputs before this draw (token_ids may lack in-flight ones)
    base_seed: int
    position: int | None = None  # index of the token being drawn (None: len(token_ids))
    mask_row: int = -1           # its row of the step's structured-output bitmask; -1: unconstrained
    grammar_stops: bool = False  # that mask allows only stop tokens: min_tokens does not mask them
    draft_prefix: list[int] | tuple = ()   # speculative decoding: drafts drawn before this row's token
    # A device-fed step (spec/device_steps.py): the draw's position is `position` + shift, where the
    # shift [1] long is on the device, in [0, window]: the noise of every candidate position is
    # made and the shift picks one, with no host sync.
    window: int = 0
    shift: torch.Tensor | None = None

    @property
    def draw_position(self) -> int:
        return len(self.token_ids) if self.position is None else self.position


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # [(token_id, logprob)] best first


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor without a host/device sync: through pinned memory
    with an asynchronous copy on CUDA (a plain `torch.tensor(..., device=cuda)` waits for every
    kernel queued before it)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def apply_logits_processors(logits: torch.Tensor, rows: list[SampleRow],
                            eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """In place on `logits` [N, V] float32: logit_bias, min_tokens, penalties."""
    v = logits.shape[1]
    for i, row in enumerate(rows):
        cfg = row.cfg
        if cfg.logit_bias:
            ids = to_device([t for t, _ in cfg.logit_bias], torch.long, logits.device)
            logits[i, ids] += to_device([b for _, b in cfg.logit_bias], logits.dtype, logits.device)
        if row.num_output_tokens < cfg.min_tokens and not row.grammar_stops:
            stop = set(cfg.stop_token_ids) | (set() if cfg.ignore_eos else set(eos_token_ids))
            stop = [t for t in stop if 0 <= t < v]
            if stop:
                logits[i, to_device(stop, torch.long, logits.device)] = float("-inf")
        if not cfg.has_penalties:
            continue
        if cfg.repetition_penalty != 1.0 and row.token_ids:
            seen = to_device(sorted(set(row.token_ids)), torch.long, logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / cfg.repetition_penalty,
                                          vals * cfg.repetition_penalty)
        if (cfg.presence_penalty or cfg.frequency_penalty) and row.num_output_tokens:
            out = to_device(row.token_ids[len(row.token_ids) - row.num_output_tokens:], torch.long,
                            logits.device)
            counts = torch.bincount(out, minlength=v)[:v].to(logits.dtype)
            logits[i] -= cfg.frequency_penalty * counts + cfg.presence_penalty * (counts > 0)
    return logits


def apply_bitmask(logits: torch.Tensor, rows: list[SampleRow], bitmask: torch.Tensor) -> None:
    """In place on `logits` [N, V]: tokens the grammar refuses -> -inf in the constrained rows.
    `bitmask` int32 [k, W] on the host, row j for the j-th constrained row (structured.py). Our
    own unpacking rather than llguidance.torch's apply, which goes through torch.compile (a compile
    at first use, and again per new shape)."""
    idx = [i for i, r in enumerate(rows) if r.mask_row >= 0]
    if not idx:
        return
    dev = logits.device
    v, (k, w) = logits.shape[1], bitmask.shape
    bm = bitmask.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else bitmask
    shifts = torch.arange(32, dtype=torch.int32, device=dev)
    refused = ((bm[:, :, None] >> shifts) & 1).reshape(k, 32 * w) == 0          # [k, 32W]
    i_idx = to_device(idx, torch.long, dev)
    sub = logits.index_select(0, i_idx)                                         # [k, V]
    n = min(v, 32 * w)
    sub[:, :n].masked_fill_(refused[:, :n], float("-inf"))
    if v > n:   # a padded embedding: ids the tokenizer does not have are never allowed
        sub[:, n:] = float("-inf")
    logits.index_copy_(0, i_idx, sub)


def _restrict(x: torch.Tensor, cfgs: list[SamplingConfig]) -> torch.Tensor:
    """top-k, then top-p, then min-p over temperature-scaled logits x [n, V]."""
    n, v = x.shape
    need_sort = any(c.top_k or c.top_p < 1.0 for c in cfgs)
    if need_sort:
        s, idx = x.sort(dim=-1, descending=True)
        ks = to_device([c.top_k if c.top_k else v for c in cfgs], torch.long, x.device)
        s = s.masked_fill(torch.arange(v, device=x.device)[None, :] >= ks[:, None], float("-inf"))
        ps = to_device([c.top_p for c in cfgs], x.dtype, x.device)
        if any(c.top_p < 1.0 for c in cfgs):  # decided on the host: no device sync
            p = s.softmax(dim=-1)
            # Drop a token once the mass strictly before it already reaches top_p; keeps >= 1.
            s = s.masked_fill(p.cumsum(dim=-1) - p > ps[:, None], float("-inf"))
        x = torch.empty_like(x).scatter_(1, idx, s)
    if any(c.min_p > 0 for c in cfgs):
        min_ps = to_device([c.min_p for c in cfgs], x.dtype, x.device)
        p = x.softmax(dim=-1)
        x = x.masked_fill(p < min_ps[:, None] * p.max(dim=-1, keepdim=True).values, float("-inf"))
    return x


class SampleHandle:
    """The tokens (and logprobs) of one sampling call, copied to host memory asynchronously."""

    def __init__(self, rows: list[SampleRow], tokens: torch.Tensor, lp_rows: list[int],
                 sampled_lp: torch.Tensor | None, top: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.rows, self.lp_rows = rows, lp_rows
        self.device_tokens = tokens     # the sampled ids where they were drawn (device-fed steps read them)
        cuda = tokens.device.type == "cuda"
        # On CUDA `.to("cpu", non_blocking=True)` lands in pinned memory; the event marks the end
        # of these copies, so result() never waits for kernels launched after this call.
        # A CPU tensor would come back as itself: `tokens` may be the runner's prev-token buffer,
        # which the next step overwrites before this one is collected, so snapshot it.
        self._tokens = tokens.to("cpu", non_blocking=True) if cuda else tokens.clone()
        self._lp = sampled_lp.to("cpu", non_blocking=cuda) if sampled_lp is not None else None
        self._top = tuple(t.to("cpu", non_blocking=cuda) for t in top) if top is not None else None
        self._event = None
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        self._out: list[SampledToken] | None = None

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def result(self) -> list[SampledToken]:
        if self._out is None:
            if self._event is not None:
                self._event.synchronize()
            out = [SampledToken(t) for t in self._tokens.tolist()]
            if self.lp_rows:
                lps = self._lp.tolist()
                top_i, top_v = (self._top[1].tolist(), self._top[0].tolist()) if self._top else (None, None)
                for j, i in enumerate(self.lp_rows):
                    k = self.rows[i].cfg.logprobs
                    out[i].logprob = lps[j]
                    out[i].top = list(zip(top_i[j][:k], top_v[j][:k])) if k else []
            self._out = out
        return self._out


def sample(logits: torch.Tensor, rows: list[SampleRow],
           eos_token_ids: tuple[int, ...] = ()) -> list[SampledToken]:
    """logits: [N, V] float32 (modified in place) -> one SampledToken per row."""
    return sample_async(logits, rows, eos_token_ids).result()


def _argmax_only(row: SampleRow) -> bool:
    """The row's token is the argmax of the raw logits: argmax is the same over bf16 logits as over
    their (exact) float32 widening, so such rows need no widening."""
    cfg = row.cfg
    return (cfg.greedy and cfg.logprobs is None and not cfg.logit_bias and not cfg.has_penalties
            and (row.num_output_tokens >= cfg.min_tokens or row.grammar_stops))


def sample_async(logits: torch.Tensor, rows: list[SampleRow], eos_token_ids: tuple[int, ...] = (),
                 out: torch.Tensor | None = None, bitmask: torch.Tensor | None = None) -> SampleHandle:
    """Enqueue sampling of logits [N, V] (float32, modified in place; another dtype, a decode
    graph's, is widened first unless every row takes the plain argmax). `out` ([N] long on the
    logits' device) also receives the sampled ids there, for the next step's inputs. `bitmask`:
    the structured-output masks of the rows with a mask_row (apply_bitmask)."""
    if logits.dtype != torch.float32 and (bitmask is not None or not all(map(_argmax_only, rows))):
        logits = logits.float()    # a decode graph's bf16 logits: exact, processors run in float32
    n = logits.shape[0]
    dev = logits.device
    # index_select / index_copy_ with index tensors: list indexing is slow on CPU.
    want_lp = [i for i, r in enumerate(rows) if r.cfg.logprobs is not None]
    lp_idx = to_device(want_lp, torch.long, dev) if want_lp else None
    raw_lp = torch.log_softmax(logits.index_select(0, lp_idx), dim=-1) if want_lp else None
    logits = apply_logits_processors(logits, rows, eos_token_ids)
    if bitmask is not None:
        apply_bitmask(logits, rows, bitmask)
    greedy = [i for i, r in enumerate(rows) if r.cfg.greedy]
    if len(greedy) == n:
        # Straight into `out` when given: one kernel less in the common decode step.
        tokens = torch.argmax(logits, dim=-1, out=out) if out is not None else logits.argmax(dim=-1)
    else:
        tokens = torch.empty(n, dtype=torch.long, device=dev)
        if greedy:
            g_idx = to_device(greedy, torch.long, dev)
            tokens.index_copy_(0, g_idx, logits.index_select(0, g_idx).argmax(dim=-1))
        rand = [i for i, r in enumerate(rows) if not r.cfg.greedy]
        r_idx = to_device(rand, torch.long, dev)
        cfgs = [rows[i].cfg for i in rand]
        temps = to_device([c.temperature for c in cfgs], logits.dtype, dev)
        probs = _restrict(logits.index_select(0, r_idx) / temps[:, None], cfgs).softmax(dim=-1)
        # Exponential race (argmax p/q, q ~ Exp(1)) == multinomial, without a device sync,
        # and each row's noise comes from its own generator only.
        noise = torch.empty_like(probs)
        made: dict[tuple[int, int], torch.Tensor] = {}

        def draw(seed: int, pos: int) -> torch.Tensor:
            row = made.get((seed, pos))
            if row is None:
                gen = torch.Generator(device=dev)
                gen.manual_seed(step_seed(seed, pos))
                row = made[(seed, pos)] = torch.empty(probs.shape[1], dtype=probs.dtype, device=dev).exponential_(
                    generator=gen)
            return row

        for j, i in enumerate(rand):
            r = rows[i]
            if r.window:
                cand = torch.stack([draw(r.base_seed, r.draw_position + m) for m in range(r.window + 1)])
                noise[j] = cand.index_select(0, r.shift.clamp(0, r.window))[0]
            else:
                gen = torch.Generator(device=dev)
                gen.manual_seed(step_seed(r.base_seed, r.draw_position))
                noise[j].exponential_(generator=gen)
        noise.clamp_(min=1e-30)  # an exact 0 draw would make 0/0 for masked tokens
        tokens.index_copy_(0, r_idx, (probs / noise).argmax(dim=-1))
    if out is not None and tokens is not out:
        out.copy_(tokens)
    sampled_lp = top = None
    if want_lp:
        sampled_lp = raw_lp.gather(1, tokens.index_select(0, lp_idx)[:, None])[:, 0]
        max_top = max(rows[i].cfg.logprobs for i in want_lp)
        top = raw_lp.topk(max_top, dim=-1) if max_top else None
    return SampleHandle(rows, tokens, want_lp, sampled_lp, top)

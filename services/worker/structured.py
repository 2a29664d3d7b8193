"""Structured outputs on the worker: one llguidance matcher per constrained request, fed every
token the request samples, and per step the token bitmasks of the constrained sampling rows.

The gateway validated each constraint (services/common/structured.check) and the wire turned it
into grammar text (SamplingConfig.structured); here it becomes a matcher over the model's
tokenizer. Costs measured on the CPU with SmolLM2's tokenizer (49152 tokens): the LLTokenizer
0.2 s (built at start-up by `warm`), a matcher 0.4-0.8 ms for a small JSON schema, a deep copy of
a built one 0.5 us (hence the LRU of templates), a mask 0.01-0.1 ms per row once warm (1.3 ms for
the first mask of a matcher).

Off the engine loop: the tokenizer and every matcher are built on one background thread (which
alone touches the template cache). `start` only enqueues the build; the engine thread waits for
it when the request first samples, so a prompt's prefill forward (and every chunk of a chunked
one) runs while its grammar compiles. The build is bounded by the parser limits
(services/common/structured.parser_limits) and the wait by BUILD_WAIT_S. Masks of many rows of an
expensive grammar are filled in parallel by llguidance's executor (Rust threads, no GIL); cheap
ones stay on the engine thread, where they measured faster (PARALLEL_MIN_MS).

A request whose constraint cannot be enforced (the grammar does not build, the tokenizer is
missing, or the matcher refused a sampled token) is ended cleanly: its mask allows only EOS, so
its next token is EOS and the scheduler finishes it with "stop" (with `ignore_eos` it runs on to
max_tokens, all EOS). A warning names the request id and the constraint's kind, never its text
(llguidance's error messages quote the grammar).

Bitmask layout (llguidance's): int32 [k, W], W = ceil(V_tok / 32), bit j of word w allows token
32 * w + j; rows of tokens the tokenizer lacks are 0. The model's vocabulary may be wider than the
tokenizer's (a padded embedding): sampling.py masks the columns past 32 * W too.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections import OrderedDict

import numpy as np
import torch

from services.common.structured import parser_limits
from services.worker.metrics import GRAMMAR_CACHE, MASK_PER_ROW, MATCHER_BUILD
from services.worker.sampling import SampleRow

log = logging.getLogger(__name__)

TEMPLATE_CACHE_SIZE = 64   # recent grammars kept built: a repeated schema costs a deep copy only
BUILD_WAIT_S = 10.0        # longest a sampling step waits for a matcher still compiling
# Masks go to llguidance's thread pool only when a step's masks are expected to take longer than
# its fixed cost: on the H200 host, 64 rows of a small schema took 0.65 ms filled here and 1.3-1.6
# ms through the pool (bench/results/gpu_structured.json), so cheap grammars stay on this thread.
PARALLEL_MIN_ROWS = 4      # fewer constrained rows: always on this thread
PARALLEL_MIN_MS = 2.0      # expected serial time of the step's masks (EWMA per row x rows) to go parallel


class RequestMatcher:
    """One constrained request's grammar state, in step with the tokens it has sampled. Its
    matcher may still be compiling (`_build`): every use waits for it first."""

    __slots__ = ("request_id", "kind", "_matcher", "_build", "failed")

    def __init__(self, request_id: str, kind: str, matcher=None,
                 build: concurrent.futures.Future | None = None) -> None:
        self.request_id, self.kind, self._matcher, self._build = request_id, kind, matcher, build
        self.failed = matcher is None and build is None

    @property
    def matcher(self):
        """The llguidance matcher (waits for its build); None once failed."""
        if self._build is not None:
            build, self._build = self._build, None
            try:
                self._matcher = build.result(timeout=BUILD_WAIT_S)
            except concurrent.futures.TimeoutError:
                self._matcher = None
                self.fail(f"did not compile within {BUILD_WAIT_S:.0f} s")
            except Exception as exc:  # noqa: BLE001 - the build job logs nothing itself
                self._matcher = None
                self.fail(f"failed to build ({type(exc).__name__})")
            if self._matcher is None:
                self.failed = True
        return None if self.failed else self._matcher

    @property
    def ready(self) -> bool:
        return self._build is None or self._build.done()

    def fail(self, why: str) -> None:
        if not self.failed:
            self.failed = True
            log.warning("request %s: structured output (%s) %s; ending it with EOS", self.request_id,
                        self.kind, why)

    def consume(self, token_id: int) -> None:
        m = self.matcher
        if m is None:
            return
        if not m.consume_token(token_id) or m.is_error():
            self.fail("refused a sampled token")


class Constraints:
    """A runner's structured-output state: the tokenizer, the template LRU and the build thread."""

    def __init__(self, tokenizer_path: str | None, eos_token_ids: tuple[int, ...], vocab_size: int,
                 model_name: str = "", cache_size: int = TEMPLATE_CACHE_SIZE) -> None:
        self._build_hist, self._mask_hist = MATCHER_BUILD.labels(model_name), MASK_PER_ROW.labels(model_name)
        self._hits, self._misses = GRAMMAR_CACHE.labels(model_name, "hit"), GRAMMAR_CACHE.labels(model_name, "miss")
        self.tokenizer_path, self.eos_token_ids = tokenizer_path, tuple(eos_token_ids)
        self.vocab_size = vocab_size      # the model's: sizes the EOS-only masks if no tokenizer builds
        self.cache_size = cache_size
        self._tokenizer = None
        self._tokenizer_failed = False
        self._templates: OrderedDict[str, object] = OrderedDict()   # grammar text -> built matcher
        self._eos_bits: np.ndarray | None = None                    # uint32 [W]: the EOS-only mask
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._executor = None             # llguidance's LLExecutor, for masks of many rows
        self.build_s = 0.0        # time spent building matchers (not copies), for metrics / tests
        self.mask_s = 0.0         # time spent filling masks
        self.cache_hits = 0
        self._row_ms = 0.0        # EWMA of the serial host time of one row's mask

    def _submit(self, fn, *args) -> concurrent.futures.Future:
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-build")
            return self._pool.submit(fn, *args)

    def warm(self) -> concurrent.futures.Future:
        """Build the tokenizer in the background now (start-up), not at the first constrained request."""
        return self._submit(self.tokenizer)

    def tokenizer(self):
        """The LLTokenizer over the model's tokenizer.json, built once; None if it cannot be.
        Build-thread only (the engine thread reads `_tokenizer` once a build it waited for is done)."""
        if self._tokenizer is None and not self._tokenizer_failed:
            try:
                from llguidance import LLTokenizer
                if not self.tokenizer_path:
                    raise FileNotFoundError("no tokenizer.json known to this runner")
                with open(self.tokenizer_path, encoding="utf-8") as f:
                    self._tokenizer = LLTokenizer(f.read(), eos_token=list(self.eos_token_ids) or None)
            except Exception as exc:  # noqa: BLE001 - a worker without one still serves free text
                self._tokenizer_failed = True
                # The reason names the file or the EOS ids, never request text.
                log.warning("structured outputs unavailable: tokenizer not built (%s: %s)", type(exc).__name__,
                            str(exc)[:200])
        return self._tokenizer

    @property
    def width(self) -> int:
        vocab = self._tokenizer.vocab_size if self._tokenizer is not None else self.vocab_size
        return (vocab + 31) // 32

    def _template(self, grammar: str):
        """A built matcher of `grammar` (cached, never fed tokens), or None if it does not build."""
        if grammar in self._templates:
            self._templates.move_to_end(grammar)
            self.cache_hits += 1
            self._hits.inc()
            return self._templates[grammar]
        from llguidance import LLMatcher
        t0 = time.perf_counter()
        try:
            m = LLMatcher(self._tokenizer, grammar, limits=parser_limits())
            m = None if m.is_error() else m
        except Exception:  # noqa: BLE001 - it reports grammar errors by is_error(); anything else ends one request too
            m = None
        took = time.perf_counter() - t0
        self.build_s += took
        self._build_hist.observe(took)
        self._misses.inc()
        self._templates[grammar] = m
        if len(self._templates) > self.cache_size:
            self._templates.popitem(last=False)
        return m

    def _build(self, request_id: str, kind: str, grammar: str, outputs: list[int]):
        """Build-thread job: the request's own matcher, fed its earlier outputs; None if it fails."""
        if self.tokenizer() is None:
            log.warning("request %s: structured output (%s) cannot be enforced; ending it with EOS",
                        request_id, kind)
            return None
        template = self._template(grammar)
        if template is None:
            log.warning("request %s: structured output (%s) grammar does not build; ending it with EOS",
                        request_id, kind)
            return None
        m = template.deep_copy()
        for t in outputs:   # a request resumed after a preemption comes back with them
            if not m.consume_token(t) or m.is_error():
                log.warning("request %s: structured output (%s) refused a resumed token; ending it with EOS",
                            request_id, kind)
                return None
        return m

    def start(self, request_id: str, structured: tuple[str, str], outputs: list[int]) -> RequestMatcher:
        """The matcher of a new request, compiling in the background. Never raises: a failed one
        only ends its request."""
        kind, grammar = structured
        if not grammar:
            log.warning("request %s: structured output (%s) has no grammar; ending it with EOS", request_id, kind)
            return RequestMatcher(request_id, kind)
        return RequestMatcher(request_id, kind, build=self._submit(self._build, request_id, kind, grammar,
                                                                   list(outputs)))

    def _parallel_executor(self):
        if self._executor is None:
            from llguidance import LLExecutor
            self._executor = LLExecutor(num_threads=max(1, min(8, (os.cpu_count() or 2) // 2)))
        return self._executor

    def prepare(self, rows: list[SampleRow], matchers: list[RequestMatcher | None]) -> torch.Tensor | None:
        """The bitmask int32 [k, W] (host) of one step's k constrained sampling rows, in row order;
        sets their `mask_row` and `grammar_stops`. None: no row is constrained. Each matcher has
        consumed every token of its request (the runner reads constrained rows' tokens first);
        one still compiling is waited for."""
        k = 0
        for row, m in zip(rows, matchers):
            if m is not None:
                row.mask_row, k = k, k + 1
        if not k:
            return None
        import llguidance.torch as lt
        t0 = time.perf_counter()
        live = [(m.matcher, row.mask_row) for row, m in zip(rows, matchers) if m is not None]
        live = [(mm, r) for mm, r in live if mm is not None]
        bitmask = torch.zeros(k, self.width, dtype=torch.int32)   # [k, W]
        words = bitmask.numpy().view(np.uint32)                  # the same memory, bit 31 unsigned
        if any(row.draft_prefix for row in rows):
            self._fill_with_drafts(rows, matchers, bitmask)
        elif len(live) >= PARALLEL_MIN_ROWS and self._row_ms * len(live) >= PARALLEL_MIN_MS:
            lt.fill_next_token_bitmask_par(self._parallel_executor(), live, bitmask)
        elif live:
            t_fill = time.perf_counter()
            for mm, r in live:
                lt.fill_next_token_bitmask(mm, bitmask, r)
            row_ms = (time.perf_counter() - t_fill) * 1e3 / len(live)
            self._row_ms = row_ms if not self._row_ms else 0.8 * self._row_ms + 0.2 * row_ms
        for row, m in zip(rows, matchers):
            if m is None:
                continue
            r = row.mask_row
            if not m.failed and m.matcher.is_error():     # computing the mask can fail too (parser limits)
                m.fail("failed computing its mask")
            if m.failed:
                words[r] = self._eos_only()
            cfg = row.cfg
            if row.num_output_tokens < cfg.min_tokens:
                # min_tokens would mask the very tokens the grammar allows: the grammar wins.
                stop = self._bits(set(cfg.stop_token_ids) | set(() if cfg.ignore_eos else self.eos_token_ids))
                row.grammar_stops = not np.any(words[r] & ~stop)
        took = time.perf_counter() - t0
        self.mask_s += took
        self._mask_hist.observe(took / k)     # one observation per step, never per token
        return bitmask

    @staticmethod
    def _fill_with_drafts(rows, matchers, bitmask) -> None:
        """Masks of a step with draft rows: a request's rows come in draft order, each after the
        matcher has consumed the drafts before it; then the matcher is rolled back (the tokens it
        keeps are the ones the row emits, fed at resolve)."""
        import llguidance.torch as lt
        consumed: dict[int, tuple] = {}          # id(RequestMatcher) -> (matcher, drafts consumed)
        for row, m in zip(rows, matchers):
            if m is None or m.failed or m.matcher is None:
                continue
            mm = m.matcher
            n = consumed.get(id(m), (mm, 0))[1]
            for t in row.draft_prefix[n:]:
                mm.consume_token(t)             # valid: drafts were cut at the grammar's first refusal
            consumed[id(m)] = (mm, len(row.draft_prefix))
            lt.fill_next_token_bitmask(mm, bitmask, row.mask_row)
        for mm, n in consumed.values():
            if n:
                mm.rollback(n)

    def valid_prefix(self, m: RequestMatcher, drafts: list[int]) -> int:
        """How many leading drafts the request's grammar accepts (a draft that breaks it is cut)."""
        mm = m.matcher
        if mm is None or m.failed or not drafts:
            return 0 if m.failed or mm is None else len(drafts)
        return mm.validate_tokens(drafts)

    def _bits(self, token_ids) -> np.ndarray:
        bits = np.zeros(self.width, dtype=np.uint32)
        for t in token_ids:
            if 0 <= t < 32 * self.width:
                bits[t >> 5] |= np.uint32(1 << (t & 31))
        return bits

    def _eos_only(self) -> np.ndarray:
        if self._eos_bits is None:
            self._eos_bits = self._bits(self.eos_token_ids)
        return self._eos_bits

"""--speculative-config (services/common/spec_config.py) and the choice of K per request
(services/worker/spec/dynamic_k.py)."""
from __future__ import annotations

import json

import pytest

from services.common.spec_config import SpecConfigError, check_draft_tokenizer, parse_spec_config
from services.worker.spec.dynamic_k import AcceptanceTracker, StepCostModel, choose_k


def test_vllm_fields_parse_and_default():
    cfg = parse_spec_config('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 6}')
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 4, 2, 6)
    assert parse_spec_config(None) is None and parse_spec_config("") is None
    table = parse_spec_config({"method": "suffix", "num_speculative_tokens": 5,
                               "dynamic_k": [[1, 8, 5], [9, 64, 2], [65, 100000, 0]]})
    assert [table.fixed_k(b) for b in (1, 8, 9, 64, 65, 500)] == [5, 5, 2, 2, 0, 0]
    assert parse_spec_config({"method": "ngram", "num_speculative_tokens": 3}).fixed_k(7) is None


@pytest.mark.parametrize("cfg, says", [
    ("{not json", "not valid JSON"),
    ('["ngram"]', "must be a JSON object"),
    ({"method": "eagle9", "num_speculative_tokens": 3}, "method must be one of ngram, suffix, draft_model"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in [1, 16]"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens must be an integer in [1, 16]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "prompt_lookup_min (5) exceeds prompt_lookup_max (3)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "spec_tokens": 3}, "unknown field(s) spec_tokens"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/no/such/dir"}, "does not exist"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/tmp"}, "only for method draft_model"),
    ({"method": "ngram", "num_speculative_tokens": 3, "dynamic_k": [[1, 8, 3], [4, 9, 1]]}, "rows overlap"),
    ({"method": "ngram", "num_speculative_tokens": 2, "dynamic_k": [[1, 8, 3]]}, "0 <= K <= num_speculative_tokens"),
])
def test_a_bad_config_is_refused_with_a_clear_message(cfg, says):
    with pytest.raises(SpecConfigError) as err:
        parse_spec_config(cfg)
    assert says in str(err.value)


def test_a_draft_model_must_share_the_targets_tokenizer(tmp_path, smollm2_dir):
    same = tmp_path / "same"
    same.mkdir()
    (same / "tokenizer.json").write_bytes((smollm2_dir / "tokenizer.json").read_bytes())
    check_draft_tokenizer(str(smollm2_dir), str(same))
    other = tmp_path / "other"
    other.mkdir()
    tok = json.loads((smollm2_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first = next(iter(vocab))
    vocab[first + "x"] = vocab.pop(first)
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(SpecConfigError, match="does not share the target's tokenizer"):
        check_draft_tokenizer(str(smollm2_dir), str(other))


# ---- K per request from the step cost and the acceptance ----------------------------------------
FLAT_THEN_LINEAR = StepCostModel([(1, 0.010), (64, 0.010), (256, 0.020), (1024, 0.080)])


def test_small_batches_with_high_acceptance_speculate_and_large_ones_with_none_do_not():
    assert choose_k(FLAT_THEN_LINEAR, 1, [(0.8, 4)]) == [4], "a free step: every draft is worth it"
    assert choose_k(FLAT_THEN_LINEAR, 256, [(0.05, 4)] * 256) == [0] * 256, "nothing accepted: plain decode"
    assert choose_k(FLAT_THEN_LINEAR, 1, [(0.8, 0)]) == [0], "no proposal, no draft"


def test_drafts_go_to_the_requests_that_accept_the_most():
    # 200 tokens of base load: each draft token now costs, so only the likely ones pay.
    ks = choose_k(FLAT_THEN_LINEAR, 200, [(0.9, 4)] * 8 + [(0.1, 4)] * 8 + [(0.0, 0)] * 184)
    assert all(k > 0 for k in ks[:8]) and all(k == 0 for k in ks[8:])
    assert sum(ks) > 8


def test_acceptance_rates_start_from_the_methods_prior_and_track_each_request():
    t = AcceptanceTracker(prior=0.5)
    assert t.rate("a") == 0.5
    for _ in range(10):
        t.update("a", 4, 4)
        t.update("b", 4, 0)
    assert t.rate("a") > 0.9 and t.rate("b") < 0.1
    t.forget("a")
    assert t.rate("a") == t.prior


def test_the_decoder_skips_the_sync_when_no_draft_can_pay():
    """worth_trying (before reading the previous step's tokens) says no when verifying costs far
    more than plain steps, yes when drafts are nearly free and likely accepted."""
    from services.worker.spec.decoder import SpecDecoder
    d = SpecDecoder(parse_spec_config({"method": "ngram", "num_speculative_tokens": 4}))
    assert d.worth_trying([("a", 4)], 1, 1), "uncalibrated: try"
    d.plain_cost = StepCostModel([(1, 0.001), (64, 0.0012)])
    d.spec_cost = StepCostModel([(2, 0.014), (320, 0.014)])        # eager verify steps: 12x a graph step
    assert not d.worth_trying([(f"r{i}", 4) for i in range(32)], 32, 32)
    d.spec_cost = StepCostModel([(2, 0.0011), (320, 0.0015)])       # verify nearly free
    d.acceptance.prior = 0.8
    assert d.worth_trying([("a", 4)], 1, 1)


def test_the_sync_a_speculating_step_costs_counts_against_its_drafts():
    # A flat cost curve: drafts are free on the device; what decides is the overlap given up.
    flat = StepCostModel([(1, 0.002), (512, 0.002)])
    reqs = [(0.3, 4)] * 32
    assert any(choose_k(flat, 32, reqs)), "free drafts pay when the sync costs nothing (CPU)"
    assert choose_k(flat, 32, reqs, sync_s=0.004) == [0] * 32, "a sync dearer than the drafts' gain: none"
    assert any(choose_k(flat, 1, [(0.9, 4)], sync_s=0.001)), "a likely run still pays for its sync"


def test_a_low_rate_drifts_back_to_the_prior_so_the_request_is_tried_again():
    from services.worker.spec.dynamic_k import HIT_PRIOR_REVISIT, REVISIT_STEPS
    t = AcceptanceTracker(prior=0.5)
    for _ in range(12):
        t.update("a", 4, 0)
    low = t.rate("a")
    assert low < 0.05
    for _ in range(REVISIT_STEPS // 2):
        t.tick()
    assert low < t.rate("a") < t.prior
    for _ in range(REVISIT_STEPS):
        t.tick()
    assert t.rate("a") == pytest.approx(t.prior)
    t.found("b", False)
    assert t.hit("b") < 1 and t.rate("b") == t.prior, "nothing to propose is not a rejection"
    for _ in range(REVISIT_STEPS):
        t.tick()
    assert t.hit("b") == pytest.approx(t.hit_prior()) and t.hit_prior() < 1, "back at the method's hit rate"
    for _ in range(HIT_PRIOR_REVISIT):
        t.tick()
    assert t.hit("b") == pytest.approx(1.0), "and both at 1 later: the proposer is asked again"


def test_rows_that_seldom_have_a_proposal_stop_costing_syncs():
    from services.worker.spec.decoder import SpecDecoder
    d = SpecDecoder(parse_spec_config({"method": "ngram", "num_speculative_tokens": 4}))
    d.plain_cost = StepCostModel([(1, 0.010), (64, 0.010)])
    d.spec_cost = StepCostModel([(1, 0.010), (320, 0.011)])
    rows = [(f"r{i}", 4) for i in range(8)]
    for i in range(8):
        d.start(f"r{i}", [10 + i, 20 + i, 30 + i], 0)     # no n-gram repeats: nothing to propose
    assert d.worth_trying(rows, 8, 8)
    for _ in range(12):
        assert d.drafts(rows, 8, 8) == {}
    assert not d.worth_trying(rows, 8, 8), "seldom anything to draft: the sync does not pay"
    assert d.acceptance.rate("r0") == d.acceptance.prior


def test_a_draft_model_drafts_one_k_for_the_step_from_both_step_costs():
    from services.worker.spec.dynamic_k import choose_uniform_k
    verify = StepCostModel([(1, 0.010), (256, 0.011)])
    cheap, dear = StepCostModel([(1, 0.0005), (64, 0.0006)]), StepCostModel([(1, 0.010), (64, 0.011)])
    assert choose_uniform_k(verify, 1, [(0.9, 8)], cheap, plain=verify) >= 4, "a cheap drafter drafts deep"
    assert choose_uniform_k(verify, 1, [(0.9, 8)], dear, plain=verify) == 0, "one as dear as the target never pays"
    assert choose_uniform_k(verify, 4, [(0.9, 2), (0.9, 8)] * 2, cheap, plain=verify) >= 2


def test_a_wave_of_new_requests_is_proposed_for_a_few_at_a_time():
    from services.worker.spec.decoder import EXPLORE_ROWS, SpecDecoder
    d = SpecDecoder(parse_spec_config({"method": "suffix", "num_speculative_tokens": 4, "suffix_min_prob": 0.0}))
    for i in range(40):
        d.start(f"r{i}", [5, 6, 7, 5, 6, 7, 5, 6], 0)
    rows = [(f"r{i}", 4) for i in range(40)]

    def indexed():   # requests whose proposer was asked at least once
        return {rid for rid in d.proposers if d.acceptance.seen(rid)}
    got = d.drafts(rows, 40, 40)
    assert len(indexed()) == EXPLORE_ROWS and set(got) == indexed()
    d.drafts(rows, 40, 40)
    assert len(indexed()) == 2 * EXPLORE_ROWS, "the next step asks the next ones (and again the seen ones)"
    d2 = SpecDecoder(parse_spec_config({"method": "suffix", "num_speculative_tokens": 4, "suffix_min_prob": 0.0}))
    d2.start("solo", [5, 6, 7, 5, 6, 7, 5, 6], 0)
    assert d2.drafts([("solo", 4)], 1, 1)["solo"], "one request: proposed at once"


def test_syncs_whose_proposals_are_declined_back_off_and_a_draft_resets_them():
    """Proposals the cost model then declines (K = 0) still paid their sync: such steps in a row
    make worth_trying say no for 1, 2, 4 .. steps. A step with nothing to propose does not (the
    hit rate prices it)."""
    from services.worker.spec.decoder import MAX_BACKOFF, SpecDecoder
    d = SpecDecoder(parse_spec_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}))
    d.plain_cost = StepCostModel([(1, 0.010), (512, 0.010)])
    d.spec_cost = StepCostModel([(1, 0.010), (512, 0.010)])
    d.start("a", [5, 6, 5, 6, 5], 0)
    rows = [("a", 4)]
    d.plain_host_s = 0.03                         # a sync dearer than any draft's gain: K = 0 once proposed
    assert d.worth_trying(rows, 1, 1) is False
    d.plain_host_s = 0.0
    waits = []
    for _ in range(5):
        d.plain_host_s = 0.03
        assert d.drafts(rows, 1, 1) == {}    # proposed, declined
        d.plain_host_s = 0.0
        n = 0
        while not d.worth_trying(rows, 1, 1):
            d.acceptance.tick()
            n += 1
            assert n <= MAX_BACKOFF
        waits.append(n)
    assert waits == [1, 2, 4, 8, 16]
    assert d.drafts(rows, 1, 1), "drafts again once the sync is cheap"
    assert d.worth_trying(rows, 1, 1), "and a draft resets the back-off"
    d.start("b", [9, 8, 7], 0)                     # no n-gram repeats: nothing to propose
    assert d.drafts([("b", 4)], 1, 1) == {}
    assert d.worth_trying([("a", 4)], 1, 1), "nothing proposed is no reason to wait"


def test_the_host_time_speculating_steps_exposed_prices_their_batch_size_only():
    """A speculating step exposes the host's work (resolving the previous step, proposing,
    building the verify) that a plain step hides: once measured at a batch size it replaces the
    plain build time there, so drafts that paid at one row stop at 32 rows whose host work is
    dearer than their gain, and nothing changes at other sizes."""
    from services.worker.spec.decoder import SpecDecoder
    d = SpecDecoder(parse_spec_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}))
    d.plain_cost = StepCostModel([(1, 0.010), (512, 0.010)])
    d.spec_cost = StepCostModel([(1, 0.010), (512, 0.012)])
    rows = [(f"r{i}", 4) for i in range(32)]
    for rid, _ in rows:
        d.start(rid, [5, 6, 5, 6, 5, 6, 5], 0)
    d.host_time(0.0005)
    assert d.sync_s(32) == d.sync_s(1) == 0.0005
    assert d.worth_trying(rows, 32, 32) and d.drafts(rows, 32, 32), "priced at the plain build time: drafts pay"
    for _ in range(20):
        d.spec_host_time(32, 0.030)
    assert abs(d.sync_s(32) - 0.030) < 1e-3 and d.sync_s(1) == 0.0005 and d.sync_s(20) == 0.0005
    assert not d.worth_trying(rows, 32, 32), "32 rows: the measured exposure is dearer than the drafts' gain"
    assert d.drafts(rows[:1], 1, 1), "one row: still priced at its own (plain) build time"
    for _ in range(32):                  # not renewed (speculating stopped there): back to the floor
        d.acceptance.tick()
    assert d.sync_s(32) == 0.0005 and d.worth_trying(rows, 32, 32), "so 32 rows are tried again"
    d.spec_host_time(32, 5.0)            # one pause-length step
    assert d.sync_s(32) < 0.0005 * 4, "moves the estimate at most 4x"


def test_after_empty_proposals_requests_not_asked_yet_no_longer_make_steps_sync():
    """Random text gives the n-gram proposer nothing: requests never asked are priced at the
    method's recent hit rate, so a batch of 256 of them stops paying a sync per step after a few
    empty asks (each step asks at most EXPLORE_ROWS of them), and is tried again much later."""
    from services.worker.spec.decoder import SpecDecoder
    from services.worker.spec.dynamic_k import HIT_PRIOR_REVISIT
    d = SpecDecoder(parse_spec_config({"method": "ngram", "num_speculative_tokens": 4}))
    d.plain_cost = StepCostModel([(1, 0.010), (256, 0.012), (2048, 0.020)])
    d.spec_cost = d.plain_cost
    d.host_time(0.001)
    rng = __import__("random").Random(3)
    rows = [(f"r{i}", 4) for i in range(256)]
    for rid, _ in rows:
        d.start(rid, [rng.randrange(10**6) for _ in range(64)], 0)   # nothing repeats
    syncs = 0
    for _ in range(40):
        d.acceptance.tick()
        if d.worth_trying(rows, 256, 256):
            syncs += 1
            assert d.drafts(rows, 256, 256) == {}
    assert 1 <= syncs <= 6, syncs
    for _ in range(HIT_PRIOR_REVISIT):
        d.acceptance.tick()
    assert d.worth_trying(rows, 256, 256), "tried again once the method's hit rate drifted back"


def test_the_verify_cost_depends_on_rows_not_only_on_tokens():
    """256 decode rows with a few drafts are priced as a verify step of 256 rows (the plain step's
    growth past the calibrated rows), not as 64 rows of 4 tokens: the drafts then do not pay,
    where a curve of tokens alone would price that step below the plain one and draft."""
    from services.worker.spec.dynamic_k import VerifyCostModel
    plain = StepCostModel([(1, 0.005), (64, 0.008), (256, 0.016)])
    points = [(1, 2, 0.0055), (1, 5, 0.0056), (64, 128, 0.010), (64, 320, 0.013)]
    verify = VerifyCostModel(points, plain=plain)
    assert verify.cost(128, 64) == pytest.approx(0.010) and verify.cost(320, 64) == pytest.approx(0.013)
    assert verify.cost(5, 1) == pytest.approx(0.0056)
    one_64 = 0.010 - 3 / 192 * 1e-3 * 64
    assert verify.cost(256, 256) == pytest.approx(one_64 * 2), "past the calibrated rows: grows as the plain step"
    assert 0.0055 < verify.cost(64, 32) < 0.010, "between row counts: interpolated (2 tokens a row)"
    tokens_only = StepCostModel([(t, s) for _, t, s in points])
    reqs = [(0.84, 4)] * 11 + [(0.84, 0)] * 245     # 11 of 256 rows have drafts
    assert any(choose_k(tokens_only, 256, reqs, plain=plain, rows=256)), "the curve of tokens: 'cheaper' than plain"
    assert not any(choose_k(verify, 256, reqs, plain=plain, rows=256)), "256 rows verified: the drafts do not pay"
    assert any(choose_k(verify, 1, [(0.84, 4)], plain=plain, rows=1)), "one row: they do"
    single = VerifyCostModel([(1, 2, 0.005), (1, 5, 0.008), (8, 16, 0.010)])
    assert single.cost(16 + 3, 8) == pytest.approx(0.010 + 0.001 * 3), "one point at 8 rows: the nearest slope"


def test_the_expected_run_of_k_drafts_is_the_sum_of_the_acceptance_powers():
    from services.worker.spec.dynamic_k import expected_run
    for a in (0.0, 0.3, 0.72, 0.999, 1.0):
        for k in range(0, 9):
            assert expected_run(a, k) == pytest.approx(sum(a ** j for j in range(1, k + 1)), abs=1e-9)


def test_a_few_proposing_rows_do_not_make_a_large_step_speculate():
    """The rows without a proposal still emit their token and still wait for the slower step:
    two well-accepted proposals pay their sync in a step of two rows, not in one of 32."""
    flat = StepCostModel([(1, 0.001), (512, 0.001)])
    reqs = [(0.9, 8)] * 2
    assert any(choose_k(flat, 2, reqs, sync_s=0.0015, rows=2)), "two rows: the drafts pay for the sync"
    assert choose_k(flat, 32, reqs, sync_s=0.0015, rows=32) == [0, 0], "30 more rows wait for it: they do not"


def test_host_speculating_steps_measured_slower_than_plain_ones_stop_the_syncs():
    """Whatever the cost model expects, host speculating steps whose measured loop period makes
    them emit fewer tokens per second than plain steps at that batch turn worth_trying off; a
    measure not renewed within PERIOD_REVISIT steps is forgotten, so the batch is tried again."""
    from services.worker.spec.decoder import PERIOD_REVISIT, SpecDecoder
    d = SpecDecoder(parse_spec_config({"method": "suffix", "num_speculative_tokens": 8}))
    d.plain_cost = StepCostModel([(1, 0.0005), (512, 0.0005)])
    d.spec_cost = StepCostModel([(1, 0.0005), (512, 0.0005)])    # the model thinks drafts are free
    d.acceptance.prior = 0.9
    rows = [(f"r{i}", 8) for i in range(32)]
    assert d.host_spec_pays(32) is None and d.worth_trying(rows, 32, 32)
    d.step_period(32, 1, 0.0012)              # plain steps: 32 tokens in 1.2 ms
    d.step_period(32, 0, 0.0045)              # speculating ones: 4.5 ms ...
    d.host_spec_step(32, 16)                  # ... for 32 + 16 tokens
    assert d.host_spec_pays(32) is False and not d.worth_trying(rows, 32, 32)
    assert d.host_spec_pays(2) is None and d.worth_trying(rows[:2], 2, 2), "another batch size is its own measure"
    for _ in range(PERIOD_REVISIT):
        d.acceptance.tick()
    assert d.host_spec_pays(32) is None and d.worth_trying(rows, 32, 32), "forgotten: tried again"
    d.step_period(32, 1, 0.0012)
    d.step_period(32, 0, 0.0015)
    d.host_spec_step(32, 30)                  # 62 tokens in 1.5 ms: speculating pays
    assert d.host_spec_pays(32) is True and d.worth_trying(rows, 32, 32)

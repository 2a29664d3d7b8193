"""Benchmark math against hand-computed fixtures."""
import math

import pytest

from services.benchmark.compare import compare
from services.benchmark.metrics import (RequestResult, distribution, meets_slos, parse_goodput, percentile,
                                        summarize)
from services.benchmark.runner import LoadShape, arrival_delays


def test_percentile_interpolates_linearly_between_ranks():
    xs = [10.0, 20.0, 30.0, 40.0]
    # rank = (n-1) * p / 100: p50 -> 1.5 -> 25; p90 -> 2.7 -> 37; p99 -> 2.97 -> 39.7
    assert percentile(xs, 50) == pytest.approx(25.0)
    assert percentile(xs, 90) == pytest.approx(37.0)
    assert percentile(xs, 99) == pytest.approx(39.7)
    assert percentile(xs, 0) == 10.0 and percentile(xs, 100) == 40.0
    assert percentile([40.0, 10.0, 30.0, 20.0], 50) == pytest.approx(25.0)  # order does not matter
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_distribution_reports_milliseconds_with_population_std():
    d = distribution([0.001, 0.002, 0.003, 0.004], (50, 99))
    assert d["mean"] == pytest.approx(2.5)
    assert d["median"] == pytest.approx(2.5) and d["p50"] == pytest.approx(2.5)
    assert d["p99"] == pytest.approx(3.97)
    assert d["std"] == pytest.approx(math.sqrt(1.25))
    assert (d["min"], d["max"]) == (pytest.approx(1.0), pytest.approx(4.0))


def _req(ttft, latency, out, itl=(), ok=True, prompt=10, error=""):
    return RequestResult(success=ok, error=error, prompt_len=prompt, output_len=out, ttft=ttft,
                         latency=latency, itl=list(itl))


def test_tpot_excludes_the_first_token():
    r = _req(ttft=0.1, latency=0.5, out=5)
    assert r.tpot == pytest.approx(0.1)       # (0.5 - 0.1) / (5 - 1)
    assert _req(0.1, 0.1, 1).tpot is None     # one token: no TPOT


def test_summary_counts_throughput_and_errors_by_type():
    results = [_req(0.1, 0.5, 5, itl=[0.1] * 4), _req(0.2, 1.2, 11, itl=[0.1] * 10),
               _req(0, 0, 0, ok=False, error="http_500"), _req(0, 0, 0, ok=False, error="http_500"),
               _req(0, 0, 0, ok=False, error="timeout")]
    s = summarize(results, duration_s=2.0)
    assert (s["completed"], s["failed"]) == (2, 3)
    assert s["errors"] == {"http_500": 2, "timeout": 1}
    assert s["total_input_tokens"] == 20 and s["total_output_tokens"] == 16
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(8.0)
    assert s["total_token_throughput"] == pytest.approx(18.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0)   # both requests: 100 ms per token
    assert s["itl_ms"]["p99"] == pytest.approx(100.0)
    assert s["e2el_ms"]["p50"] == pytest.approx(850.0)
    assert s["goodput"] is None


def test_goodput_counts_only_requests_within_every_slo():
    slos = parse_goodput(["ttft:150", "tpot:50", "e2el:1000"])
    assert slos == {"ttft": 150.0, "tpot": 50.0, "e2el": 1000.0}
    fast = _req(0.1, 0.3, 5)                 # ttft 100, tpot 50 (== SLO, inclusive), e2el 300
    slow_first = _req(0.2, 0.3, 5)           # ttft 200 > 150
    slow_tokens = _req(0.1, 0.9, 5)          # tpot 200 > 50
    one_token = _req(0.1, 0.1, 1)            # no TPOT: that SLO does not apply
    failed = _req(0.01, 0.02, 5, ok=False, error="http_500")
    assert [meets_slos(r, slos) for r in (fast, slow_first, slow_tokens, one_token, failed)] == \
        [True, False, False, True, False]
    s = summarize([fast, slow_first, slow_tokens, one_token, failed], duration_s=4.0, slos=slos)
    assert s["goodput"] == pytest.approx(0.5)  # 2 good requests / 4 s


def test_an_itl_slo_holds_each_request_to_its_own_p99_gap():
    """One stall in a steady stream fails the ITL SLO where TPOT (a mean) still passes."""
    slos = parse_goodput(["itl:50", "tpot:50"])
    steady = RequestResult(success=True, output_len=101, ttft=0.1, latency=0.1 + 100 * 0.02, itl=[0.02] * 100)
    stalled = RequestResult(success=True, output_len=101, ttft=0.1, latency=0.1 + 98 * 0.01 + 2 * 0.5,
                            itl=[0.01] * 98 + [0.5, 0.5])
    assert stalled.tpot * 1e3 < 50, "the mean hides the stall"
    assert meets_slos(steady, slos) and not meets_slos(stalled, slos)
    assert meets_slos(RequestResult(success=True, output_len=1, ttft=0.1, latency=0.1), slos), "no gaps: passes"


@pytest.mark.parametrize("bad", ["ttft", "latency:5", "tpot:fast", "e2el:-1", "itl:x"])
def test_bad_goodput_specs_are_rejected(bad):
    with pytest.raises(ValueError):
        parse_goodput([bad])


def test_poisson_arrivals_have_the_requested_mean_rate_and_are_seeded():
    d = arrival_delays(4000, LoadShape(request_rate=20.0), seed=1)
    assert d[0] == 0.0 and all(b >= a for a, b in zip(d, d[1:]))
    assert 4000 / d[-1] == pytest.approx(20.0, rel=0.05)
    assert d == arrival_delays(4000, LoadShape(request_rate=20.0), seed=1)
    assert arrival_delays(3, LoadShape(), seed=1) == [0.0, 0.0, 0.0]   # inf: all at once


def test_compare_prints_ratios_b_over_a_with_a_verdict():
    def result(tput, p99):
        run = {"request_rate": None, "max_concurrency": 4, "request_throughput": tput,
               "output_throughput": tput * 10, "ttft_ms": {"mean": p99, "p50": p99, "p90": p99, "p99": p99}}
        return {"schema": "meshllm.bench.serve/1", "runs": [run]}
    text = compare(result(2.0, 100.0), result(3.0, 50.0), "old", "new")
    tput = next(line for line in text.splitlines() if "requests/s" in line)
    ttft = next(line for line in text.splitlines() if "TTFT p99" in line)
    assert "1.500" in tput and tput.rstrip().endswith("better")
    assert "0.500" in ttft and ttft.rstrip().endswith("better")     # lower latency is better

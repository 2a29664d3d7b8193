"""Pure benchmark math: per-request results in, summary metrics out (no I/O, no clocks).

Definitions follow `vllm bench serve`:
  TTFT  time from sending the request to the first streamed token
  TPOT  (e2e latency - TTFT) / (output tokens - 1), per request with >= 2 output tokens
  ITL   every gap between two successive streamed chunks that carried tokens
  E2EL  time from sending the request to the last byte of its response
Percentiles interpolate linearly between closest ranks (numpy's default method)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestResult:
    """One request as the client saw it. Times in seconds (perf_counter based)."""

    success: bool = False
    error: str = ""                 # error type when not success: "http_404", "connect", ...
    error_message: str = ""
    prompt_len: int = 0             # from the server's usage when reported, else the dataset's count
    output_len: int = 0             # from the server's usage when reported, else chunks counted
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0              # send time, relative to the run's start

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def distribution(values_s: list[float], percentiles=DEFAULT_PERCENTILES) -> dict:
    """mean / median / std / min / max / pNN of values given in seconds, reported in ms."""
    ms = [v * 1e3 for v in values_s]
    if not ms:
        out = {"mean": None, "median": None, "std": None, "min": None, "max": None}
        out.update({_pkey(p): None for p in percentiles})
        return out
    mean = sum(ms) / len(ms)
    std = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms))
    out = {"mean": mean, "median": percentile(ms, 50), "std": std, "min": min(ms), "max": max(ms)}
    out.update({_pkey(p): percentile(ms, p) for p in percentiles})
    return out


def _pkey(p: float) -> str:
    return f"p{p:g}".replace(".", "_")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds). `itl:MS` holds
    a request to its own 99th-percentile inter-token latency (a stream that stalls once in a
    hundred tokens fails it, where TPOT, a mean, would hide the stall)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "itl", "e2el"):
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS, itl:MS or e2el:MS, got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be >= 0 ms")
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    """A successful request whose TTFT, TPOT, p99 ITL and E2EL are all within the SLOs (ms,
    inclusive). A request with one output token has no TPOT or ITL and passes those SLOs (as in vLLM)."""
    if not r.success:
        return False
    if "ttft" in slos and r.ttft * 1e3 > slos["ttft"]:
        return False
    if "tpot" in slos and r.tpot is not None and r.tpot * 1e3 > slos["tpot"]:
        return False
    if "itl" in slos and r.itl and percentile(r.itl, 99) * 1e3 > slos["itl"]:
        return False
    if "e2el" in slos and r.latency * 1e3 > slos["e2el"]:
        return False
    return True


def summarize(results: list[RequestResult], duration_s: float, *, slos: dict[str, float] | None = None,
              percentiles=DEFAULT_PERCENTILES, metrics=PERCENTILE_METRICS) -> dict:
    """The per-run numbers written to the result JSON."""
    ok = [r for r in results if r.success]
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    dur = duration_s if duration_s > 0 else math.nan
    out = {
        "duration_s": duration_s, "completed": len(ok), "failed": len(results) - len(ok), "errors": errors,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur, "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "goodput": None, "slos_ms": dict(slos or {}),
    }
    if slos:
        out["goodput"] = sum(1 for r in ok if meets_slos(r, slos)) / dur
    series = {"ttft": [r.ttft for r in ok], "tpot": [t for r in ok if (t := r.tpot) is not None],
              "itl": [x for r in ok for x in r.itl], "e2el": [r.latency for r in ok]}
    for name in metrics:
        out[f"{name}_ms"] = distribution(series[name], percentiles)
    return out

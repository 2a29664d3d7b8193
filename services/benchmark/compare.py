"""`meshllm bench compare A.json B.json`: the runs of two results side by side, with B/A ratios."""
from __future__ import annotations

import json
import math
from pathlib import Path

from services.benchmark.plots import run_label

ROWS = [("request_throughput", None, "requests/s", True), ("output_throughput", None, "output tok/s", True),
        ("total_token_throughput", None, "total tok/s", True), ("goodput", None, "goodput req/s", True)]
for _m in ("ttft", "tpot", "itl", "e2el"):
    for _s in ("mean", "p50", "p90", "p99"):
        ROWS.append((f"{_m}_ms", _s, f"{_m.upper()} {_s} (ms)", False))


class CompareError(ValueError):
    pass


def load_result(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise CompareError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise CompareError(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or not str(data.get("schema", "")).startswith("meshllm.bench.serve/"):
        raise CompareError(f"{path} is not a `meshllm bench serve` result (no schema meshllm.bench.serve/N)")
    return data


def _value(run: dict, key: str, stat: str | None):
    v = run.get(key)
    if stat is not None:
        v = (v or {}).get(stat)
    return v


def _fmt(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:,.2f}"


def compare(a: dict, b: dict, name_a: str = "A", name_b: str = "B") -> str:
    """The comparison table. Runs are matched by index; ratio = B / A. A ratio > 1 is better for
    throughput rows and worse for latency rows; the last column says which way it went."""
    lines = []
    runs = list(zip(a["runs"], b["runs"]))
    if len(a["runs"]) != len(b["runs"]):
        lines.append(f"note: {name_a} has {len(a['runs'])} runs, {name_b} {len(b['runs'])}; "
                     f"comparing the first {len(runs)}")
    for i, (ra, rb) in enumerate(runs):
        lines.append(f"run {i}: {name_a} [{run_label(ra)}] vs {name_b} [{run_label(rb)}]")
        lines.append(f"  {'metric':<22}{name_a[:14]:>16}{name_b[:14]:>16}{'B/A':>9}  ")
        for key, stat, label, higher_better in ROWS:
            va, vb = _value(ra, key, stat), _value(rb, key, stat)
            if va is None and vb is None:
                continue
            ratio, verdict = "-", ""
            if va and vb is not None and not (math.isnan(va) or math.isnan(vb)):
                r = vb / va
                ratio = f"{r:.3f}"
                if abs(r - 1) >= 0.02:
                    verdict = "better" if (r > 1) == higher_better else "worse"
            lines.append(f"  {label:<22}{_fmt(va):>16}{_fmt(vb):>16}{ratio:>9}  {verdict}")
    return "\n".join(lines)

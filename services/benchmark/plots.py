"""PNG plots of benchmark results (matplotlib, Agg backend: no display needed).

  latency CDFs: TTFT, TPOT, ITL and E2E latency, one curve per run
  sweep:        throughput and p99 latency against the request rate or the concurrency"""
from __future__ import annotations

import math
from pathlib import Path


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def run_label(run: dict) -> str:
    rate = run["request_rate"]
    conc = run.get("max_concurrency")
    parts = [f"rate {'inf' if rate is None or math.isinf(rate) else f'{rate:g}'}"]
    if conc:
        parts.append(f"conc {conc}")
    return ", ".join(parts)


def latency_cdf(runs: list[dict], samples: list[dict], path: Path, title: str) -> Path:
    """samples[i]: {"ttft": [ms], "tpot": [ms], "itl": [ms], "e2el": [ms]} of runs[i]."""
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, key, name in zip(axes.flat, ("ttft", "tpot", "itl", "e2el"),
                             ("TTFT", "TPOT", "ITL", "E2E latency")):
        for run, s in zip(runs, samples):
            xs = sorted(s.get(key) or [])
            if not xs:
                continue
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=run_label(run))
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if key != "itl" else "fraction of gaps")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
        if ax.get_lines() and (xmax := max(max(line.get_xdata()) for line in ax.get_lines())) > 0:
            xmin = min(min(line.get_xdata()) for line in ax.get_lines())
            if xmin > 0 and xmax / xmin > 50:
                ax.set_xscale("log")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def sweep(runs: list[dict], path: Path, title: str) -> Path:
    """Throughput and p99 latencies against whichever of rate / concurrency varies."""
    plt = _plt()
    by_conc = len({r.get("max_concurrency") for r in runs}) > 1
    xs = [r["max_concurrency"] if by_conc else r["request_rate"] for r in runs]
    xlabel = "max concurrency" if by_conc else "request rate (req/s)"
    # an infinite rate is drawn one step to the right of the largest finite one
    finite = [x for x in xs if x is not None and not math.isinf(x)]
    xs = [x if x is not None and not math.isinf(x) else (max(finite) * 2 if finite else 1) for x in xs]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    a1.plot(xs, [r["output_throughput"] for r in runs], "o-", label="output tokens/s")
    a1b = a1.twinx()
    a1b.plot(xs, [r["request_throughput"] for r in runs], "s--", color="tab:orange", label="requests/s")
    a1.set_xlabel(xlabel)
    a1.set_ylabel("output tokens/s")
    a1b.set_ylabel("requests/s")
    a1.set_title("throughput")
    a1.grid(alpha=0.3)
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL")):
        ys = [(r.get(key) or {}).get("p99") for r in runs]
        if any(y is not None for y in ys):
            a2.plot(xs, [math.nan if y is None else y for y in ys], "o-", label=f"p99 {name}")
    a2.set_xlabel(xlabel)
    a2.set_ylabel("ms")
    a2.set_yscale("log")
    a2.set_title("p99 latency")
    a2.grid(alpha=0.3)
    a2.legend(fontsize=8)
    if len(xs) > 1 and min(xs) > 0 and max(xs) / min(xs) >= 8:
        a1.set_xscale("log", base=2)
        a2.set_xscale("log", base=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path

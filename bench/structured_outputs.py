"""The cost of structured outputs, side by side in one run: output tokens/s of the whole mesh with a
json_schema constraint vs unconstrained, on the same prompts, at concurrency 1 and N, plus the
worker's mask time per token (its Prometheus histogram) — on this CPU with SmolLM2.

  .venv/bin/python bench/structured_outputs.py [--model-dir DIR] [--concurrency 1 64] [--requests 8]
                                                [--max-tokens 96]

Every constrained output is checked against the schema (jsonschema); the run fails if one does
not validate. Writes bench/results/structured_outputs.json."""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import sys
import threading
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                  "maxItems": 4},
                         "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima", "Seoul"]}},
          "required": ["name", "age", "tags", "city"], "additionalProperties": False}
PROMPTS = ["Describe a fictional person as JSON.", "Invent a traveller and give their details.",
           "Give me a JSON record of a chess player.", "Who lives in Oslo? Answer as JSON.",
           "A short profile of a painter, as JSON.", "Make up a customer record."]


def run_load(client, model: str, concurrency: int, requests: int, max_tokens: int, constrained: bool):
    """-> (output tokens, wall seconds, outputs) for `requests` chat requests, `concurrency` at once."""
    outputs: list[str] = [""] * requests
    tokens = [0] * requests
    next_i, lock = [0], threading.Lock()

    def one(i: int) -> None:
        extra = ({"response_format": {"type": "json_schema",
                                      "json_schema": {"name": "person", "schema": SCHEMA}}}
                 if constrained else {})
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + f" (#{i})"}],
            max_tokens=max_tokens, temperature=0, **extra)
        outputs[i], tokens[i] = r.choices[0].message.content or "", r.usage.completion_tokens

    def worker() -> None:
        while True:
            with lock:
                i = next_i[0]
                next_i[0] += 1
            if i >= requests:
                return
            one(i)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens), time.perf_counter() - t0, outputs


def mask_seconds(metrics_url: str) -> tuple[float, float]:
    """(sum, count) of the worker's mask-time histogram, 0s when it has none."""
    try:
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    except OSError:
        return 0.0, 0.0
    total = re.search(r"^meshllm[:_]\w*structured_mask\w*_sum\{[^}]*\} (\S+)$", text, re.M)
    count = re.search(r"^meshllm[:_]\w*structured_mask\w*_count\{[^}]*\} (\S+)$", text, re.M)
    return (float(total.group(1)) if total else 0.0), (float(count.group(1)) if count else 0.0)


def main() -> int:
    import jsonschema
    from openai import OpenAI

    from services.cli.launcher import Mesh, MeshConfig, free_port
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--requests", type=int, default=32, help="requests per run, at least the run's concurrency")
    ap.add_argument("--max-tokens", type=int, default=96)
    a = ap.parse_args()
    if a.model_dir is None:
        from services.models import prepare_model
        a.model_dir = str(prepare_model("smollm2"))
    cfg = MeshConfig(model_dir=a.model_dir, port=free_port(), grpc_port=free_port(), max_model_len=2048,
                     max_num_seqs=max(32, max(a.concurrency)))
    mesh = Mesh(cfg)
    mesh.start()
    rows, invalid = [], 0
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{cfg.port}/v1", api_key="x", timeout=600)
        model = cfg.served_model_name
        worker_metrics = mesh.metrics_url("worker")   # the launcher's port map (/metrics of the worker)
        run_load(client, model, 2, 4, 16, True)   # warm-up (and the tokenizer of the grammar engine)
        for conc in a.concurrency:
            for constrained in (False, True, False, True):  # interleaved: drift weighs on both
                before = mask_seconds(worker_metrics) if worker_metrics else (0.0, 0.0)
                n, wall, outs = run_load(client, model, conc, max(a.requests, conc), a.max_tokens, constrained)
                after = mask_seconds(worker_metrics) if worker_metrics else (0.0, 0.0)
                if constrained:
                    for text in outs:
                        try:
                            jsonschema.validate(json.loads(text), SCHEMA)
                        except (ValueError, jsonschema.ValidationError):
                            invalid += 1   # a max_tokens cut leaves incomplete JSON
                rows.append({"concurrency": conc, "constrained": constrained, "output_tokens": n,
                             "wall_s": wall, "output_tok_s": n / wall,
                             "mask_ms_per_token": ((after[0] - before[0]) / (after[1] - before[1]) * 1e3
                                                   if after[1] > before[1] else None)})
                print(rows[-1], flush=True)
    finally:
        mesh.stop()
    summary = {}
    for conc in a.concurrency:
        free = [r["output_tok_s"] for r in rows if r["concurrency"] == conc and not r["constrained"]]
        cons = [r["output_tok_s"] for r in rows if r["concurrency"] == conc and r["constrained"]]
        summary[str(conc)] = {"unconstrained_tok_s": sum(free) / len(free), "json_schema_tok_s": sum(cons) / len(cons),
                              "ratio_constrained_over_free": (sum(cons) / len(cons)) / (sum(free) / len(free))}
    res = {"schema": 1, "bench": "structured_outputs", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg": os.getloadavg()},
           "model_dir": a.model_dir, "max_tokens": a.max_tokens, "requests_per_run": a.requests,
           "schema_used": SCHEMA, "runs": rows, "summary": summary, "invalid_outputs": invalid}
    out = ROOT / "bench" / "results" / "structured_outputs.json"
    out.write_text(json.dumps(res, indent=2))
    for conc, s in summary.items():
        print(f"concurrency {conc:>3}: unconstrained {s['unconstrained_tok_s']:7.1f} tok/s, json_schema "
              f"{s['json_schema_tok_s']:7.1f} tok/s, ratio {s['ratio_constrained_over_free']:.3f}")
    print(f"outputs that did not validate (max_tokens cuts): {invalid}; wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

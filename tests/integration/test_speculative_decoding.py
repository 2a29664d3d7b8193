"""Speculative decoding through the whole mesh (`--speculative-config`, n-gram prompt lookup):
the same greedy and seeded outputs as the shared mesh without it, whole, streamed, n=2 and 16 at
once; a prompt that asks to repeat a passage gets most drafts accepted (the worker's metrics); a
bad configuration stops `meshllm serve` before any process starts."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import sys

import httpx
import pytest
from openai import OpenAI

from tests.integration.meshproc import ROOT, start_mesh

# A fixed K (the dynamic_k table): whether the cost model speculates depends on step times, which
# a shared 2-core CI machine makes noisy; the model's choices are tested in tests/unit.
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                   "dynamic_k": [[1, 1024, 4]]})
PASSAGE = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
           "single step. All that glitters is not gold.")
REPEAT = [{"role": "user", "content": f"Repeat this text exactly, nothing else: {PASSAGE}"}]


@pytest.fixture(scope="module")
def spec_mesh(smollm2_dir):
    m = start_mesh(str(smollm2_dir), "--max-model-len", "1024", "--max-num-seqs", "32", "--speculative-config", SPEC)
    yield m
    assert m.stop() == 0


def client_of(m) -> OpenAI:
    return OpenAI(base_url=f"{m.http_url}/v1", api_key="unused", timeout=120, max_retries=0)


def counter(m, name: str) -> float:
    text = httpx.get(f"http://{m.services()['worker-metrics']}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def chat(m, messages, **kw):
    return client_of(m).chat.completions.create(model=m.model_name, messages=messages, **kw)


def test_a_repeated_passage_is_mostly_accepted_and_the_text_is_unchanged(spec_mesh, mesh):
    before = (counter(spec_mesh, "meshllm:worker_spec_draft_tokens_total"),
              counter(spec_mesh, "meshllm:worker_spec_accepted_tokens_total"))
    got = chat(spec_mesh, REPEAT, max_tokens=64, temperature=0).choices[0].message.content
    want = chat(mesh, REPEAT, max_tokens=64, temperature=0).choices[0].message.content
    assert got == want
    drafted = counter(spec_mesh, "meshllm:worker_spec_draft_tokens_total") - before[0]
    accepted = counter(spec_mesh, "meshllm:worker_spec_accepted_tokens_total") - before[1]
    assert drafted > 0 and accepted / drafted > 0.5, (drafted, accepted)


def test_seeded_n2_and_streamed_outputs_equal_plain_decoding(spec_mesh, mesh):
    kw = dict(max_tokens=48, temperature=0.9, seed=1234, n=2)
    got = [c.message.content for c in chat(spec_mesh, REPEAT, **kw).choices]
    want = [c.message.content for c in chat(mesh, REPEAT, **kw).choices]
    assert got == want
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(spec_mesh, REPEAT, max_tokens=48,
                                                                      temperature=0, stream=True) if c.choices)
    assert streamed == chat(mesh, REPEAT, max_tokens=48, temperature=0).choices[0].message.content


def test_sixteen_concurrent_requests_equal_plain_decoding(spec_mesh, mesh):
    prompts = [[{"role": "user", "content": f"Repeat: {PASSAGE[: 40 + 5 * i]}"}] for i in range(16)]

    def outputs(m):
        with cf.ThreadPoolExecutor(16) as pool:
            return list(pool.map(lambda p: chat(m, p, max_tokens=32, temperature=0).choices[0].message.content,
                                 prompts))
    assert outputs(spec_mesh) == outputs(mesh)


@pytest.mark.parametrize("cfg, says", [
    ('{"method": "eagle9", "num_speculative_tokens": 3}', "method must be one of"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens must be an integer in [1, 16]"),
    ("{not json", "not valid JSON"),
])
def test_a_bad_speculative_config_stops_meshllm_serve_at_once(smollm2_dir, cfg, says):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHLLM_")}
    run = subprocess.run([sys.executable, "-c", "import sys; from services.cli.main import main; sys.exit(main())",
                          "serve", str(smollm2_dir), "--port", "0", "--grpc-port", "0", "--speculative-config", cfg],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and says in run.stderr, run.stderr[-2000:]


def test_structured_outputs_validate_with_speculation(spec_mesh):
    """The schema battery on the speculating mesh: drafts are checked against each grammar and
    masks apply to every verified row, so constrained outputs still parse and validate."""
    from tests.integration import structured_battery as battery
    client = client_of(spec_mesh)
    for name in ("nested", "ranges"):
        assert battery.run_whole(client, spec_mesh.model_name, name) == 2
    assert battery.run_streamed(client, spec_mesh.model_name, "array") == 2

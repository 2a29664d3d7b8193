"""Prefill/decode disaggregation on a real mesh (docs/pd.md): `meshllm serve --prefill-replicas 1
--decode-replicas 1` (SmolLM2), compared token for token with the colocated session mesh (same
weights). The prefill engine streams the first token; the decode engine gets the prompt's blocks
(the client sees it in cached_tokens) and streams the rest. Both hand-off paths: direct (the
decode worker copies the blocks out of the prefill worker's mapped cache; the default) and
through the kvstore (`--kv-handoff kvstore`). Then the failures: the decode side too late for
its lease (the prefill engine frees the blocks, the decode engine recomputes), the kvstore
killed, the prefill engine killed during a long prefill, a client leaving mid-hand-off (both
engines end idle)."""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import time

import grpc
import httpx
import pytest

from services.common import pb
from tests.integration.meshproc import service_name, start_mesh, stop_checked
from tests.integration.otlp_receiver import OtlpReceiver, prompt_export
from tests.integration.test_kv_tiers import passage
from tests.integration.test_supervisor_failures import replicas, wait_recovered


LEASE_S = 8


def _pd_mesh(smollm2_dir, *extra):
    m = start_mesh(str(smollm2_dir), "--prefill-replicas", "1", "--decode-replicas", "1", "--max-model-len", "2048",
                   "--max-num-seqs", "32", *extra)
    m.seen = set(m.service_pids())
    return m


def _warm(m) -> None:
    """Until a first hand-off carried blocks (on a busy machine the engines' first steps and the
    first mapping of a peer are slow)."""
    deadline = time.monotonic() + 60
    while complete(m, passage(99, 40))["usage"]["prompt_tokens_details"]["cached_tokens"] == 0:
        assert time.monotonic() < deadline, "no hand-off carried blocks"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def pd(smollm2_dir):
    """Also traced (a real OTLP receiver) and with the hermes tool-call parser."""
    rx = OtlpReceiver()
    with prompt_export():
        m = _pd_mesh(smollm2_dir, "--kv-lease-s", str(LEASE_S), "--otlp-traces-endpoint", rx.endpoint,
                     "--tool-call-parser", "hermes")
    m.otlp = rx
    try:
        _warm(m)
        yield m
        stop_checked(m, m.seen)
    finally:
        rx.close()


@pytest.fixture(scope="module")
def pd_kvstore(smollm2_dir):
    """With the deepseek_r1 reasoning parser (chat only; the completions tests see no change)."""
    m = _pd_mesh(smollm2_dir, "--kv-handoff", "kvstore", "--reasoning-parser", "deepseek_r1")
    _warm(m)   # also: the workers' kvstore clients may have tried the store before it was up
    yield m
    stop_checked(m, m.seen)


def complete(m, prompt: str, **extra) -> dict:
    body = {"model": m.model_name, "prompt": prompt, "max_tokens": 10, "temperature": 0, "return_token_ids": True,
            **extra}
    r = httpx.post(f"{m.http_url}/v1/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


def on_both(pd, mesh, fn):
    """(fn(pd), fn(mesh)), the two meshes working at once (each sees one request at a time)."""
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        got, want = ex.submit(fn, pd), ex.submit(fn, mesh)
        return got.result(), want.result()


def metric_urls(m) -> list[tuple[str, str]]:
    """(service name, /metrics url) from the launcher's services line."""
    log = open(m.log_path).read()
    return [(name, f"http://{addr}/metrics") for name, addr in
            re.findall(r" ([\w-]+)-metrics=(127\.0\.0\.1:\d+)", log)]


def ids(body: dict, i: int = 0) -> list[int]:
    return body["choices"][i]["token_ids"]


def load(m, replica: str) -> "pb.engine.LoadInfo":
    with grpc.insecure_channel(replicas(m)[replica].addr) as ch:
        return pb.engine_grpc.EngineStub(ch).GetLoad(pb.engine.GetLoadRequest(), timeout=10)


def test_the_replicas_have_roles(pd):
    rs = replicas(pd)
    assert (rs["engine-0"].role, rs["engine-1"].role) == ("prefill", "decode")
    want = ['meshllm:engine_replica_role{replica="engine-0",role="prefill"} 1.0',
            'meshllm:engine_replica_role{replica="engine-1",role="decode"} 1.0']
    deadline = time.monotonic() + 30
    while not all(w in (text := httpx.get(f"{pd.http_url}/metrics", timeout=10).text) for w in want):
        assert time.monotonic() < deadline, text[-400:]
        time.sleep(0.3)


def handoffs(m, outcome: str) -> float:
    text = httpx.get(f"{m.http_url}/metrics", timeout=10).text
    found = re.search(rf'^meshllm:gateway_pd_handoffs_total{{outcome="{outcome}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def check_handed_over(m, mesh, path: str, seed: int) -> None:
    before = handoffs(m, path)
    prompts = [passage(seed + i, 60 + 25 * i) for i in range(5)]
    with concurrent.futures.ThreadPoolExecutor(10) as ex:   # the five at once, on both meshes
        pairs = [(ex.submit(complete, m, p), ex.submit(complete, mesh, p)) for p in prompts]
        for got, want in ((g.result(), w.result()) for g, w in pairs):
            assert ids(got) == ids(want)
            n = got["usage"]["prompt_tokens"]
            # The decode engine got every full block: it computed only the last partial one.
            assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16, got["usage"]
    assert handoffs(m, path) - before == 5
    # Bytes moved, on the decode engine's worker (the tier metrics, tier="direct" or "kvstore").
    worker = [u for u in metric_urls(m) if "worker-1" in u[0]]
    tier = "direct" if path == "direct" else "kvstore"
    moved = httpx.get(worker[0][1], timeout=10).text
    loads = [float(v) for labels, v in re.findall(r'^meshllm:kv_tier_bytes_total\{([^}]*)\} (\S+)$', moved, re.M)
             if f'tier="{tier}"' in labels and 'direction="load"' in labels]
    assert loads and loads[0] > 0, moved[-800:]


def test_greedy_outputs_match_a_colocated_mesh_and_the_kv_was_handed_over_directly(pd, mesh):
    check_handed_over(pd, mesh, "direct", 200)


def test_eight_concurrent_requests_match_the_colocated_mesh(pd, mesh):
    prompts = [passage(300 + i, 40 + 15 * i) for i in range(8)]   # 40 to 145 words
    with concurrent.futures.ThreadPoolExecutor(2 * len(prompts)) as ex:   # the colocated mesh batches them too
        got = [ex.submit(lambda p=p: ids(complete(pd, p))) for p in prompts]
        want = [ex.submit(lambda p=p: ids(complete(mesh, p))) for p in prompts]
        assert [f.result() for f in got] == [f.result() for f in want]


def test_seeded_sampling_logprobs_n_and_stop_strings_match(pd, mesh):
    p = passage(400, 80)
    # The logprobs alone on each mesh (rounded to 3 places: the same batch shapes on both);
    # the token comparisons then all at once (batched greedy == solo; a seed is per request).
    lp_pd, lp_co = on_both(pd, mesh, lambda m: complete(m, p, logprobs=2))
    a, b = lp_pd["choices"][0]["logprobs"], lp_co["choices"][0]["logprobs"]
    assert a["tokens"] == b["tokens"]
    assert [round(x, 3) for x in a["token_logprobs"]] == [round(x, 3) for x in b["token_logprobs"]]
    seeded = {"temperature": 0.9, "seed": 1234, "max_tokens": 12}
    penalized = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.3, "max_tokens": 16}
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        pairs = {name: (ex.submit(complete, pd, p, **kw), ex.submit(complete, mesh, p, **kw))
                 for name, kw in (("seeded", seeded), ("penalized", penalized))}
        three = ex.submit(complete, pd, p, n=3, temperature=0.8, seed=5)
        full = ex.submit(complete, mesh, p, max_tokens=10)
        for name, (got, want) in pairs.items():
            assert ids(got.result()) == ids(want.result()), name
        full, three = full.result()["choices"][0]["text"], three.result()
    assert len(three["choices"]) == 3 and all(len(ids(three, i)) == 10 for i in range(3))
    stop = full.strip().split()[1] if len(full.strip().split()) > 1 else full[:3]
    cut = complete(pd, p, stop=[stop])
    assert cut["choices"][0]["finish_reason"] == "stop" and stop not in cut["choices"][0]["text"]


def test_structured_output_continues_its_grammar_on_the_decode_engine(pd, mesh):
    """The decode engine's grammar matcher starts from the prefill engine's first token (resume
    tokens): the JSON is valid and identical to the colocated mesh's."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    body = {"messages": [{"role": "user", "content": passage(450, 60) + " Describe a person as JSON."}],
            "max_tokens": 64, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}
    def content(m) -> str:
        r = httpx.post(f"{m.http_url}/v1/chat/completions", json={"model": m.model_name, **body}, timeout=180)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    outs = on_both(pd, mesh, content)
    assert outs[0] == outs[1]
    person = json.loads(outs[0])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


def test_one_trace_holds_the_prefill_the_hand_off_and_the_decode(pd):
    out = complete(pd, passage(520, 90))
    rid = out["id"]

    def done(spans) -> bool:
        mine = [s for s in spans if s.attributes.get("meshllm.request_id") == rid]
        names = [s.name for s in mine]
        if names.count("scheduler.request") < 2 or "gateway.kv_handoff" not in names:
            return False
        trace = [s for s in spans if s.trace_id == mine[0].trace_id]
        return "kv.load" in {s.name for s in trace} and any(s.parent_span_id == "" for s in trace)
    pd.otlp.wait_for(done, 30)
    tid = next(s.trace_id for s in pd.otlp.spans if s.attributes.get("meshllm.request_id") == rid)
    spans = pd.otlp.trace(tid)
    [root] = [s for s in spans if s.parent_span_id == ""]
    assert root.service == "meshllm-gateway"
    [handoff] = [s for s in spans if s.name == "gateway.kv_handoff"]
    scheds = sorted((s for s in spans if s.name == "scheduler.request"), key=lambda s: s.start_ns)
    assert len(scheds) == 2 and all(s.parent_span_id == root.span_id for s in scheds)
    prefill, decode = scheds
    by_parent = {}
    for s in spans:
        by_parent.setdefault(s.parent_span_id, set()).add(s.name)
    assert "worker.prefill" in by_parent[prefill.span_id] and "kv.load" in by_parent[decode.span_id]
    [kv_load] = [s for s in spans if s.name == "kv.load" and s.parent_span_id == decode.span_id]
    n = out["usage"]["prompt_tokens"]
    assert kv_load.attributes["meshllm.kv.blocks_loaded"] == (n - 1) // 16
    # The hand-off: under the request's root, from the prefill engine's end to the decode
    # engine's first output, with what was moved and how.
    assert handoff.parent_span_id == root.span_id
    assert handoff.attributes["meshllm.kv.handoff_outcome"] == "direct"
    assert handoff.attributes["meshllm.kv.blocks"] == (n - 1) // 16
    assert (handoff.attributes["meshllm.prefill_replica"], handoff.attributes["meshllm.decode_replica"]) == (
        "engine-0", "engine-1")
    assert prefill.start_ns <= handoff.start_ns <= decode.start_ns <= handoff.end_ns <= root.end_ns


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SHOT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL_MESSAGES = [
    {"role": "system", "content": "You call tools. To get weather, answer ONLY with a tool call like:\n" + SHOT},
    {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": SHOT},
    {"role": "user", "content": "Weather in Paris?"}]


def test_the_tool_call_parser_works_across_the_hand_off(pd):
    """The call's first token comes from the prefill engine, the rest from the decode engine."""
    body = {"model": pd.model_name, "messages": TOOL_MESSAGES, "tools": TOOLS, "max_tokens": 40, "temperature": 0}

    def streamed() -> tuple[str, str]:
        name = args = ""
        with httpx.stream("POST", f"{pd.http_url}/v1/chat/completions", json={**body, "stream": True},
                          timeout=180) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        for tc in c["delta"].get("tool_calls") or []:
                            name += tc.get("function", {}).get("name") or ""
                            args += tc.get("function", {}).get("arguments") or ""
        return name, args
    with concurrent.futures.ThreadPoolExecutor(2) as ex:   # whole and streamed at once (batched greedy == solo)
        stream = ex.submit(streamed)
        whole = ex.submit(lambda: httpx.post(f"{pd.http_url}/v1/chat/completions", json=body, timeout=180).json())
        whole, (name, args) = whole.result(), stream.result()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] > 0   # it was handed over
    assert name == "get_weather" and json.loads(args) == {"city": "Paris"}


def test_timing_has_the_kv_transfer_and_clients_cannot_pass_transfer_parameters(pd):
    body = complete(pd, passage(500, 120), return_timing=True)
    timing = body["timing"]
    assert timing["kv_transfer_ms"] > 0 and timing["prefill_ms"] > 0
    r = httpx.post(f"{pd.http_url}/v1/completions", timeout=30, json={
        "model": pd.model_name, "prompt": "hi", "max_tokens": 3,
        "kv_transfer_params": {"remote_engine_id": "engine-1", "remote_block_ids": [1, 2]}})
    assert r.status_code == 400 and "kv_transfer_params" in r.text


def test_a_client_leaving_during_the_hand_off_leaves_both_engines_idle(pd):
    body = {"model": pd.model_name, "prompt": passage(600, 300), "max_tokens": 200, "stream": True}
    with httpx.Client(timeout=120) as c, c.stream("POST", f"{pd.http_url}/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                break   # the first token: the hand-off is under way; leave
    deadline = time.monotonic() + 30
    while True:
        loads = [load(pd, e) for e in ("engine-0", "engine-1")]
        if all(x.num_running == 0 and x.num_waiting == 0 and x.kv_usage == 0.0 for x in loads):
            break
        assert time.monotonic() < deadline, loads
        time.sleep(0.2)


def direct_failed(m, then: str) -> float:
    """The decode engine's scheduler: direct hand-offs that did not arrive, by what followed."""
    [url] = [u for name, u in metric_urls(m) if name == "scheduler-1"]
    text = httpx.get(url, timeout=10).text
    return sum(float(v) for labels, v in re.findall(r'^meshllm:kv_handoff_direct_failed_total\{([^}]*)\} (\S+)$',
                                                    text, re.M) if f'then="{then}"' in labels)


def test_a_decode_engine_too_late_for_its_lease_loads_from_the_kvstore_and_the_blocks_are_freed(pd, mesh):
    p = passage(650, 200)
    before = direct_failed(pd, "kvstore")
    decode = replicas(pd)["engine-1"]
    worker = next(pid for pid in decode.pids if service_name(pid) == "worker")
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        want = ex.submit(complete, mesh, p)   # the colocated mesh's answer meanwhile
        os.kill(worker, signal.SIGSTOP)   # the decode engine plans the copy; its worker runs it too late
        try:
            fut = ex.submit(complete, pd, p)
            deadline = time.monotonic() + 30
            while load(pd, "engine-0").kv_usage == 0.0:   # the prefill engine holds the blocks ...
                assert time.monotonic() < deadline, "no hand-off was held"
                time.sleep(0.1)
            while load(pd, "engine-0").kv_usage > 0.0:    # ... until its lease expires
                assert time.monotonic() < deadline, "the lease never expired"
                time.sleep(0.2)
        finally:
            os.kill(worker, signal.SIGCONT)
        got, want = fut.result(timeout=120), ids(want.result(timeout=120))
    assert ids(got) == want
    # The copy was refused (too late): the decode engine looked the prompt up in the kvstore,
    # where the prefill engine had saved its full blocks, and computed only the last one.
    n = got["usage"]["prompt_tokens"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
    assert direct_failed(pd, "kvstore") - before == 1


def test_the_prefill_engine_killed_during_a_long_prefill_still_completes(pd, mesh):
    p = passage(800, 700)             # ~700 tokens: its prefill takes over a second on the CPU
    want = ids(complete(mesh, p))
    engine = replicas(pd)["engine-0"]
    worker = next(pid for pid in engine.pids if service_name(pid) == "worker")
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(complete, pd, p)
        deadline = time.monotonic() + 30
        while load(pd, "engine-0").num_running == 0:   # the prefill is under way
            assert time.monotonic() < deadline and not fut.done(), "the prefill engine never ran it"
            time.sleep(0.02)
        os.kill(worker, signal.SIGKILL)
        got = fut.result(timeout=180)
    assert ids(got) == want
    wait_recovered(pd, "engine-0", engine.restarts)
    pd.seen |= set(pd.service_pids())


def test_greedy_outputs_match_through_the_kvstore(pd_kvstore, mesh):
    check_handed_over(pd_kvstore, mesh, "kvstore", 250)


def test_the_kvstore_killed_makes_the_decode_engine_recompute_with_the_same_output(pd_kvstore, mesh):
    kv = replicas(pd_kvstore)["kvstore-0"]
    os.kill(kv.pids[0], signal.SIGKILL)
    prompts = [passage(700 + i, 90) for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(2 * len(prompts)) as ex:   # all at once: batched greedy == solo
        outs = [(ex.submit(complete, pd_kvstore, p), ex.submit(complete, mesh, p)) for p in prompts]
        for got, want in outs:
            assert ids(got.result()) == ids(want.result())
    wait_recovered(pd_kvstore, "kvstore-0", kv.restarts)
    pd_kvstore.seen |= set(pd_kvstore.service_pids())


def test_the_reasoning_parser_works_across_the_hand_off(pd_kvstore, mesh):
    """deepseek_r1 without a closing </think>: everything is reasoning, whole and streamed, and
    it is the text the colocated mesh generates for the same prompt."""
    body = {"messages": [{"role": "user", "content": passage(900, 40) + " Hello"}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    def chat(m) -> dict:
        return httpx.post(f"{m.http_url}/v1/chat/completions", json={"model": m.model_name, **body},
                          timeout=180).json()
    whole, want = on_both(pd_kvstore, mesh, chat)
    want = want["choices"][0]["message"]["content"]
    msg = whole["choices"][0]["message"]
    assert msg["reasoning_content"] and msg["content"] in ("", None)
    assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert msg["reasoning_content"] == want
    streamed = ""
    with httpx.stream("POST", f"{pd_kvstore.http_url}/v1/chat/completions",
                      json={"model": pd_kvstore.model_name, **body, "stream": True}, timeout=180) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed += c["delta"].get("reasoning_content") or ""
                    assert not c["delta"].get("content")
    assert streamed == want

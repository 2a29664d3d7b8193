"""The tokenizer service over a real socket: all four RPCs, bad input, health, and the
`python -m services.tokenizer` process (listening line, readiness, clean SIGTERM)."""
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2 as hpb
from grpc_health.v1 import health_pb2_grpc as hpb_grpc

from services.common import pb
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.server import build_server, load_core
from services.tokenizer.testing import write_tiny_tokenizer_dir

REPO = Path(__file__).resolve().parents[2]
MAX_TEXTS = 8
MAX_DETOK = 3


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(address, core): an in-process server on its own event loop thread."""
    config = TokenizerConfig(model=str(write_tiny_tokenizer_dir(tmp_path_factory.mktemp("tok"))),
                             port=0, max_batch_texts=MAX_TEXTS, max_text_chars=50_000,
                             max_detokenize_requests=MAX_DETOK)
    core = load_core(config)
    executor = ThreadPoolExecutor(2)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        server, health, port = build_server(core, config, executor)
        await server.start()
        health.set_ready(True)
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield f"127.0.0.1:{port}", core
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
        executor.shutdown()


@pytest.fixture
def stub(served):
    with grpc.insecure_channel(served[0]) as ch:
        yield pb.tokenizer_grpc.TokenizerStub(ch)


def _msg(role, content):
    return pb.common.ChatMessage(role=role, content=content)


def test_readiness_reports_serving(served):
    with grpc.insecure_channel(served[0]) as ch:
        resp = hpb_grpc.HealthStub(ch).Check(hpb.HealthCheckRequest(service="tokenizer"), timeout=5)
    assert resp.status == hpb.HealthCheckResponse.SERVING


def test_encode_returns_ids_per_text_in_order(served, stub):
    core = served[1]
    texts = ["Hello world", "Café 😀", "", "y" * 20_000]   # the last one goes through the pool
    resp = stub.Encode(pb.tokenizer.EncodeRequest(texts=texts, add_special_tokens=True), timeout=10)
    assert [list(r.ids) for r in resp.results] == core.encode_batch(texts, True)
    assert core.decode(resp.results[1].ids, False) == "Café 😀"


def test_encode_empty_batch_is_ok(stub):
    assert len(stub.Encode(pb.tokenizer.EncodeRequest(texts=[]), timeout=5).results) == 0


@pytest.mark.parametrize("texts, match", [
    (["a"] * (MAX_TEXTS + 1), "too many texts"),
    (["z" * 50_001], "text too long"),
])
def test_encode_over_the_limits_is_invalid_argument(stub, texts, match):
    with pytest.raises(grpc.RpcError) as err:
        stub.Encode(pb.tokenizer.EncodeRequest(texts=texts), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert match in err.value.details()


def test_apply_chat_template_renders_and_tokenizes(served, stub):
    core = served[1]
    resp = stub.ApplyChatTemplate(pb.tokenizer.ChatTemplateRequest(
        messages=[_msg("system", "Be brief."), _msg("user", "Hi 😀")],
        add_generation_prompt=True, tokenize=True), timeout=5)
    assert resp.text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>\n"
                         "<|im_start|>assistant\n")
    assert list(resp.token_ids) == core.encode_batch([resp.text], False)[0]
    assert resp.token_ids[0] == core.tokenizer.token_to_id("<|im_start|>")


def test_apply_chat_template_continues_final_message_without_tokens_unless_asked(stub):
    resp = stub.ApplyChatTemplate(pb.tokenizer.ChatTemplateRequest(
        messages=[_msg("user", "Count"), _msg("assistant", "One, two,")],
        continue_final_message=True), timeout=5)
    assert resp.text.endswith("<|im_start|>assistant\nOne, two,")
    assert len(resp.token_ids) == 0


@pytest.mark.parametrize("request_kwargs, match", [
    ({"messages": [_msg("wizard", "hi")]}, "role must be one of"),
    ({"messages": []}, "must not be empty"),
    ({"messages": [_msg("assistant", "x")], "add_generation_prompt": True,
      "continue_final_message": True}, "cannot both be set"),
])
def test_bad_chat_requests_are_invalid_argument(stub, request_kwargs, match):
    with pytest.raises(grpc.RpcError) as err:
        stub.ApplyChatTemplate(pb.tokenizer.ChatTemplateRequest(**request_kwargs), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert match in err.value.details()


def test_detokenize_answers_each_step_in_order_and_deltas_add_up(served, stub):
    core = served[1]
    a_ids = core.encode_batch(["Hello 😀 world"], False)[0]
    b_ids = core.encode_batch(["日本語 text"], False)[0]
    steps, n = [], max(len(a_ids), len(b_ids))
    for i in range(n):
        items = []
        for rid, ids in (("a", a_ids), ("b", b_ids)):
            if i < len(ids):
                items.append(pb.tokenizer.DetokenizeItem(request_id=rid, new_token_ids=[ids[i]],
                                                         finished=i == len(ids) - 1))
        steps.append(pb.tokenizer.DetokenizeRequest(items=items))
    steps.append(pb.tokenizer.DetokenizeRequest())    # an empty step still gets its answer
    responses = list(stub.Detokenize(iter(steps), timeout=10))
    assert len(responses) == len(steps)
    text = {"a": "", "b": ""}
    for req, resp in zip(steps, responses):
        assert [o.request_id for o in resp.outputs] == [it.request_id for it in req.items]
        for out in resp.outputs:
            text[out.request_id] += out.text_delta
    assert text == {"a": "Hello 😀 world", "b": "日本語 text"}


def test_detokenize_refuses_more_unfinished_requests_than_the_bound(stub):
    items = [pb.tokenizer.DetokenizeItem(request_id=f"r{i}", new_token_ids=[70]) for i in
             range(MAX_DETOK + 1)]
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Detokenize(iter([pb.tokenizer.DetokenizeRequest(items=items)]), timeout=5))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_detokenize_state_dies_with_the_stream(stub):
    """Unfinished requests of a closed stream do not count against a new stream's bound."""
    for _ in range(2):
        items = [pb.tokenizer.DetokenizeItem(request_id=f"r{i}", new_token_ids=[70])
                 for i in range(MAX_DETOK)]
        responses = list(stub.Detokenize(iter([pb.tokenizer.DetokenizeRequest(items=items)]),
                                         timeout=5))
        assert len(responses[0].outputs) == MAX_DETOK


@pytest.mark.parametrize("item", [
    pb.tokenizer.DetokenizeItem(request_id="", new_token_ids=[5]),
    pb.tokenizer.DetokenizeItem(request_id="neg", new_token_ids=[-3]),
], ids=["no_request_id", "negative_id"])
def test_detokenize_bad_items_are_invalid_argument(stub, item):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Detokenize(iter([pb.tokenizer.DetokenizeRequest(items=[item])]), timeout=5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_get_info_reports_the_model_dir(stub):
    info = stub.GetInfo(pb.tokenizer.TokenizerInfoRequest(), timeout=5)
    assert (info.vocab_size, info.bos_token_id, list(info.eos_token_ids)) == (400, 1, [2, 0])
    assert info.has_chat_template and info.model_max_length == 2048


def test_module_entry_point_serves_and_stops_on_sigterm(tmp_path):
    model = write_tiny_tokenizer_dir(tmp_path / "model")
    template = tmp_path / "t.jinja"
    template.write_text("T:{{ messages[-1].content }}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.tokenizer", "--model", str(model), "--host", "127.0.0.1",
         "--port", "0", "--chat-template", str(template)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        match = re.fullmatch(r"tokenizer listening on (127\.0\.0\.1:\d+)\n", line)
        assert match, line
        with grpc.insecure_channel(match.group(1)) as ch:
            health = hpb_grpc.HealthStub(ch).Check(hpb.HealthCheckRequest(service="tokenizer"),
                                                   timeout=5)
            assert health.status == hpb.HealthCheckResponse.SERVING
            resp = pb.tokenizer_grpc.TokenizerStub(ch).ApplyChatTemplate(
                pb.tokenizer.ChatTemplateRequest(messages=[_msg("user", "secret prompt")]), timeout=5)
            assert resp.text == "T:secret prompt"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert "secret prompt" not in proc.stderr.read(), "prompt text must not be logged"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_module_entry_point_rejects_a_dir_without_tokenizer(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "services.tokenizer", "--model", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "no tokenizer.json" in proc.stderr


def test_convert_ids_to_tokens_gives_vocabulary_strings_past_the_batch_limit(served, stub):
    core = served[1]
    ids = core.encode_batch(["Café 😀 is here " * 40], False)[0]
    assert len(ids) > MAX_TEXTS                 # not bounded by Decode's sequence count
    resp = stub.ConvertIdsToTokens(pb.tokenizer.IdsToTokensRequest(ids=ids), timeout=5)
    assert list(resp.tokens) == [core.tokenizer.id_to_token(i) for i in ids]
    assert "".join(resp.tokens) != core.decode(ids, False)   # byte-level pieces, not text
    with pytest.raises(grpc.RpcError) as err:
        stub.ConvertIdsToTokens(pb.tokenizer.IdsToTokensRequest(ids=[core.vocab_size]), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_get_config_shows_the_template_in_use_and_the_config(served, stub):
    resp = stub.GetConfig(pb.tokenizer.TokenizerConfigRequest(), timeout=5)
    assert resp.chat_template == served[1].chat_template.source
    assert json.loads(resp.config_json)["eos_token"] == "<|im_end|>"
    assert resp.tokenizer_class == "PreTrainedTokenizerFast"

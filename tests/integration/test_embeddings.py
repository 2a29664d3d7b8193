"""/v1/embeddings and gRPC Embed through the real mesh (gateway -> embedder serving the real
all-MiniLM-L6-v2), checked against transformers' mean-pooled, normalised outputs."""
from __future__ import annotations

import base64
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import pb
from tests.integration.meshproc import ROOT, free_port

MODEL = "all-minilm-l6-v2"
TEXTS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "naïve café, 日本語 and 🤖",
    "Embeddings map text to vectors so that similar meanings land close together. " * 4,
]


@pytest.fixture(scope="module")
def reference(minilm_dir):
    """sentence-transformers' recipe computed by transformers: mean over real tokens, L2 norm."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    model = AutoModel.from_pretrained(minilm_dir, dtype=torch.float32).eval()

    def embed(texts: list[str]) -> np.ndarray:
        batch = tok(texts, padding=True, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1).numpy()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield embed, tok
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(mesh):
    from openai import OpenAI
    return OpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def http(mesh):
    with httpx.Client(base_url=mesh.http_url, timeout=120) as c:
        yield c


def cosines(got, expected) -> np.ndarray:
    got = np.asarray(got, dtype=np.float64)
    return (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)


def vectors(data) -> list:
    """Embeddings as floats: the client hands back base64 strings as they are when asked
    for them explicitly (and decodes them itself when it chose base64 on its own)."""
    return [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4").tolist()
            if isinstance(d.embedding, str) else d.embedding for d in data]


@pytest.mark.parametrize("encoding_format", ["float", "base64", None])
def test_list_of_strings_matches_transformers(client, reference, encoding_format):
    embed, tok = reference
    kwargs = {"encoding_format": encoding_format} if encoding_format else {}
    r = client.embeddings.create(model=MODEL, input=TEXTS, **kwargs)
    assert r.model == MODEL and [d.index for d in r.data] == list(range(len(TEXTS)))
    assert isinstance(r.data[0].embedding, str) == (encoding_format == "base64")
    got = vectors(r.data)
    assert all(len(v) == 384 for v in got)
    assert cosines(got, embed(TEXTS)).min() >= 0.9999
    tokens = sum(len(tok(t)["input_ids"]) for t in TEXTS)
    assert r.usage.prompt_tokens == r.usage.total_tokens == tokens


def test_base64_is_little_endian_float32_of_the_float_vector(http):
    body = {"model": MODEL, "input": "hello world"}
    floats = http.post("/v1/embeddings", json={**body, "encoding_format": "float"}).json()
    b64 = http.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    raw = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    assert raw.tolist() == floats["data"][0]["embedding"]
    assert b64["object"] == "list" and b64["data"][0]["object"] == "embedding"


def test_single_string_and_default_model(http, reference):
    embed, _ = reference
    r = http.post("/v1/embeddings", json={"input": TEXTS[0]})   # no model: the embedding model
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL
    assert cosines([r.json()["data"][0]["embedding"]], embed(TEXTS[:1]))[0] >= 0.9999


def test_token_id_inputs_equal_their_text(client, reference):
    embed, tok = reference
    ids = [tok(t)["input_ids"] for t in TEXTS[:3]]
    one = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    many = client.embeddings.create(model=MODEL, input=ids, encoding_format="base64")
    expected = embed(TEXTS[:3])
    assert cosines([one.data[0].embedding], expected[:1])[0] >= 0.9999
    assert cosines(vectors(many.data), expected).min() >= 0.9999
    assert many.usage.prompt_tokens == sum(map(len, ids))


def test_concurrent_requests_get_the_same_vectors_as_solo_requests(client):
    def create(text):
        return client.embeddings.create(model=MODEL, input=text, encoding_format="float").data[0].embedding

    solo = np.array([create(t) for t in TEXTS])
    with ThreadPoolExecutor(len(TEXTS) * 2) as pool:   # batched together in the embedder
        together = np.array(list(pool.map(create, TEXTS * 2)))
    assert np.allclose(together, np.concatenate([solo, solo]), atol=1e-5)


def test_truncate_prompt_tokens_keeps_the_start_of_a_long_input(http, reference):
    embed, tok = reference
    long_text = "the weather is lovely today and " * 100
    r = http.post("/v1/embeddings", json={"model": MODEL, "input": long_text})
    assert r.status_code == 400 and "512" in r.json()["error"]["message"]
    r = http.post("/v1/embeddings", json={"model": MODEL, "input": long_text,
                                          "truncate_prompt_tokens": 64})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 64
    truncated = tok.decode(tok(long_text, truncation=True, max_length=64)["input_ids"][1:-1])
    assert cosines([r.json()["data"][0]["embedding"]], embed([truncated]))[0] >= 0.9999


@pytest.mark.parametrize("body, status, words", [
    ({"input": ""}, 400, ["empty"]),
    ({"input": []}, 400, ["empty"]),
    ({"input": [[]]}, 400, ["empty"]),
    ({"input": ["ok", 5]}, 400, ["not a mix"]),
    ({"input": {"text": "hi"}}, 400, ["input must be"]),
    ({"input": [101, 99999999, 102]}, 400, ["vocabulary"]),
    ({"input": [101, -3, 102]}, 400, ["negative"]),
    ({}, 400, ["input"]),
    ({"input": "hi", "dimensions": 128}, 400, ["dimensions", "384"]),
    ({"input": "hi", "encoding_format": "int8"}, 400, ["encoding_format"]),
    ({"input": "hi", "truncate_prompt_tokens": 1000}, 400, ["truncate_prompt_tokens"]),
    ({"input": ["x"] * 2049}, 400, ["too many inputs"]),
    ({"input": "hi", "model": "text-embedding-3-small"}, 404, ["does not exist", MODEL]),
    ({"input": "hi", "model": "smollm2-135m-instruct"}, 400, ["does not serve embeddings"]),
])
def test_bad_requests_get_a_clear_error_and_the_service_keeps_serving(http, body, status, words):
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    for w in words:
        assert w.lower() in message.lower(), message
    ok = http.post("/v1/embeddings", json={"model": MODEL, "input": "still here", "dimensions": 384})
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 384


def test_models_list_both_models(http, mesh):
    cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    assert set(cards) == {mesh.model_name, MODEL}
    assert cards[MODEL]["max_model_len"] == 512
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL


def test_grpc_embed_matches_http_and_validates_the_same(mesh, http, reference):
    _, tok = reference
    ids = tok(TEXTS[1])["input_ids"]
    with grpc.insecure_channel(mesh.grpc_addr) as ch:
        stub = pb.generation_grpc.GenerationStub(ch)
        resp = stub.Embed(pb.generation.EmbedRequest(model=MODEL, request_id="embed-1", inputs=[
            pb.generation.EmbedInput(text=TEXTS[0]),
            pb.generation.EmbedInput(token_ids=pb.common.TokenIds(ids=ids))]), timeout=60)
        assert resp.request_id == "embed-1" and resp.model == MODEL
        assert [e.index for e in resp.embeddings] == [0, 1]
        assert resp.usage.prompt_tokens == len(tok(TEXTS[0])["input_ids"]) + len(ids)
        want = http.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS[:2]}).json()["data"]
        got = [list(e.values) for e in resp.embeddings]
        assert np.allclose(got, [d["embedding"] for d in want], atol=1e-5)

        for bad, words in [
            (pb.generation.EmbedRequest(model=MODEL), "empty"),
            (pb.generation.EmbedRequest(inputs=[pb.generation.EmbedInput(text="hi")], dimensions=7),
             "dimensions"),
            (pb.generation.EmbedRequest(inputs=[pb.generation.EmbedInput(text="x " * 600)]), "512"),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                stub.Embed(bad, timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.Embed(pb.generation.EmbedRequest(model="nope", inputs=[
                pb.generation.EmbedInput(text="hi")]), timeout=60)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_embedder_reports_serving_over_grpc_health(mesh):
    with grpc.insecure_channel(mesh.services()["embedder"]) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "embedder"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_a_gateway_without_an_embedder_answers_404_model_not_found():
    # Nothing listens on the tokenizer and engine addresses: embeddings never need them.
    dead = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "services.gateway", "--port", "0", "--grpc-port", "0",
                             "--tokenizer-addr", dead, "--engine-addr", dead], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = None
        for line in proc.stdout:
            if line.startswith("gateway http listening on "):
                url = line.split()[-1]
                break
        assert url, "the gateway did not start"
        r = httpx.post(f"{url}/v1/embeddings", json={"input": "hi"}, timeout=30)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and "no embedding model" in err["message"]
    finally:
        proc.terminate()
        proc.wait(15)

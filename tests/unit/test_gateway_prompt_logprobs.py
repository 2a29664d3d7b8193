"""The gateway's prompt-logprob shapes (services/gateway/openai/prompt_logprobs.py) through the
choice builder, from engine PromptLogprob messages: vLLM's prompt_logprobs and completions echo
with logprobs, whole and streamed."""
from __future__ import annotations

import json

from services.common import pb
from services.gateway.clients.request_handle import Delta
from services.gateway.openai.choices import ChoiceBuilder, ChoiceSpec

PROMPT = [10, 11, 12]
STRINGS = {10: "Hel", 11: "lo", 12: " world", 13: "!", 14: "?", 20: " there"}


def plp(position: int, token_id: int, logprob: float, rank: int, top: list[tuple[int, float]]):
    return pb.common.PromptLogprob(position=position, token_id=token_id, logprob=logprob, rank=rank,
                                   top=[pb.common.TopLogprob(token_id=t, logprob=v) for t, v in top])


PROMPT_LPS = [plp(1, 11, -0.5, 1, [(11, -0.5), (13, -1.5)]),
              plp(2, 12, float("-inf"), 40, [(13, -0.125), (14, -2.0)])]   # its own token ruled out


def first_delta(**kw) -> Delta:
    lps = [pb.common.TokenLogprob(token_id=20, logprob=-0.25, top=[pb.common.TopLogprob(token_id=20, logprob=-0.25)])]
    return Delta(" there", [20], logprobs=lps, token_strings=dict(STRINGS), prompt_logprobs=list(PROMPT_LPS), **kw)


def last_delta() -> Delta:
    lps = [pb.common.TokenLogprob(token_id=13, logprob=-1.0, top=[pb.common.TopLogprob(token_id=13, logprob=-1.0)])]
    return Delta("!", [13], finish_reason="length", logprobs=lps, token_strings=dict(STRINGS))


def test_vllm_prompt_logprobs_hold_the_own_token_and_the_top_n_with_null_first():
    b = ChoiceBuilder(0, ChoiceSpec(chat=False, logprobs=False, prompt_logprobs=True), prompt_ids=PROMPT)
    b.add(first_delta())
    b.add(last_delta())
    out = b.whole()["prompt_logprobs"]
    assert out[0] is None and len(out) == len(PROMPT)
    assert out[1] == {"11": {"logprob": -0.5, "rank": 1, "decoded_token": "lo"},
                      "13": {"logprob": -1.5, "rank": 2, "decoded_token": "!"}}
    # not in the top 2: 3 entries; -inf clamped so the body stays JSON
    assert out[2] == {"12": {"logprob": -9999.0, "rank": 40, "decoded_token": " world"},
                      "13": {"logprob": -0.125, "rank": 1, "decoded_token": "!"},
                      "14": {"logprob": -2.0, "rank": 2, "decoded_token": "?"}}
    json.dumps(out, allow_nan=False)
    plain = ChoiceBuilder(0, ChoiceSpec(chat=False, logprobs=False), prompt_ids=PROMPT)
    plain.add(first_delta())
    assert plain.whole()["prompt_logprobs"] is None


def test_echo_with_logprobs_puts_the_prompt_first_whole_and_streamed():
    spec = ChoiceSpec(chat=False, logprobs=True, echo="Hello world", prompt_logprobs=True)
    whole = ChoiceBuilder(0, spec, prompt_ids=PROMPT)
    whole.add(first_delta())
    whole.add(last_delta())
    c = whole.whole()
    assert c["text"] == "Hello world there!"
    lp = c["logprobs"]
    assert lp["tokens"] == ["Hel", "lo", " world", " there", "!"]
    assert lp["token_logprobs"] == [None, -0.5, -9999.0, -0.25, -1.0]
    assert lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][2] == {"!": -0.125, "?": -2.0, " world": -9999.0}
    assert lp["text_offset"] == [0, 3, 5, 11, 17]

    streamed = ChoiceBuilder(0, spec, prompt_ids=PROMPT)
    assert streamed.opening() == []          # the echo waits for the prompt's logprobs
    chunks = streamed.stream(first_delta()) + streamed.stream(last_delta())
    assert "".join(ch["text"] for ch in chunks) == c["text"]
    assert chunks[0]["text"] == "Hello world there"
    merged = {k: [x for ch in chunks for x in ch["logprobs"][k]] for k in lp}
    assert merged == lp

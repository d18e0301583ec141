"""Issue 27 item 12: a logprob in a 200 response is a number, never null.

An impossible token (logprob -inf: the grammar mask or top-k/top-p ruled it out, yet it is among the
top-k alternatives) and NaN were serialised by pydantic as null; OpenAI reports -9999.0.
"""
from __future__ import annotations

import json
import math

import pytest

from cllm.outputs import TokenLogprob, TopLogprob
from cllm.server.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from tests.unit.fakes import ByteTokenizer

IMPOSSIBLE_LOGPROB = -9999.0  # what OpenAI reports for an impossible token


def _entry(token: str, logprob: float, *alts: tuple[str, float]) -> TokenLogprob:
    top = [TopLogprob(i, t, lp, list(t.encode())) for i, (t, lp) in enumerate(alts)]
    return TokenLogprob(0, token, logprob, list(token.encode()), top)


ENTRIES = [
    _entry("a", -0.5, ("a", -0.5), ("b", -math.inf), ("c", float("nan"))),
    _entry("b", -math.inf, ("b", -math.inf)),  # every alternative impossible (a fully masked row)
    _entry("c", 1e-9, ("c", 1e-9)),  # rounding past 0
]


def _numbers(values) -> bool:
    return all(isinstance(v, float) and math.isfinite(v) and v <= 0 for v in values)


def test_completion_logprobs_are_numbers():
    body = json.loads(completion_logprobs(ENTRIES).model_dump_json())
    assert _numbers(body["token_logprobs"])
    assert all(isinstance(top, dict) and _numbers(top.values()) for top in body["top_logprobs"])
    assert body["token_logprobs"][1] == IMPOSSIBLE_LOGPROB and body["top_logprobs"][0]["b"] == IMPOSSIBLE_LOGPROB
    assert body["top_logprobs"][0]["c"] == IMPOSSIBLE_LOGPROB and body["token_logprobs"][2] == 0.0


def test_chat_logprobs_are_numbers():
    body = json.loads(chat_logprobs(ENTRIES).model_dump_json())
    values = [e["logprob"] for e in body["content"]] + [t["logprob"] for e in body["content"] for t in e["top_logprobs"]]
    assert _numbers(values) and body["content"][1]["logprob"] == IMPOSSIBLE_LOGPROB


def test_echoed_prompt_logprobs_are_numbers_after_the_first_token():
    """The first prompt token has no context: null, as on OpenAI and vLLM. Every other entry is a
    number, and has a top_logprobs dict even with logprobs=0 (as output tokens do)."""
    tokenizer = ByteTokenizer()
    ids = [0, 1, 2]
    entries = [None, _entry("b", -math.inf, ("b", -math.inf)), _entry("c", -1.0)]
    for with_top in (True, False):
        body = json.loads(prompt_logprobs(entries, ids, tokenizer, with_top=with_top).model_dump_json())
        assert body["token_logprobs"][0] is None and body["top_logprobs"][0] is None
        assert _numbers(body["token_logprobs"][1:])
        assert all(isinstance(top, dict) and _numbers(top.values()) for top in body["top_logprobs"][1:])


def test_server_responses_carry_no_null_logprob():
    """End to end through the app: constrained rows (the grammar leaves one token per step, the other
    alternatives are -inf), streamed or not, and echoed prompts with logprobs=0."""
    import xgrammar  # noqa: F401 (the structured extra, which `make test` installs: missing is a failure, not a skip)
    from fastapi.testclient import TestClient

    import cllm
    from cllm.server.app import create_app
    from tests.unit.fakes import FakeBackend, fake_config

    config = fake_config()
    app = create_app(config, engine=cllm.AsyncLLM(backend=FakeBackend(slots=2), config=config))
    with TestClient(app, base_url="http://localhost") as client:
        for stream in (False, True):
            resp = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 4, "logprobs": 5, "stream": stream,
                                                        "guided_choice": ["abc"]})
            assert resp.status_code == 200 and "null" not in _logprob_parts(resp.text), resp.text[:2000]
            resp = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "a"}], "max_tokens": 4, "logprobs": True, "top_logprobs": 5,
                "stream": stream, "guided_choice": ["abc"]})
            assert resp.status_code == 200 and "null" not in _logprob_parts(resp.text), resp.text[:2000]
        # echo with logprobs=0: every echoed token after the first has a number and a top_logprobs
        # dict (it was null for all of them), as the output tokens do.
        resp = client.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 2, "logprobs": 0, "echo": True})
        assert resp.status_code == 200, resp.text
        lp = resp.json()["choices"][0]["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # no context (as OpenAI)
        assert _numbers(lp["token_logprobs"][1:]) and len(lp["token_logprobs"]) == 6
        assert all(isinstance(top, dict) and _numbers(top.values()) for top in lp["top_logprobs"][1:]), lp


def _logprob_parts(body: str) -> str:
    """The logprob values of a response (plain or SSE), as JSON text."""
    values = []
    for line in body.splitlines() if body.startswith("data:") else [body]:
        text = line.removeprefix("data: ").strip()
        if not text or text == "[DONE]":
            continue
        for choice in json.loads(text).get("choices", []):
            lp = choice.get("logprobs")
            if isinstance(lp, dict) and "content" in lp:
                values += [e["logprob"] for e in lp["content"] or []]
                values += [t["logprob"] for e in lp["content"] or [] for t in e["top_logprobs"]]
            elif isinstance(lp, dict):
                values += lp["token_logprobs"] + [v for top in lp["top_logprobs"] for v in (top or {}).values()]
    assert values
    return json.dumps(values)

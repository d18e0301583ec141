"""The OpenAI-compatible server, end to end: a real `cllm serve` process on the embedded model,
driven by the official `openai` client and raw httpx."""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

# The fixtures are imported so pytest finds them in this module.
from tests.integration.conftest_server import ServerProcess, server, small_server, start_server  # noqa: F401

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


# ---- helpers ---------------------------------------------------------------------------


def sse_events(lines: list[str]) -> list[Any]:
    """Parsed ``data:`` payloads of an SSE body; "[DONE]" stays a string."""
    events: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def stream_events(srv: ServerProcess, path: str, body: dict[str, Any]) -> list[Any]:
    with srv.http() as client, client.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        return sse_events(list(resp.iter_lines()))


def engine_state(srv: ServerProcess) -> dict[str, Any]:
    with srv.http() as client:
        resp = client.get("/v1/engine")
        assert resp.status_code == 200, resp.text
        return resp.json()


def wait_idle(srv: ServerProcess, timeout_s: float = 5.0) -> dict[str, Any]:
    """Poll /v1/engine until nothing runs or waits; the state seen last."""
    deadline = time.monotonic() + timeout_s
    state = engine_state(srv)
    while time.monotonic() < deadline:
        stats = state["stats"]
        if not state["running"] and stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["slots_in_use"] == 0:
            return state
        time.sleep(0.05)
        state = engine_state(srv)
    raise AssertionError(f"engine not idle after {timeout_s}s: {state}")


def long_max_tokens(srv: ServerProcess) -> int:
    """A max_tokens that fits the context but takes many seconds to generate."""
    with srv.http() as client:
        max_model_len = client.get("/v1/models").json()["data"][0]["max_model_len"]
    return min(max_model_len - 64, 4000)


def metric_value(srv: ServerProcess, name: str, labels: dict[str, str] | None = None) -> float:
    with srv.http() as client:
        text = client.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                return float(sample.value)
    return 0.0


def assert_error(resp: httpx.Response, status: int, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


# ---- basics --------------------------------------------------------------------------


def test_health_and_models(server: ServerProcess) -> None:
    with server.http() as client:
        assert client.get("/health").json() == {"status": "ok"}
    models = server.openai().models.list().data
    assert len(models) == 1 and models[0].id == "SmolLM2-135M-Instruct.Q4_1"
    assert server.openai().models.retrieve(models[0].id).id == models[0].id


def test_flash_attention_verdict_in_engine_state_and_ready_block(server: ServerProcess) -> None:
    """flash_attn: auto on a CPU: /v1/engine says what llama.cpp was given, why, and the probe's step times;
    the ready block says it in words (which verdict depends on the CPU: the rule is tested in
    test_llama_cpp_flash_attn.py)."""
    state = engine_state(server)
    verdict = state["flash_attn_verdict"]
    assert verdict["setting"] is state["flash_attn"] and isinstance(state["flash_attn"], bool)
    assert verdict["reason"] in ("measured", "measured before")
    assert len(verdict["steps"]) == 6 and all(on > 0 and off > 0 for on, off in verdict["steps"].values())
    word = "on" if verdict["setting"] else "off"
    assert f"flash attention {word} ({verdict['reason']}: {verdict['ratio']:.2f}x the time of off over 6 serving steps)" \
        in server.log_text()


def test_engine_state_reports_the_patched_llama_cpp_build(server: ServerProcess) -> None:
    """The set-up (make setup) builds llama-cpp-python with third_party/llama-cpp-python/sgemm-prefetch.patch;
    /v1/engine reports the prefetch distance that build exports, so a set-up that silently installed an
    unpatched build fails here."""
    assert engine_state(server)["q0_prefetch_blocks"] == 8


def test_completion(server: ServerProcess) -> None:
    resp = server.openai().completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=PROMPT, max_tokens=12, temperature=0)
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion" and resp.created > 0
    assert len(resp.choices) == 1 and resp.choices[0].text.strip()
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage is not None and resp.usage.prompt_tokens > 0
    assert 0 < resp.usage.completion_tokens <= 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.usage.prompt_tokens_details is not None and resp.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_stream_equals_nonstream(server: ServerProcess) -> None:
    client = server.openai()
    # Warm the prefix cache first so both requests below evaluate the prompt the same way (a cache hit);
    # only then is greedy output guaranteed bit-exact (docs/reproducibility.md).
    client.completions.create(prompt=PROMPT, max_tokens=1, temperature=0, model="")
    full = client.completions.create(prompt=PROMPT, max_tokens=16, temperature=0, model="")
    chunks = list(client.completions.create(prompt=PROMPT, max_tokens=16, temperature=0, stream=True, model=""))
    assert all(c.id == chunks[0].id and c.id.startswith("cmpl-") for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_chat(server: ServerProcess) -> None:
    resp = server.openai().chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=CHAT, max_tokens=20, temperature=0)
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant" and resp.choices[0].message.content
    assert resp.choices[0].finish_reason in ("stop", "length")
    with server.http() as client:
        count = client.post("/tokenize", json={"messages": CHAT}).json()["count"]
    assert resp.usage is not None and resp.usage.prompt_tokens == count


def test_chat_stream_include_usage(server: ServerProcess) -> None:
    body = {"messages": CHAT, "max_tokens": 20, "temperature": 0, "stream_options": {"include_usage": True}}
    server.openai().chat.completions.create(model="", messages=CHAT, max_tokens=1, temperature=0)  # warm the cache
    events = stream_events(server, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    usage_chunk, chunks = events[-2], events[:-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0
    assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    full = server.openai().chat.completions.create(model="", messages=CHAT, max_tokens=20, temperature=0)
    assert text == full.choices[0].message.content
    assert usage_chunk["usage"]["completion_tokens"] == full.usage.completion_tokens  # type: ignore[union-attr]


def test_chat_stream_through_openai_client(server: ServerProcess) -> None:
    stream = server.openai().chat.completions.create(
        model="", messages=CHAT, max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1])


def test_stream_without_usage_has_no_usage_chunk(server: ServerProcess) -> None:
    events = stream_events(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5})
    assert events[-1] == "[DONE]" and all(e["choices"] for e in events[:-1])
    assert all("usage" not in e for e in events[:-1])


# ---- sampling features ---------------------------------------------------------------


def test_n_choices(server: ServerProcess) -> None:
    client = server.openai()
    resp = client.completions.create(model="", prompt=PROMPT, n=3, max_tokens=8, temperature=1.0, seed=7)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert resp.usage is not None and 3 <= resp.usage.completion_tokens <= 24
    assert len({c.text for c in resp.choices}) > 1  # sampled independently
    chat = client.chat.completions.create(model="", messages=CHAT, n=2, max_tokens=8, temperature=1.0)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    events = stream_events(server, "/v1/chat/completions", {"messages": CHAT, "n": 2, "max_tokens": 6})
    finished = {c["choices"][0]["index"] for c in events[:-1] if c["choices"][0].get("finish_reason")}
    assert finished == {0, 1}


def test_batched_prompts_index_per_prompt_times_n(server: ServerProcess) -> None:
    prompts = ["One, two, three,", "Roses are red,"]
    resp = server.openai().completions.create(model="", prompt=prompts, n=2, max_tokens=6, temperature=0)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in resp.choices}
    for i, prompt in enumerate(prompts):
        single = server.openai().completions.create(model="", prompt=prompt, max_tokens=6, temperature=0)
        assert by_index[2 * i] == by_index[2 * i + 1] == single.choices[0].text


def test_token_prompt(server: ServerProcess) -> None:
    with server.http() as client:
        tokens = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
        assert client.post("/detokenize", json={"tokens": tokens}).json()["prompt"].endswith(PROMPT)
    server.openai().completions.create(model="", prompt=PROMPT, max_tokens=1, temperature=0)  # warm: see above
    by_text = server.openai().completions.create(model="", prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = server.openai().completions.create(model="", prompt=tokens, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_stop_strings(server: ServerProcess) -> None:
    client = server.openai()
    client.completions.create(model="", prompt=PROMPT, max_tokens=1, temperature=0)  # warm: see above
    full = client.completions.create(model="", prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    words = [w for w in text.split() if len(w) > 2]
    assert words, text
    stop_word = words[min(2, len(words) - 1)]
    cut = client.completions.create(model="", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop_word, "zzzz"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop_word)]
    chat = client.chat.completions.create(model="", messages=CHAT, max_tokens=24, temperature=0, stop="\n")
    assert "\n" not in (chat.choices[0].message.content or "")


def test_seed_reproducible(server: ServerProcess) -> None:
    client = server.openai()
    texts = [
        client.completions.create(model="", prompt="A short story:", max_tokens=16, temperature=0.9, top_p=0.95, seed=1234).choices[0].text
        for _ in range(2)
    ]
    assert texts[0] == texts[1]
    chats = [
        client.chat.completions.create(model="", messages=CHAT, max_tokens=16, temperature=1.0, seed=99).choices[0].message.content
        for _ in range(2)
    ]
    assert chats[0] == chats[1]


def test_extension_parameters(server: ServerProcess) -> None:
    """Each sampling field reaches the sampler: its effect shows against greedy decoding of a prompt
    whose greedy continuation repeats itself (" two two two ...")."""
    prompt = "one two one two one two one two one two one two"

    def complete(**fields: Any) -> tuple[list[str], str]:
        body = {"model": "", "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1, "user": "tester", **fields}
        with server.http() as client:
            resp = client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        return choice["logprobs"]["tokens"], choice["finish_reason"]

    with server.http() as client:
        one, two = (client.post("/tokenize", json={"prompt": w}).json()["tokens"] for w in (" one", " two"))
    greedy, _ = complete()
    assert greedy[:3] == [" two"] * 3 and len(one) == len(two) == 1
    hot = {"temperature": 3.0, "seed": 1}  # far from greedy: nearly uniform over the vocabulary
    sampled = complete(**hot)
    assert sampled[0] != greedy
    assert complete(**hot) == sampled and complete(temperature=3.0, seed=2)[0] != sampled[0]  # seed
    for narrowing in ({"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-6}):  # each leaves only the top token
        assert complete(**hot, **narrowing)[0] == greedy, narrowing
    penalised = [complete(**{field: 2.0})[0] for field in ("presence_penalty", "frequency_penalty", "repetition_penalty")]
    assert all(tokens != greedy for tokens in penalised), penalised  # the repeated " two" loses its lead
    assert penalised[0] != penalised[1]  # presence is flat; frequency grows with the count
    assert complete(logit_bias={str(one[0]): 100}) == ([" one"] * 8, "length")
    assert complete(stop_token_ids=two) == ([" two"], "stop")  # the first greedy token ends it
    eos = {"logit_bias": {"2": 100}}  # <|im_end|>, the embedded model's EOS, made certain
    assert complete(**eos) == ([""], "stop")
    assert complete(**eos, min_tokens=3) == ([" two"] * 3 + [""], "stop")
    assert complete(**eos, ignore_eos=True) == ([""] * 8, "length")


def test_completion_logprobs(server: ServerProcess) -> None:
    resp = server.openai().completions.create(model="", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6  # type: ignore[arg-type]
    assert lp.text_offset[0] == 0 and all(b >= a for a, b in zip(lp.text_offset, lp.text_offset[1:]))  # type: ignore[index]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):  # type: ignore[arg-type]
        assert logprob <= 0 and token in top and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)  # greedy picks the most likely token
    events = stream_events(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 1})
    chunks = events[:-1]  # "[DONE]" last
    # The finish comes alone, as OpenAI's: no text, logprobs null (issue 46 §5).
    assert chunks[-1]["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]
    streamed = [t for e in chunks[:-1] for t in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed == lp.tokens


def test_chat_logprobs(server: ServerProcess) -> None:
    resp = server.openai().chat.completions.create(model="", messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == resp.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes is not None and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    plain = server.openai().chat.completions.create(model="", messages=CHAT, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None


def test_prefix_cache_reported_in_usage(server: ServerProcess) -> None:
    prompt = "Here is a long shared preamble about the history of bread. " * 12
    client = server.openai()
    client.completions.create(model="", prompt=prompt + "First", max_tokens=2, temperature=0)
    second = client.completions.create(model="", prompt=prompt + "Second", max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]


# ---- concurrency, cancellation ---------------------------------------------------------


async def _stream_text(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[str, str | None, bool, dict]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "logprobs": 2}
    text, finish, done = "", None, False
    logprobs: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                finish = choice.get("finish_reason") or finish
                for key in logprobs:
                    logprobs[key] += (choice.get("logprobs") or {}).get(key) or []
    return text, finish, done, logprobs


LOGPROB_TOL = 0.25  # see tests/integration/test_llama_cpp_engine.py and docs/reproducibility.md


def _greedy_agree(a: dict, b: dict) -> bool:
    """True when two greedy runs (OpenAI completion logprobs) produced the same tokens; False when they
    diverged at a near-tie, which batching may cause; fails when they diverged at a clear choice."""
    for tok_a, lp_a, tok_b, lp_b, top_b in zip(a["tokens"], a["token_logprobs"], b["tokens"], b["token_logprobs"],
                                               b["top_logprobs"]):
        if tok_a != tok_b:
            first, second = sorted(top_b.values(), reverse=True)[:2]
            assert first - second <= 2 * LOGPROB_TOL, f"diverged at a clear choice: {tok_a!r} vs {tok_b!r}"
            return False
        assert abs(lp_a - lp_b) <= LOGPROB_TOL
    return True


def test_32_concurrent_streams_match_nonstream(server: ServerProcess) -> None:
    # Each prompt is unique, so a stream carrying another request's tokens would show. The two
    # rounds batch differently, so outputs are equal except after a near-tie (docs/reproducibility.md).
    prompts = [f"{i}, {i + 1}, {i + 2}, {i + 3}," for i in range(100, 132)]

    async def run() -> tuple[list[Any], list[tuple[str, str | None, bool, dict]]]:
        async with server.async_http() as client:
            bodies = [{"prompt": p, "max_tokens": 12, "temperature": 0, "logprobs": 2} for p in prompts]
            fulls = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
            streams = await asyncio.gather(*(_stream_text(client, p, 12) for p in prompts))
        return [r.json() for r in fulls], streams

    fulls, streams = asyncio.run(run())
    for full, (text, finish, done, logprobs) in zip(fulls, streams):
        assert done
        assert "".join(logprobs["tokens"]) == text  # streamed logprobs cover exactly the streamed text
        if _greedy_agree(logprobs, full["choices"][0]["logprobs"]):
            assert text == full["choices"][0]["text"] and finish == full["choices"][0]["finish_reason"]
    wait_idle(server)


def test_stream_disconnect_frees_slot(server: ServerProcess) -> None:
    wait_idle(server)
    aborted_before = metric_value(server, "cllm_requests_total", {"status": "abort"})
    body = {"prompt": PROMPT, "max_tokens": long_max_tokens(server), "ignore_eos": True, "stream": True}
    with server.http() as client, client.stream("POST", "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        got = [line for line, _ in zip(lines, range(6))]
        assert resp.status_code == 200 and any(line.startswith("data: ") for line in got), got
        # /v1/engine serves a snapshot the busy engine republishes every 50 ms: poll for the step's view.
        deadline = time.monotonic() + 5.0
        while True:
            running = engine_state(server)["running"]
            if (len(running) == 1 and running[0]["slot"] is not None) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert len(running) == 1 and running[0]["slot"] is not None and running[0]["num_output_tokens"] > 0
        assert running[0]["age_s"] >= 0
    # Leaving the `with` closed the connection mid-stream.
    wait_idle(server, timeout_s=3.0)
    assert metric_value(server, "cllm_requests_total", {"status": "abort"}) == aborted_before + 1


def test_nonstream_disconnect_frees_slot(server: ServerProcess) -> None:
    wait_idle(server)
    aborted_before = metric_value(server, "cllm_requests_total", {"status": "abort"})
    body = {"prompt": PROMPT, "max_tokens": long_max_tokens(server), "ignore_eos": True}
    with server.http(timeout=httpx.Timeout(60.0, read=1.0)) as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json=body)  # gives up after 1 s and closes the connection
    wait_idle(server, timeout_s=3.0)
    assert metric_value(server, "cllm_requests_total", {"status": "abort"}) == aborted_before + 1


# ---- errors ----------------------------------------------------------------------------

C, CH = "/v1/completions", "/v1/chat/completions"
INVALID: list[tuple[str, str, Any, int, str | None, str | None]] = [
    # (name, path, body (str = raw bytes), status, param, code)
    ("malformed json", C, '{"prompt": ', 400, None, None),
    ("not an object", C, "[1, 2]", 400, None, None),
    ("empty body", C, "", 400, None, None),
    ("missing prompt", C, {"max_tokens": 3}, 400, "prompt", None),
    ("max_tokens wrong type", C, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", None),
    ("stream wrong type", C, {"prompt": "x", "stream": "yes"}, 400, "stream", None),
    ("seed wrong type", C, {"prompt": "x", "seed": "abc"}, 400, "seed", None),
    ("unknown model", C, {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("negative temperature", C, {"prompt": "x", "temperature": -1}, 400, "temperature", None),
    ("top_p zero", C, {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("n zero", C, {"prompt": "x", "n": 0}, 400, "n", None),
    ("n over cap", C, {"prompt": "x", "n": 99}, 400, "n", None),
    ("max_tokens zero", C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("max_tokens over cap", C, {"prompt": "x", "max_tokens": 100000}, 400, "max_tokens", None),
    ("presence_penalty out of range", C, {"prompt": "x", "presence_penalty": 5}, 400, "presence_penalty", None),
    ("logprobs too many", C, {"prompt": "x", "logprobs": 50}, 400, "logprobs", None),
    ("logit_bias bad key", C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias", None),
    ("logit_bias token outside vocab", C, {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias", None),
    ("too many stop strings", C, {"prompt": "x", "stop": [f"s{i}" for i in range(20)]}, 400, "stop", None),
    ("min_tokens over max_tokens", C, {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens", None),
    ("empty prompt list", C, {"prompt": []}, 400, "prompt", None),
    ("token outside vocab", C, {"prompt": [999999999]}, 400, "prompt", None),
    ("prompt longer than context", C, {"prompt": "hello " * 2000}, 400, "prompt", "context_length_exceeded"),
    ("prompt + max_tokens over context", C, {"prompt": "hello " * 600, "max_tokens": 1000}, 400, "prompt", "context_length_exceeded"),
    ("suffix unsupported", C, {"prompt": "x", "suffix": "y"}, 400, "suffix", "unsupported_parameter"),
    ("missing messages", CH, {"max_tokens": 3}, 400, "messages", None),
    ("empty messages", CH, {"messages": []}, 400, "messages", None),
    ("bad role", CH, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", None),
    ("image content", CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages.0.content.0", None),
    ("image on a text-only model", CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"}}]}]}, 400, "messages", "images_not_supported"),
    ("legacy functions unsupported", CH, {"messages": CHAT, "functions": [{"name": "f"}]}, 400, "functions", "unsupported_parameter"),
    ("unknown response_format", CH, {"messages": CHAT, "response_format": {"type": "xml"}}, 400, "response_format", "unsupported_parameter"),
    ("top_logprobs without logprobs", CH, {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", None),
    ("chat logprobs wrong type", CH, {"messages": CHAT, "logprobs": 3}, 400, "logprobs", None),
    ("negative max_completion_tokens", CH, {"messages": CHAT, "max_completion_tokens": -1}, 400, "max_tokens", None),
    ("chat unknown model", CH, {"messages": CHAT, "model": "nope"}, 404, "model", "model_not_found"),
    ("chat context overflow", CH, {"messages": [{"role": "user", "content": "hi " * 2000}]}, 400, "messages", "context_length_exceeded"),
    ("tokenize both inputs", "/tokenize", {"prompt": "x", "messages": CHAT}, 400, None, None),
    ("detokenize bad ids", "/detokenize", {"tokens": [-1]}, 400, "tokens", None),
]


@pytest.mark.parametrize(("name", "path", "body", "status", "param", "code"), INVALID, ids=[row[0] for row in INVALID])
def test_invalid_input(server: ServerProcess, name: str, path: str, body: Any, status: int, param: str | None, code: str | None) -> None:
    with server.http() as client:
        if isinstance(body, str):
            resp = client.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            resp = client.post(path, json=body)
    error = assert_error(resp, status, param=param, code=code)
    assert error["type"] in ("invalid_request_error", "not_found_error")


def test_routing_errors_and_body_limit(server: ServerProcess) -> None:
    with server.http() as client:
        assert_error(client.get("/v1/completions"), 405)
        assert_error(client.get("/v1/nothing-here"), 404)
        big = {"prompt": "x" * (2 << 20)}
        assert_error(client.post("/v1/completions", json=big), 413, code="request_too_large")
        # max_body_bytes: auto is 1 MiB on a server whose model takes no images
        assert client.get("/v1/engine").json()["images"]["max_body_bytes"] == 1 << 20
    with pytest.raises(openai.NotFoundError):
        server.openai().completions.create(model="gpt-4", prompt="x")


def test_server_healthy_after_errors(server: ServerProcess) -> None:
    with server.http() as client:
        for _, path, body, *_ in INVALID[:8]:
            client.post(path, content=body if isinstance(body, str) else json.dumps(body))
        assert client.get("/health").status_code == 200
    resp = server.openai().completions.create(model="", prompt=PROMPT, max_tokens=4)
    assert resp.choices[0].text
    assert "Traceback" not in server.log_text()


# ---- observability -------------------------------------------------------------------


def test_metrics_parse(server: ServerProcess) -> None:
    server.openai().completions.create(model="", prompt=PROMPT, max_tokens=4)
    with server.http() as client:
        resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    for name in (
        "cllm_requests", "cllm_num_requests_waiting", "cllm_num_requests_running", "cllm_slots_in_use",
        "cllm_slots_total", "cllm_kv_cache_usage_ratio", "cllm_prefix_cache_hit_rate", "cllm_prompt_tokens",
        "cllm_generation_tokens", "cllm_time_to_first_token_seconds", "cllm_inter_token_latency_seconds",
        "cllm_e2e_request_latency_seconds", "cllm_request_queue_time_seconds", "cllm_http_responses",
    ):
        assert name in families, name
    assert families["cllm_slots_total"].samples[0].value == 16
    ttft_count = [s for s in families["cllm_time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert ttft_count[0].value > 0
    assert metric_value(server, "cllm_requests_total", {"status": "length"}) > 0
    assert metric_value(server, "cllm_generation_tokens_total") > 0


def test_openapi_schema(server: ServerProcess) -> None:
    with server.http() as client:
        paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize"} <= set(paths)


def test_access_log_line(server: ServerProcess) -> None:
    resp = server.openai().completions.create(model="", prompt=PROMPT, max_tokens=5, temperature=0)
    deadline = time.monotonic() + 5
    while resp.id not in server.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    line = next(ln for ln in server.log_text().splitlines() if resp.id in ln)
    assert '"POST /v1/completions" 200' in line and "cllm.server.access" in line
    assert f"prompt_tokens={resp.usage.prompt_tokens} completion_tokens={resp.usage.completion_tokens}" in line  # type: ignore[union-attr]
    assert "ttft=" in line and "total=" in line


def test_engine_endpoint_shape(server: ServerProcess) -> None:
    state = wait_idle(server)
    assert state["model"] == "SmolLM2-135M-Instruct.Q4_1" and state["phase"] == "ready"
    for key in ("num_running", "num_waiting", "slots_in_use", "slots_total", "kv_usage", "requests_finished",
                "prefix_cache_hit_rate", "tokens_per_s"):
        assert key in state["stats"]


# ---- limits, auth, timeouts (one slot, one waiting place) ---------------------------------


def test_api_key(small_server: ServerProcess) -> None:
    url = small_server.base_url
    assert_error(httpx.get(f"{url}/v1/models"), 401, code="invalid_api_key")
    assert_error(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert httpx.get(f"{url}/health").status_code == 200  # operations endpoints stay open
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    resp = small_server.openai().completions.create(model="", prompt=PROMPT, max_tokens=3)
    assert resp.choices[0].text


def test_queue_overflow_429(small_server: ServerProcess) -> None:
    async def flood() -> list[httpx.Response]:
        async with small_server.async_http() as client:
            body = {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True}
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(8)))

    responses = asyncio.run(flood())
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and 429 in codes and set(codes) <= {200, 429}, codes
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["retry-after"]) >= 1
    assert_error(refused, 429, code="queue_full")
    for ok in (r for r in responses if r.status_code == 200):
        assert ok.json()["usage"]["completion_tokens"] == 24

    async def through_openai() -> list[Any]:
        client = small_server.async_openai()
        calls = [client.completions.create(model="", prompt=PROMPT, max_tokens=24, extra_body={"ignore_eos": True}) for _ in range(4)]
        return await asyncio.gather(*calls, return_exceptions=True)

    outcomes = asyncio.run(through_openai())
    assert any(isinstance(o, openai.RateLimitError) for o in outcomes), outcomes
    wait_idle(small_server)
    assert small_server.openai().completions.create(model="", prompt=PROMPT, max_tokens=3).choices[0].text


def test_request_timeout(small_server: ServerProcess) -> None:
    body = {"prompt": PROMPT, "max_tokens": long_max_tokens(small_server), "ignore_eos": True}
    with small_server.http() as client:
        started = time.monotonic()
        resp = client.post("/v1/completions", json=body)
        assert time.monotonic() - started < 10
    assert_error(resp, 504, code="timeout")
    assert resp.headers["x-should-retry"] == "false"  # openai clients would otherwise retry it twice
    events = stream_events(small_server, "/v1/completions", body)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "timeout"
    assert any("choices" in e and e["choices"] for e in events[:-2])  # tokens streamed before the deadline
    wait_idle(small_server)


def test_cors_only_when_configured(server: ServerProcess, small_server: ServerProcess) -> None:
    preflight = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    allowed = httpx.options(f"{small_server.base_url}/v1/completions", headers=preflight)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "http://example.com"
    other = httpx.get(f"{small_server.base_url}/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    plain = httpx.get(f"{server.base_url}/health", headers={"Origin": "http://example.com"})
    assert "access-control-allow-origin" not in plain.headers


# ---- lifecycle -----------------------------------------------------------------------


def test_health_503_while_loading_then_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process (no model): /health and /v1 answer 503 while the engine loads, and say why it failed."""
    from fastapi.testclient import TestClient

    from cllm.config import load_config
    from cllm.server import lifecycle
    from cllm.server.app import create_app

    release = threading.Event()

    def slow_failing_load(config: Any) -> Any:
        release.wait(10)
        raise RuntimeError("boom: no such model")

    monkeypatch.setattr(lifecycle, "_construct_engine", slow_failing_load)
    with TestClient(create_app(load_config(environ={})), base_url="http://localhost") as client:
        loading = client.get("/health")
        assert loading.status_code == 503 and loading.json()["status"] == "loading"
        assert_error(client.post("/v1/completions", json={"prompt": "x"}), 503, code="model_loading")
        release.set()
        deadline = time.monotonic() + 5
        while client.get("/health").json()["status"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.02)
        failed = client.get("/health")
        assert failed.status_code == 503 and "boom" in failed.json()["error"]
        assert_error(client.post("/v1/completions", json={"prompt": "x"}), 503, code="model_load_failed")


def test_model_load_failure_exits_nonzero(tmp_path: Any) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file")
    srv = start_server("--model", str(bad), wait=False)
    try:
        code = srv.proc.wait(timeout=60)
    finally:
        srv.stop(signal.SIGKILL)
        srv._log_file.close()  # type: ignore[attr-defined]
    assert code == 1, srv.log_text()[-3000:]
    assert "failed to load the model" in srv.log_text()
    srv.log_path.unlink(missing_ok=True)



def test_sigterm_drains_and_exits_zero() -> None:
    grace = 5  # the 40-token request must finish within it, beside the long stream, on a busy 2-core machine
    srv = start_server("--set", f"shutdown_grace_s={grace}", "--log-level", "info")
    results: dict[str, Any] = {}
    long_tokens = long_max_tokens(srv)

    def long_stream() -> None:
        body = {"prompt": PROMPT, "max_tokens": long_tokens, "ignore_eos": True, "stream": True}
        with srv.http() as client, client.stream("POST", "/v1/completions", json=body) as resp:
            results["long"] = sse_events(list(resp.iter_lines()))

    def short_request() -> None:
        time.sleep(0.3)
        with srv.http() as client:
            results["short"] = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True})

    threads = [threading.Thread(target=long_stream), threading.Thread(target=short_request)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(engine_state(srv)["running"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(engine_state(srv)["running"]) == 2, "both requests must be running before the SIGTERM"
    started = time.monotonic()
    code = srv.stop(signal.SIGTERM, timeout_s=15)
    elapsed = time.monotonic() - started
    for t in threads:
        t.join(timeout=10)
    srv._log_file.close()  # type: ignore[attr-defined]
    assert code == 0, srv.log_text()[-3000:]
    assert elapsed < grace + 5, elapsed  # grace plus a margin for the abort and exit
    assert results["short"].status_code == 200  # finished within the grace period
    assert results["short"].json()["usage"]["completion_tokens"] == 40
    long = results["long"]
    assert long[-1] == "[DONE]" and long[-2]["error"]["code"] == "aborted"  # cut at the deadline, told why
    log = srv.log_text()
    assert "shutting down" in log and "Traceback" not in log
    srv.log_path.unlink(missing_ok=True)

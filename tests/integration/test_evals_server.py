"""Evaluation-harness and agent-framework surface of `cllm serve`, end to end with the openai client:
echo + prompt logprobs (against teacher-forced logprobs computed here, in the test process),
/v1/embeddings, and model aliases / any-model acceptance."""
from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.integration.conftest_server import ServerProcess, _finish, start_server
from tests.integration.test_evals_engine import LLAMA_TOL, TIGHT, TRIPLES, assert_similar_beats_unrelated, teacher_forced_llama

ALIASES = ["smol", "gpt-4o-mini", "text-embedding-3-small"]
PROMPT = "The capital of France is Paris, and the capital of Germany is Berlin."


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerProcess]:
    args = ["--n-seq-max", "4", "--n-ctx", "4096"]
    for name in ALIASES:
        args += ["--served-model-name", name]
    server = start_server(*args)
    yield server
    _finish(server)


def tokenize(srv: ServerProcess, text: str, add_special: bool = True) -> list[int]:
    with srv.http() as client:
        return client.post("/tokenize", json={"prompt": text, "add_special_tokens": add_special}).json()["tokens"]


def test_echo_logprobs_equal_teacher_forced(srv: ServerProcess) -> None:
    client = srv.openai()
    ids = tokenize(srv, PROMPT)
    with srv.http() as http:
        engine = http.get("/v1/engine").json()
    ref = teacher_forced_llama(ids, Path(engine["weights"]), engine["flash_attn"])  # what the server's llama.cpp runs
    resp = client.completions.create(model="smol", prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    choice = resp.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(np.array(lp.token_logprobs[1:]), ref, atol=TIGHT, rtol=0)
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == value and 2 <= len(top) <= 3  # k alternatives plus the token itself
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 0


def test_echo_with_generation_streamed_and_not(srv: ServerProcess) -> None:
    client = srv.openai()
    body = dict(model="gpt-4o-mini", prompt=PROMPT, echo=True, logprobs=1, max_tokens=5, temperature=0)
    full = client.completions.create(**body).choices[0]
    n_prompt = len(tokenize(srv, PROMPT))
    assert full.text.startswith(PROMPT) and len(full.text) > len(PROMPT)
    assert len(full.logprobs.tokens) == n_prompt + 5 and full.logprobs.token_logprobs[n_prompt] is not None
    assert "".join(full.logprobs.tokens) == full.text
    chunks = list(client.completions.create(**body, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.text
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None
    np.testing.assert_allclose(np.array(streamed[1:], dtype=float),
                               np.array(full.logprobs.token_logprobs[1:], dtype=float), atol=LLAMA_TOL)
    # Echo without logprobs: the text only. max_tokens=0 without echo stays an error.
    plain = client.completions.create(model="smol", prompt=PROMPT, echo=True, max_tokens=0)
    assert plain.choices[0].text == PROMPT and plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="smol", prompt=PROMPT, max_tokens=0)
    assert err.value.body["param"] == "max_tokens"


def test_loglikelihood_request_as_lm_eval_harness_sends_it(srv: ServerProcess) -> None:
    """lm-eval-harness's openai-completions loglikelihood: context + continuation, echo, max_tokens 0,
    token prompts; the continuation's summed logprob ranks the right answer first here."""
    context = tokenize(srv, "Question: What is the capital of France?\nAnswer:")
    answers = [" Paris", " banana"]
    prompts = [context + tokenize(srv, a, add_special=False) for a in answers]
    resp = srv.openai().completions.create(model="smol", prompt=prompts, echo=True, logprobs=1, max_tokens=0,
                                           temperature=0)
    scores = [sum(c.logprobs.token_logprobs[len(context):]) for c in sorted(resp.choices, key=lambda c: c.index)]
    assert scores[0] > scores[1]


def embeddings(client: openai.OpenAI, texts: list[str], **kw: object) -> np.ndarray:
    resp = client.embeddings.create(model="text-embedding-3-small", input=texts, **kw)
    assert [d.index for d in resp.data] == list(range(len(texts)))
    return np.array([d.embedding for d in resp.data], dtype=np.float64)


def test_embeddings_through_openai_client(srv: ServerProcess) -> None:
    client = srv.openai()
    flat = [s for triple in TRIPLES for s in triple]
    vectors = embeddings(client, flat)  # the client asks for base64 and decodes it
    assert vectors.shape == (len(flat), 576)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(vectors, embeddings(client, flat))  # deterministic
    np.testing.assert_array_equal(vectors, embeddings(client, flat, encoding_format="float"))
    assert_similar_beats_unrelated(vectors)
    resp = client.embeddings.create(model="smol", input="hello world")
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == len(tokenize(srv, "hello world"))
    with srv.http() as http:
        raw = http.post("/v1/embeddings", json={"input": [[1, 2, 3]], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert decoded.shape == (576,) and raw["usage"]["prompt_tokens"] == 3 and raw["model"] == "smol"


def test_concurrent_embedding_requests_all_answer(srv: ServerProcess) -> None:
    texts = [f"sentence number {i} about topic {i % 3}" for i in range(12)]
    alone = embeddings(srv.openai(), texts)

    async def main() -> list[np.ndarray]:
        client = srv.async_openai()
        resps = await asyncio.gather(*[client.embeddings.create(model="smol", input=[t]) for t in texts])
        return [np.array(r.data[0].embedding) for r in resps]

    together = np.array(asyncio.run(main()))
    np.testing.assert_allclose(together, alone, atol=1e-2)  # batch-mates change rounding only


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": "x " * 3000}, "input"),
    ({"input": [[999999999]]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 12}, "dimensions"),
])
def test_embedding_bad_input_is_400(srv: ServerProcess, body: dict, param: str) -> None:
    with srv.http() as client:
        resp = client.post("/v1/embeddings", json=body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param
        # the server keeps serving
        assert client.post("/v1/embeddings", json={"input": "ok"}).status_code == 200


def test_model_aliases_listed_and_unknown_model_is_404(srv: ServerProcess) -> None:
    client = srv.openai()
    assert [m.id for m in client.models.list().data] == ALIASES
    assert client.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
    for name in ALIASES:
        assert client.completions.create(model=name, prompt="Hi", max_tokens=1).model == "smol"
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="gpt-4", input="Hi")


def test_accept_any_model_switch() -> None:
    server = start_server("--n-seq-max", "2", "--n-ctx", "2048", "--set", "accept_any_model=true")
    try:
        client = server.openai()
        chat = client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert chat.choices[0].message.content is not None
        assert client.embeddings.create(model="anything", input="Hi").data[0].embedding
        with httpx.Client(base_url=server.base_url) as http:
            assert http.get("/v1/models/whatever").status_code == 200
    finally:
        _finish(server)

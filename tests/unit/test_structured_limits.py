"""Issue 27 items 11 and 12: JSON grammars bound numbers and blank runs by default (as llama.cpp's
json-schema-to-grammar), schema bounds override them; hostile constraints are refused or bounded
(size, depth, compile time, cache memory, compiles per client)."""
from __future__ import annotations

import json

import pytest

from cllm.sampling.params import SamplingParams

import xgrammar as xgr  # the structured extra, which `make test` installs: missing is a failure, not a skip

from cllm.structured.cache import GrammarCache


class ByteVocab:
    """Every byte is a token (id = byte value), 256 is EOS: any text can be written."""

    vocab_size = 257
    eos_token_ids = frozenset({256})

    def token_bytes(self, token_id: int) -> bytes:
        return b"" if token_id == 256 else bytes([token_id])


def accepts(params: SamplingParams, text: str, *, complete: bool = False) -> bool:
    """Whether the compiled constraint accepts ``text`` (as a prefix, or as a complete reply)."""
    matcher = xgr.GrammarMatcher(GrammarCache(ByteVocab(), 4).get(params))
    ok = all(matcher.accept_token(b) for b in text.encode())
    return ok and (not complete or matcher.accept_token(256))


CITY = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                                         "population": {"type": "integer"}},
        "required": ["name", "country", "population"], "additionalProperties": False}
HEAD = '{"name": "Paris", "country": "France", "population": '


# ---- item 11: default bounds ----------------------------------------------------------------------


def test_integer_has_at_most_16_digits_by_default():
    city = SamplingParams(json_schema=CITY)
    assert accepts(city, HEAD + "1" * 16 + "}", complete=True)
    assert not accepts(city, HEAD + "1" * 17)  # the 17th digit is refused: the object must close


@pytest.mark.parametrize("bound", [{"maximum": 10 ** 18}, {"minimum": 10 ** 17}, {"minimum": 0, "maximum": 10 ** 18}])
def test_schema_bounds_override_the_default(bound):
    """18 digits, past the default 16, where the schema's own bound allows them (xgrammar takes
    integer bounds up to int64)."""
    schema = json.loads(json.dumps(CITY))
    schema["properties"]["population"].update(bound)
    assert accepts(SamplingParams(json_schema=schema), HEAD + "1" * 18 + "}", complete=True)


def test_number_fraction_and_exponent_are_bounded():
    schema = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    params = SamplingParams(json_schema=schema)
    assert accepts(params, '{"x": -1234567890123456.1234567890123456e1234567890123456}', complete=True)
    assert not accepts(params, '{"x": 1.' + "2" * 17)
    assert not accepts(params, '{"x": 1e' + "2" * 17)
    assert not accepts(params, '{"x": ' + "9" * 17)


def test_unbounded_strings_bound_runs_of_spaces_and_escapes():
    city = SamplingParams(json_schema=CITY)
    assert accepts(city, '{"name": "a' + " " * 20 + 'b' + "\\n" * 20 + '"')
    assert not accepts(city, '{"name": "a' + " " * 21)
    assert not accepts(city, '{"name": "' + "\\n" * 21)
    assert not accepts(city, '{"name": "' + " \\t" * 11)  # mixed blanks are one run
    assert accepts(city, '{"name": "' + " x" * 200 + '"')  # text of any length still fits
    bounded = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 40}}, "required": ["s"]}
    assert accepts(SamplingParams(json_schema=bounded), '{"s": "' + " " * 30 + '"}', complete=True)  # maxLength rules


def test_json_object_mode_is_bounded_too():
    params = SamplingParams(json_object=True)
    assert accepts(params, '{"n": ' + "7" * 16 + "}", complete=True)
    assert not accepts(params, '{"n": ' + "7" * 17)


# ---- item 12: hostile constraints -----------------------------------------------------------------

import contextvars  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from cllm.structured.limits import (  # noqa: E402
    CompileBusyError,
    CompileTimeoutError,
    ConstraintLimits,
    charge_compiles_to,
)


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema, "maxItems": 1}
    return schema


def test_deeply_nested_schema_and_grammar_are_400s_naming_the_field():
    cache = GrammarCache(ByteVocab(), 4)
    with pytest.raises(ValueError, match=r"invalid json_schema=<nested \d+ levels deep>: deeper than the 40 levels"):
        cache.get(SamplingParams(json_schema=nested_schema(60)))
    with pytest.raises(ValueError, match=r"invalid grammar=<nested 50 levels deep>"):
        cache.get(SamplingParams(grammar="root ::= " + "(" * 50 + '"a"' + ")" * 50))
    with pytest.raises(ValueError, match=r"invalid regex=<nested 45 levels deep>"):
        cache.get(SamplingParams(regex="(" * 45 + "a" + ")" * 45))
    cache.get(SamplingParams(json_schema=nested_schema(10)))  # ordinary nesting compiles
    cache.get(SamplingParams(grammar='root ::= "(((((" [(]'))  # brackets in literals are no nesting


def test_oversized_constraint_is_a_400_before_any_compile():
    cache = GrammarCache(ByteVocab(), 4)
    props = {f"field_{i}": {"type": "string", "description": "x" * 200} for i in range(1500)}
    with pytest.raises(ValueError, match=r"invalid json_schema=<\d+ bytes>: larger than the 262144 bytes"):
        cache.get(SamplingParams(json_schema={"type": "object", "properties": props}))
    assert cache.misses == 0


def _slow(cache: GrammarCache, seconds: float) -> None:
    compile_ = cache._compile

    def slow(key, params):
        time.sleep(seconds)
        return compile_(key, params)
    cache._compile = slow


def test_a_compile_past_its_budget_fails_fast_and_finishes_in_the_background():
    cache = GrammarCache(ByteVocab(), 4, ConstraintLimits(compile_timeout_s=0.2))
    _slow(cache, 1.0)
    params = SamplingParams(regex="[a-z]+")
    start = time.perf_counter()
    with pytest.raises(CompileTimeoutError, match=r"invalid regex='\[a-z\]\+': compiling it takes longer than this server's 0.2 s budget"):
        cache.get(params)
    assert time.perf_counter() - start < 0.8
    deadline = time.perf_counter() + 5
    while cache.misses == 0 and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert cache.get(params) is not None and cache.hits == 1  # the late compile was kept
    cache.close()


def test_busy_compile_threads_are_a_retryable_error_not_a_hang():
    cache = GrammarCache(ByteVocab(), 4, ConstraintLimits(compile_timeout_s=0.2, compile_threads=1))
    _slow(cache, 1.0)
    compiling = threading.Event()
    slow_compile = cache._compile

    def signalling(key, params):
        compiling.set()
        return slow_compile(key, params)
    cache._compile = signalling
    first: list[BaseException | object] = []

    def first_request() -> None:
        try:
            first.append(cache.get(SamplingParams(regex="a+")))
        except BaseException as err:  # (an exception in a thread is only a warning: the test reads it here)
            first.append(err)
    thread = threading.Thread(target=first_request)
    thread.start()
    assert compiling.wait(10), "the first compile never started"
    with pytest.raises(CompileBusyError, match="busy"):  # the only compile thread is taken
        cache.get(SamplingParams(regex="b+"))
    thread.join(10)
    assert len(first) == 1 and isinstance(first[0], CompileTimeoutError), first
    cache.close()


def test_cache_is_bounded_by_memory_and_one_grammar_by_size():
    cache = GrammarCache(ByteVocab(), 128, ConstraintLimits(cache_bytes=1, keep_newest=2))
    for i in range(6):
        cache.get(SamplingParams(json_schema={"type": "object", "properties": {f"p{i}": {"type": "string"}}}))
    assert len(cache._compiled) == 2 and cache.cached_bytes > 0
    small = GrammarCache(ByteVocab(), 4, ConstraintLimits(max_grammar_bytes=100))
    with pytest.raises(ValueError, match=r"invalid json_schema=.*compiled grammar takes .* MiB, more than"):
        small.get(SamplingParams(json_schema=CITY))


class CountingPayer:
    def __init__(self, cap: int) -> None:
        self.cap, self.running, self.charged = cap, 0, 0

    def begin_compile(self):
        if self.running >= self.cap:
            raise RuntimeError("over the client's share")
        self.running += 1
        self.charged += 1

        def release():
            self.running -= 1
        return release


def test_cold_compiles_are_charged_to_the_contexts_payer_until_they_end():
    cache = GrammarCache(ByteVocab(), 4, ConstraintLimits(compile_timeout_s=0.1))
    _slow(cache, 0.5)
    payer = CountingPayer(cap=1)

    def request(regex: str):
        charge_compiles_to(payer)
        return cache.get(SamplingParams(regex=regex))

    with pytest.raises(CompileTimeoutError):
        contextvars.copy_context().run(request, "x+")
    assert payer.running == 1  # still compiling: still charged
    with pytest.raises(RuntimeError, match="share"):
        contextvars.copy_context().run(request, "y+")
    time.sleep(0.8)
    assert payer.running == 0
    contextvars.copy_context().run(request, "x+")  # a cache hit: not charged
    assert payer.charged == 1
    del cache._compile  # fast again
    cache.get(SamplingParams(regex="z+"))  # no payer in this context (Python API): nobody charged
    assert payer.charged == 1
    cache.close()


def test_server_refuses_a_client_over_its_compile_share_with_429():
    from fastapi.testclient import TestClient

    import cllm
    from cllm.server.app import create_app
    from tests.unit.fakes import FakeBackend, fake_config

    config = fake_config(max_compiles_per_client=1)
    app = create_app(config, engine=cllm.AsyncLLM(backend=FakeBackend(slots=2), config=config))
    with TestClient(app, base_url="http://localhost") as client:
        quota = client.app.state.cllm.quota
        body = {"prompt": "ab", "max_tokens": 3, "guided_regex": "[a-c]{3}"}
        release = quota.begin_compile("testclient")  # a compile of this client is running
        refused = client.post("/v1/completions", json=body)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "client_compile_quota_exceeded"
        assert refused.headers["Retry-After"] == "2"
        chat = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "a"}], "max_tokens": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}})
        assert chat.status_code == 429 and chat.json()["error"]["code"] == "client_compile_quota_exceeded"
        release()
        assert client.post("/v1/completions", json=body).status_code == 200
        assert quota.compiling("testclient") == 0
        assert client.post("/v1/completions", json=body).status_code == 200  # cached: no compile, no charge


def test_server_fails_a_compile_past_its_budget_with_a_400_and_keeps_serving():
    from fastapi.testclient import TestClient

    import cllm
    from cllm.server.app import create_app
    from tests.unit.fakes import FakeBackend, fake_config

    config = fake_config()
    engine = cllm.AsyncLLM(backend=FakeBackend(slots=2), config=config)
    cache = engine.engine.structured.cache
    cache.limits = ConstraintLimits(compile_timeout_s=0.3)
    _slow(cache, 2.0)
    with TestClient(create_app(config, engine=engine), base_url="http://localhost") as client:
        start = time.perf_counter()
        slow = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "guided_regex": "[a-c]{3}"})
        assert slow.status_code == 400, slow.text
        assert slow.json()["error"]["param"] == "regex" and "0.3 s budget" in slow.json()["error"]["message"]
        plain = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3})
        assert plain.status_code == 200
        assert time.perf_counter() - start < 1.5  # both answered while the compile still runs
        assert cache.misses == 0

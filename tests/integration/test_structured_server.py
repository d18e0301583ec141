"""Structured output and tool calling through `cllm serve` on the embedded model, driven by the
openai client and LangChain: constrained output always parses and validates, tool calls come back
parsed (streamed or not), tool results continue the conversation, bad schemas / grammars are 400s."""
from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest
from pydantic import BaseModel, Field

# The fixtures are imported so pytest finds them in this module.
from tests.integration.conftest_server import ServerProcess, server  # noqa: F401

MODEL = "SmolLM2-135M-Instruct.Q4_1"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}}, "required": ["zone"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=150)


# ---- response_format ----------------------------------------------------------------------------


def test_openai_parse_returns_a_validated_pydantic_object(server: ServerProcess):
    completion = server.openai().chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe the city of Paris as JSON."}],
        response_format=City, temperature=0, max_tokens=200)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City), completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "stop"


def test_twenty_json_schema_requests_batched_all_validate(server: ServerProcess):
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": Person.model_json_schema(), "strict": True}}
    names = ["Ada", "Alan", "Grace", "Linus", "Marie", "Isaac", "Nikola", "Rosalind", "Emmy", "Carl"]

    async def one(client, i: int):
        return await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Give a JSON person like {names[i % 10]}, number {i}."}],
            response_format=schema, temperature=0.9, seed=i, max_tokens=120)

    async def main():
        client = server.async_openai()
        return await asyncio.gather(*(one(client, i) for i in range(20)))

    results = asyncio.run(main())
    for resp in results:
        choice = resp.choices[0]
        assert choice.finish_reason == "stop", choice
        Person.model_validate_json(choice.message.content)


def test_json_object_and_grammar_extensions(server: ServerProcess):
    client = server.openai()
    obj = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Reply with a JSON object with keys name and age for a cat."}],
                                         response_format={"type": "json_object"}, temperature=0, max_tokens=150)
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    yes_no = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=0,
                                       extra_body={"grammar": 'root ::= " " ("yes" | "no")'})
    assert yes_no.choices[0].text in (" yes", " no") and yes_no.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick a color."}],
                                          max_tokens=10, temperature=1.0, seed=1,
                                          extra_body={"guided_choice": ["red", "green", "blue"]})
    assert chat.choices[0].message.content in ("red", "green", "blue")
    digits = client.completions.create(model=MODEL, prompt="My phone number is", max_tokens=20, temperature=0.8, seed=2,
                                       extra_body={"guided_regex": r" \d{3}-\d{4}"})
    import re
    assert re.fullmatch(r" \d{3}-\d{4}", digits.choices[0].text)


@pytest.mark.parametrize("path, body, param, reason", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "json_schema", 'Unsupported type "strin"'),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema must be a JSON Schema object"),
    ("/v1/completions", {"grammar": 'root ::= foo'}, "grammar", 'Rule "foo" is not defined'),
    ("/v1/chat/completions", {"grammar": 'root ::= "a" |'}, "grammar", "EBNF parser error"),
    ("/v1/completions", {"guided_regex": "[a-"}, "regex", "Unclosed"),
    ("/v1/chat/completions", {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in tools"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
     "properties": {"a": {"$ref": "#/missing"}}}}}], "tool_choice": "required"}, "json_schema", "missing"),
    ("/v1/chat/completions", {"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar", "only one of"),
    ("/v1/chat/completions", {"tools": [WEATHER_TOOL], "messages": [{"role": "user", "content": "Hi"},
     {"role": "assistant", "content": None, "tool_calls": ["not a call"]}]}, "messages", "tool_calls[0] must be"),
])
def test_malformed_schema_or_grammar_is_400_with_the_reason(server: ServerProcess, path, body, param, reason):
    base = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    with server.http() as client:
        resp = client.post(path, json={**base, "max_tokens": 5, **body})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert reason in error["message"] and error["param"] == param, error
        ok = client.post(path, json={**base, "max_tokens": 2})  # the server carries on
        assert ok.status_code == 200, ok.text


# ---- tools ----------------------------------------------------------------------------------------


def test_tool_choice_required_then_tool_result_continues(server: ServerProcess):
    client = server.openai()
    first = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL, TIME_TOOL],
                                           tool_choice="required", temperature=0, max_tokens=120)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name in ("get_weather", "get_time") and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    expected = {"city", "unit"} if call.function.name == "get_weather" else {"zone"}
    assert set(args) == expected
    follow = client.chat.completions.create(model=MODEL, tools=[WEATHER_TOOL, TIME_TOOL], temperature=0, max_tokens=30,
                                            messages=[*ASK_WEATHER, choice.message.model_dump(exclude_none=True),
                                                      {"role": "tool", "tool_call_id": call.id, "content": "22 degrees, sunny"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert follow.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


def test_named_function_and_parallel_calls_flag(server: ServerProcess):
    client = server.openai()
    named = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL, TIME_TOOL], temperature=0, max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = named.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    assert isinstance(json.loads(calls[0].function.arguments)["zone"], str)
    single = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL, TIME_TOOL],
                                            tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                            seed=5, max_tokens=120)
    assert len(single.choices[0].message.tool_calls) == 1


def test_streamed_tool_calls_reassemble_into_the_non_streamed_call(server: ServerProcess):
    client = server.openai()
    kwargs = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
                  temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for frag in c.delta.tool_calls or []:
                entry = calls.setdefault(frag.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = frag.id or entry["id"]
                if frag.function is not None:
                    entry["name"] += frag.function.name or ""
                    entry["arguments"] += frag.function.arguments or ""
    assert finish == whole.finish_reason == "tool_calls"
    streamed = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    assert streamed == [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert all(calls[i]["id"].startswith("call_") for i in calls)


def test_tool_choice_auto_reply_is_text_or_a_valid_call(server: ServerProcess):
    # A 135M model decides unreliably; what is guaranteed: a reply that is a call names a declared
    # tool with JSON arguments, and one that is not keeps its text and a normal finish reason.
    resp = server.openai().chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL],
                                                   temperature=0, max_tokens=60)
    choice = resp.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        assert all(c.function.name == "get_weather" and json.loads(c.function.arguments) is not None
                   for c in choice.message.tool_calls)
    else:
        assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
    none = server.openai().chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL],
                                                   tool_choice="none", temperature=0, max_tokens=20)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")


# ---- LangChain ------------------------------------------------------------------------------------


def _langchain(srv: ServerProcess):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=150,
                      max_retries=0, timeout=120)


def test_langchain_with_structured_output(server: ServerProcess):
    result = _langchain(server).with_structured_output(City).invoke("Describe the city of Rome.")
    assert isinstance(result, City)


def test_langchain_bind_tools_required_then_tool_message(server: ServerProcess):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return f"22 degrees and sunny in {city}"

    llm = _langchain(server)
    question = HumanMessage("What is the weather in Berlin?")
    ai = llm.bind_tools([get_weather], tool_choice="required").invoke([question])
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    assert isinstance(ai.tool_calls[0]["args"]["city"], str)
    result = ToolMessage(get_weather.invoke(ai.tool_calls[0]["args"]), tool_call_id=ai.tool_calls[0]["id"])
    reply = llm.bind_tools([get_weather]).invoke([question, ai, result])
    assert reply.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    assert isinstance(reply.content, str)

"""Constrained decoding and tools from the Python API (LLM.chat / AsyncLLM.chat / SamplingParams)
on the embedded model, on both backends: output always parses and validates."""
from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import pytest
from pydantic import BaseModel, Field

import cllm
from cllm.sampling.params import SamplingParams

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}}}


class Pet(BaseModel):
    name: str = Field(max_length=30)
    kind: Literal["cat", "dog", "bird"]
    age: int = Field(ge=0, le=40)


@pytest.fixture(scope="module", params=["llama_cpp", "torch"])
def llm(request):
    settings = dict(n_threads=1, n_ctx=4096, n_seq_max=4)
    if request.param == "torch":
        settings.update(dtype="float32", device="cpu")
    with cllm.LLM(backend=request.param, **settings) as engine:
        yield engine


def test_response_format_model_validates_for_every_choice(llm):
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=80)
    out = llm.chat([{"role": "user", "content": "Describe a pet as JSON."}], params, response_format=Pet)[0]
    assert len(out.outputs) == 3
    for choice in out.outputs:
        assert choice.finish_reason == "stop", choice.text
        Pet.model_validate_json(choice.text)


def test_sampling_params_constraints_batched_with_free_requests(llm):
    prompts = ["The answer is", "My favourite colour is", "Count: one, two,"]
    params = [SamplingParams(temperature=0.7, seed=1, max_tokens=12, regex=r" [0-9]{2,4}"),
              SamplingParams(temperature=0, max_tokens=8),
              SamplingParams(temperature=0.7, seed=2, max_tokens=8, choice=[" three", " four"])]
    outs = llm.generate(prompts, params)
    assert re.fullmatch(r" [0-9]{2,4}", outs[0].outputs[0].text)
    assert outs[1].outputs[0].finish_reason in ("stop", "length")
    assert outs[2].outputs[0].text in (" three", " four")


def test_chat_tool_choice_required_gives_a_parsed_call(llm):
    out = llm.chat([{"role": "user", "content": "Weather in Madrid?"}], SamplingParams(temperature=0, max_tokens=80),
                   tools=[WEATHER_TOOL], tool_choice="required")[0]
    choice = out.outputs[0]
    assert choice.finish_reason == "tool_calls" and choice.tool_calls
    assert choice.tool_calls[0].name == "get_weather"
    assert isinstance(json.loads(choice.tool_calls[0].arguments)["city"], str)


def test_async_chat_streams_json_schema_and_gives_tool_calls():
    schema = {"type": "json_schema", "json_schema": {"name": "pet", "schema": Pet.model_json_schema()}}

    async def main():
        engine = cllm.AsyncLLM(n_threads=1, n_ctx=2048, n_seq_max=2)
        try:
            pieces, final = [], None
            async for out in engine.chat([{"role": "user", "content": "A pet, as JSON."}],
                                         SamplingParams(temperature=0, max_tokens=80), response_format=schema):
                pieces.append(out.outputs[0].text_delta)
                final = out
            calls = None
            async for out in engine.chat([{"role": "user", "content": "Weather in Oslo?"}],
                                         SamplingParams(temperature=0, max_tokens=80), tools=[WEATHER_TOOL],
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}}):
                calls = out.outputs[0].tool_calls
            return "".join(pieces), final, calls
        finally:
            await engine.shutdown()

    streamed, final, calls = asyncio.run(main())
    assert streamed == final.outputs[0].text and final.finished
    Pet.model_validate_json(streamed)
    assert [c.name for c in calls] == ["get_weather"] and isinstance(json.loads(calls[0].arguments)["city"], str)


def test_bad_response_format_and_tools_raise_value_error(llm):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="invalid response_format"):
        llm.chat(msgs, response_format={"type": "yaml"})
    with pytest.raises(ValueError, match="invalid json_schema=.*does not compile"):
        llm.chat(msgs, response_format={"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}})
    with pytest.raises(ValueError, match="invalid tool_choice"):
        llm.chat(msgs, tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "other"}})

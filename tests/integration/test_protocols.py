"""OpenAI's Responses API and Anthropic's Messages API through `cllm serve` on the embedded model,
driven by the official clients (openai, anthropic) and by the OpenAI Agents SDK: text, streaming,
a forced function call and its output fed back, json_schema parsed by responses.parse, two turns
through previous_response_id, forced tool_use and a tool_result turn, count_tokens."""
from __future__ import annotations

import json

import anthropic
import pytest
from pydantic import BaseModel, Field

from cllm.stress.server_process import ServerProcess, finish_server, start_server

MODEL = "SmolLM2-135M-Instruct.Q4_1"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"]}}
WEATHER_ANT = {"name": "get_weather", "description": "Current weather in a city",
               "input_schema": WEATHER["parameters"]}


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=150)


@pytest.fixture(scope="module")
def server():
    srv = start_server("--n-seq-max", "4", "--n-ctx", "8192", "--log-level", "info")
    yield srv
    finish_server(srv)


def _ant(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60.0)


# ---- Responses -----------------------------------------------------------------------------------


def test_responses_create_and_stream_give_the_same_greedy_text(server: ServerProcess):
    client = server.openai()
    kwargs = {"model": MODEL, "input": "Name three colors.", "instructions": "Answer briefly.",
              "temperature": 0, "max_output_tokens": 24}
    made = client.responses.create(**kwargs)
    assert made.status in ("completed", "incomplete") and made.output_text.strip()
    assert made.usage.input_tokens > 0 and 0 < made.usage.output_tokens <= 24
    with client.responses.stream(**kwargs) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == made.output_text
    assert final.usage.output_tokens == made.usage.output_tokens


def test_responses_forced_function_call_and_its_output_fed_back(server: ServerProcess):
    client = server.openai()
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    made = client.responses.create(model=MODEL, input=ask, tools=[WEATHER],
                                   tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=80)
    calls = [item for item in made.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", made.output
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    with client.responses.stream(model=MODEL, input=ask, tools=[WEATHER], tool_choice="required",
                                 max_output_tokens=80) as stream:
        done = [e for e in stream if e.type == "response.function_call_arguments.done"]
        final = stream.get_final_response()
    assert len(done) >= 1 and [i.type for i in final.output].count("function_call") == len(done)
    answer = client.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=40, input=[
        *ask, {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "22 C and sunny"}])
    assert answer.status in ("completed", "incomplete") and answer.output[-1].type in ("message", "function_call")


def test_responses_parse_json_schema(server: ServerProcess):
    parsed = server.openai().responses.parse(model=MODEL, input="Give a JSON person named Ada.", text_format=Person,
                                             temperature=0, max_output_tokens=80)
    assert isinstance(parsed.output_parsed, Person), parsed.output_text


def test_responses_two_turns_through_previous_response_id(server: ServerProcess):
    client = server.openai()
    first = client.responses.create(model=MODEL, input="My name is Ada.", temperature=0, max_output_tokens=16)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=16)
    # The second prompt holds the first turn, its answer and the new question.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).output_text == second.output_text
    client.responses.delete(first.id)
    with pytest.raises(Exception) as err:
        client.responses.create(model=MODEL, input="again", previous_response_id=first.id)
    assert getattr(err.value, "status_code", None) == 404


def test_agents_sdk_runs_a_function_tool(server: ServerProcess):
    import agents  # the test extra (openai-agents): missing is a failure, not a skip
    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=server.async_openai())
    agent = agents.Agent(name="weather", instructions="Use the tool to answer.", tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=80),
                         tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?")
    assert calls and result.final_output == f"sunny in {calls[0]}"


# ---- Anthropic Messages -----------------------------------------------------------------------


def test_messages_create_and_stream_give_the_same_greedy_text(server: ServerProcess):
    client = _ant(server)
    # anthropic 2.x has no temperature argument any more (its models choose); cllm still reads it.
    kwargs = {"model": MODEL, "max_tokens": 24, "system": "Answer briefly.", "extra_body": {"temperature": 0},
              "messages": [{"role": "user", "content": "Name three colors."}]}
    made = client.messages.create(**kwargs)
    assert made.stop_reason in ("end_turn", "max_tokens") and made.content[0].type == "text"
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == made.content[0].text
    assert final.stop_reason == made.stop_reason and final.usage.output_tokens == made.usage.output_tokens


def test_messages_forced_tool_use_then_tool_result(server: ServerProcess):
    client = _ant(server)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    made = client.messages.create(model=MODEL, max_tokens=80, tools=[WEATHER_ANT], messages=ask,
                                  tool_choice={"type": "tool", "name": "get_weather"})
    assert made.stop_reason == "tool_use"
    use = [b for b in made.content if b.type == "tool_use"][0]
    assert use.name == "get_weather" and isinstance(use.input["city"], str)
    with client.messages.stream(model=MODEL, max_tokens=80, tools=[WEATHER_ANT], messages=ask,
                                tool_choice={"type": "any"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and any(b.type == "tool_use" for b in final.content)
    answer = client.messages.create(model=MODEL, max_tokens=40, tools=[WEATHER_ANT], messages=[
        *ask, {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "22 C and sunny"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content


def test_messages_count_tokens(server: ServerProcess):
    client = _ant(server)
    messages = [{"role": "user", "content": "Count these tokens, please."}]
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages, tools=[WEATHER_ANT])
    made = client.messages.create(model=MODEL, max_tokens=2, system="Be brief.", messages=messages, tools=[WEATHER_ANT])
    assert counted.input_tokens == made.usage.input_tokens + (made.usage.cache_read_input_tokens or 0) > 0


def test_messages_errors_are_anthropic_shaped(server: ServerProcess):
    client = _ant(server)
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert err.value.body["type"] == "error" and "messages.0.content.0: image is not" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nonexistent", max_tokens=10, messages=[{"role": "user", "content": "x"}])


# ---- speculative decoding, per request -----------------------------------------------------------

COPY = ("Repeat the following text exactly: The quick brown fox jumps over the lazy dog, and the lazy dog "
        "sleeps by the quiet river bank all day long.")


def _drafted(server: ServerProcess) -> float:
    """Draft tokens the server's engine has verified so far (/metrics)."""
    text = server.http().get("/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("cllm_spec_decode_num_draft_tokens_total{model="))
    return float(line.split()[-1])


def test_speculative_false_turns_drafting_off_on_every_endpoint():
    """On a server of its own with n-gram speculation on (the shared one runs the default, off; and a
    planner that has measured its step costs may rightly propose nothing), drafting is off for a copying request that says
    ``"speculative": false`` on each of the four generation endpoints, and on for the same request
    without the field: the planner explores while it has measured only one step size, and the four
    requests without drafts run only one-token decode steps."""
    chat_msgs = [{"role": "user", "content": COPY}]
    bodies = {
        "/v1/completions": {"prompt": COPY + "\n", "max_tokens": 40, "temperature": 0},
        "/v1/chat/completions": {"messages": chat_msgs, "max_tokens": 40, "temperature": 0},
        "/v1/responses": {"input": COPY, "max_output_tokens": 40, "temperature": 0},
        "/v1/messages": {"messages": chat_msgs, "max_tokens": 40, "temperature": 0},
    }
    server = start_server("--n-seq-max", "2", "--n-ctx", "4096", "--speculative", "ngram", "--log-level", "info")
    try:
        with server.http() as http:
            for path, body in bodies.items():
                res = http.post(path, json={"model": MODEL, **body, "speculative": False})
                assert res.status_code == 200, (path, res.text)
                assert _drafted(server) == 0, path
            res = http.post("/v1/chat/completions", json={"model": MODEL, **bodies["/v1/chat/completions"]})
            assert res.status_code == 200
        assert _drafted(server) > 0  # the same request without the field drafts
    finally:
        finish_server(server)

"""Tool calling without a model: tools / tool_choice validation, the parsers of the common formats,
the forced-call schema, message preparation, and streamed calls equal to non-streamed ones."""
from __future__ import annotations

import json

import pytest

from cllm.tools import plan_tools
from cllm.tools.parsers import GenericParser, HermesParser, Llama3JsonParser, MistralParser, parser_for_template
from cllm.tools.stream import ToolCallStream

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NO_TOOLS_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
HERMES_TEMPLATE = "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}{% for m in messages %}{{ m.content }}{% endfor %} <tool_call>"


def calls_of(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


# ---- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tools, choice, match", [
    ("nope", None, "invalid tools="),
    ([{"type": "function", "function": {"name": "bad name!"}}], None, r"tools\[0\].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, r"tools\[0\].function.parameters"),
    ([WEATHER, WEATHER], None, "defined twice"),
    ([WEATHER], "sometimes", "invalid tool_choice='sometimes'"),
    ([WEATHER], {"type": "function", "function": {"name": "missing"}}, "not in tools"),
    (None, "required", "requires tools"),
])
def test_bad_tools_name_the_field(tools, choice, match):
    with pytest.raises(ValueError, match=match):
        plan_tools(tools, choice, None, NO_TOOLS_TEMPLATE)


def test_no_tools_no_plan_and_default_choice_is_auto():
    assert plan_tools(None, None, None, NO_TOOLS_TEMPLATE) is None
    plan = plan_tools([WEATHER], None, None, NO_TOOLS_TEMPLATE)
    assert plan.choice.mode == "auto" and plan.active and not plan.native
    assert plan.forced_schema() is None


# ---- parsers --------------------------------------------------------------------------------------


def test_hermes_parser_reads_calls_and_keeps_text_before():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    parsed = HermesParser().parse(text)
    assert parsed.content == "Let me check."
    assert calls_of(parsed) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_mistral_parser_both_formats_and_dropped_control_token():
    v3 = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    assert calls_of(MistralParser().parse(v3)) == [("get_weather", {"city": "Oslo"})]
    assert calls_of(MistralParser().parse(v3.replace("[TOOL_CALLS]", ""))) == [("get_weather", {"city": "Oslo"})]
    v11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{}'
    assert calls_of(MistralParser().parse(v11)) == [("get_weather", {"city": "Rome"}), ("get_time", {})]


def test_llama3_parser_parameters_key_python_tag_and_semicolons():
    assert calls_of(Llama3JsonParser().parse('{"name": "get_weather", "parameters": {"city": "Lima"}}')) == \
        [("get_weather", {"city": "Lima"})]
    text = '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Quito"}}'
    assert calls_of(Llama3JsonParser().parse(text)) == [("get_time", {}), ("get_weather", {"city": "Quito"})]


def test_generic_parser_and_text_that_is_no_call_stays_content():
    parsed = GenericParser().parse(' {"tool_calls": [{"name": "get_time", "arguments": {}}]}')
    assert calls_of(parsed) == [("get_time", {})] and parsed.content is None
    for text in ("The weather is nice.", '{"answer": 42}', '{"tool_calls": [{"name": "x"', "<tool_call>{broken"):
        assert GenericParser().parse(text).tool_calls == [] and GenericParser().parse(text).content == text
        assert HermesParser().parse(text).tool_calls == []


def test_parser_chosen_from_template():
    assert parser_for_template(HERMES_TEMPLATE) == "hermes"
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("{% if m.role == 'ipython' %}{% endif %}") == "llama3_json"
    assert parser_for_template(NO_TOOLS_TEMPLATE) == "generic"
    assert plan_tools([WEATHER], None, None, HERMES_TEMPLATE).native
    assert plan_tools([WEATHER], None, None, HERMES_TEMPLATE, "generic").native is False  # config override


# ---- forced calls and messages -----------------------------------------------------------------


def test_forced_schema_required_and_named():
    required = plan_tools([WEATHER, TIME], "required", None, NO_TOOLS_TEMPLATE).forced_schema()
    calls = required["properties"]["tool_calls"]
    assert calls["minItems"] == 1 and calls["maxItems"] == 4
    assert [i["properties"]["name"]["enum"] for i in calls["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    single = plan_tools([WEATHER, TIME], "required", False, NO_TOOLS_TEMPLATE).forced_schema()
    assert single["properties"]["tool_calls"]["maxItems"] == 1
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None, NO_TOOLS_TEMPLATE)
    item = named.forced_schema()["properties"]["tool_calls"]["items"]
    assert item["properties"]["name"]["enum"] == ["get_weather"]
    assert item["properties"]["arguments"] == WEATHER["function"]["parameters"]


def test_generic_messages_describe_tools_and_earlier_calls():
    plan = plan_tools([WEATHER], "auto", None, NO_TOOLS_TEMPLATE)
    msgs = plan.prepare_messages([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ])
    assert msgs[0]["role"] == "system" and "get_weather" in msgs[0]["content"] and '"tool_calls"' in msgs[0]["content"]
    assert json.loads(msgs[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    assert "tool_calls" not in msgs[2] and msgs[3] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    assert plan_tools([WEATHER], "none", None, NO_TOOLS_TEMPLATE).prepare_messages([{"role": "user", "content": "x"}]) == \
        [{"role": "user", "content": "x"}]


def test_native_messages_keep_calls_with_object_arguments():
    plan = plan_tools([WEATHER], "auto", None, HERMES_TEMPLATE)
    assert plan.template_tools() == [WEATHER]
    msg = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    out = plan.prepare_messages([msg])
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'  # the caller's copy untouched


# ---- streaming ----------------------------------------------------------------------------------


def _stream(plan, text: str, step: int) -> tuple[str, list]:
    stream = ToolCallStream(plan)
    content = "".join(stream.feed(text[i:i + step]) for i in range(0, len(text), step))
    rest, calls = stream.finish()
    return content + rest, calls


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_streamed_calls_equal_non_streamed(step):
    plan = plan_tools([WEATHER, TIME], "auto", None, HERMES_TEMPLATE)
    text = 'Checking <tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern"}}\n</tool_call>'
    content, calls = _stream(plan, text, step)
    whole = plan.parse(text)
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    assert content.strip() == whole.content == "Checking"


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_streamed_text_without_call_is_all_content(step):
    plan = plan_tools([WEATHER], "auto", None, HERMES_TEMPLATE)
    text = "No tools needed: a <tool_ is not a call"
    assert _stream(plan, text, step) == (text, [])
    generic = plan_tools([WEATHER], "auto", None, NO_TOOLS_TEMPLATE)
    assert _stream(generic, '{"not": "a call"}', step) == ('{"not": "a call"}', [])


def test_forced_stream_holds_everything_until_the_end():
    plan = plan_tools([WEATHER], "required", None, NO_TOOLS_TEMPLATE)
    stream = ToolCallStream(plan)
    text = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Kyiv"}}]}'
    assert all(stream.feed(ch) == "" for ch in text)
    rest, calls = stream.finish()
    assert rest == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Kyiv"})]


# ---- a tool-aware (Qwen 2.5 style) template, rendered --------------------------------------------

QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def test_native_template_renders_tools_and_calls_as_plain_json():
    from cllm.chat_template import ChatTemplate
    from tests.unit.fakes import ByteTokenizer

    class QwenLike(ByteTokenizer):
        @property
        def chat_template(self):
            return QWEN_STYLE

    tool = {"type": "function", "function": {"name": "search", "description": "Find <b>pages</b> & more",
                                             "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
    plan = plan_tools([tool], "auto", None, QWEN_STYLE)
    assert plan.native and plan.parser.name == "hermes"
    messages = plan.prepare_messages([
        {"role": "user", "content": "find cats"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "cats <3"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3 results"},
    ])
    text = ChatTemplate(QwenLike()).render(messages, tools=plan.template_tools())
    assert json.dumps(tool, ensure_ascii=False) in text  # key order and "<", "&" kept
    assert '<tool_call>\n{"name": "search", "arguments": {"q": "cats <3"}}\n</tool_call>' in text
    assert "<tool_response>\n3 results\n</tool_response>" in text
    reply = '<tool_call>\n{"name": "search", "arguments": {"q": "dogs"}}\n</tool_call>'
    assert calls_of(plan.parse(reply)) == [("search", {"q": "dogs"})]


@pytest.mark.parametrize("calls", [["not a call"], [{"function": "x"}], [{"function": {"arguments": "{}"}}], "oops"])
def test_malformed_earlier_calls_are_named_not_crashed_on(calls):
    from cllm.chat_template import normalize_messages

    plan = plan_tools([WEATHER], "auto", None, NO_TOOLS_TEMPLATE)
    messages = plan.prepare_messages([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": calls}])
    with pytest.raises(ValueError, match=r"messages\[2\]\.tool_calls"):
        normalize_messages(messages)

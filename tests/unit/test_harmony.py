"""gpt-oss's harmony channels without a model: the reader (whole and streamed in every chunking,
token by token, markers split across pieces), detection from the template and the vocabulary, the
reply reader over it, control tokens kept in the text by the detokenizer, and the three chat-shaped
protocols over a scripted model whose markers are control tokens."""
from __future__ import annotations

import json
import random
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from cllm.chat_template import ChatTemplate
from cllm.detokenizer import IncrementalDetokenizer
from cllm.sampling.params import SamplingParams
from cllm.server.reasoning import HARMONY, parser_for_template, resolve_format
from cllm.server.reply import ReplyFormat, ReplyStream, read_reply, read_unfinished
from cllm.tools import plan_tools
from cllm.tools import parsers as tool_parsers
from cllm.tools.harmony import MARKERS, HarmonyStream, is_harmony, read_harmony
from tests.unit.fakes import fake_config
from tests.unit.live_server import live_server
from tests.unit.scripted import EOS, HARMONY_CONTROLS, ScriptedBackend, ScriptedTokenizer

GPT_OSS_TEMPLATE = (Path(__file__).parent.parent / "assets/chat_templates/openai-gpt-oss-120b.jinja").read_text()
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ANALYSIS_FINAL = ("<|channel|>analysis<|message|>The user wants the weather.<|end|>"
                  "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>")
ANALYSIS_CALL = ("<|channel|>analysis<|message|>Need the weather tool.<|end|>"
                 '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>')


def _read(text: str, names=("get_weather",), **kw) -> tuple[str, str, list[tuple[str, dict]]]:
    read = read_harmony(text, names, **kw)
    return read.reasoning, read.content, [(c.name, json.loads(c.arguments)) for c in read.calls]


@pytest.mark.parametrize("text, reasoning, content, calls", [
    (ANALYSIS_FINAL, "The user wants the weather.", "It is sunny in Paris.", []),
    (ANALYSIS_CALL, "Need the weather tool.", "", [("get_weather", {"city": "Paris"})]),
    # the recipient in the role part of the header, the content type without <|constrain|> (the template's own form)
    (' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>', "", "",
     [("get_weather", {"city": "Oslo"})]),
    ("<|channel|>final<|message|>Hi!", "", "Hi!", []),  # no <|return|>: it was the EOS token, not in the text
    ("Plain text, no header at all.", "", "Plain text, no header at all.", []),  # text before any header: the answer
    ('{"answer": 42}', "", '{"answer": 42}', []),  # a constrained reply: no markers, untouched
    ("  \n", "", "  \n", []),
    ("to be or not", "", "to be or not", []),  # looked like a leading " to=" recipient for a moment
    ("<|channel|>analysis<|message|>cut off by max_tok", "cut off by max_tok", "", []),
    ("<|channel|>analysis<|mess", "", "", []),  # an unfinished header is dropped
    ("<|channel|>analysis<|message|>a < b and x <| y<|end|>", "a < b and x <| y", "", []),  # "<" alone is text
    # an almost-call is never an error: its body is text of its channel
    ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Pa', "", '{"city": "Pa', []),
    ("<|channel|>commentary to=functions.get_weather json<|message|>[1, 2]<|call|>", "", "[1, 2]", []),
    ('<|channel|>commentary to=functions.launch json<|message|>{"x": 1}<|call|>', "", '{"x": 1}', []),  # undeclared
    ('<|channel|>analysis to=browser.search code<|message|>{"q": "x"}<|call|>', '{"q": "x"}', "", []),  # a built-in tool
    # a preamble and the answer are both content, a paragraph apart; whitespace before a header goes
    ("<|channel|>commentary<|message|>Let me look.<|end|>\n<|start|>assistant<|channel|>final<|message|>Done.",
     "", "Let me look.\n\nDone.", []),
    ("<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>Two.<|end|>",
     "One.\n\nTwo.", "", []),
    ("<|channel|>analysis<|message|>x<|message|>y<|constrain|>z<|end|>", "xyz", "", []),  # stray header markers
    ("Before.<|channel|>final<|message|>After.", "", "Before.\n\nAfter.", []),
])
def test_read(text, reasoning, content, calls):
    assert _read(text) == (reasoning, content, calls)


def test_calls_off_and_reasoning_off():
    assert _read(ANALYSIS_CALL, calls=False) == ("Need the weather tool.", '{"city":"Paris"}', [])
    assert _read(ANALYSIS_FINAL, reasoning=False) == ("", "The user wants the weather.\n\nIt is sunny in Paris.", [])
    assert _read(ANALYSIS_CALL, names=None)[2] == [("get_weather", {"city": "Paris"})]  # None: any name


def _streamed(text: str, cuts: list[int], **kw) -> tuple[str, str, list, list[str], list[str]]:
    stream = HarmonyStream(["get_weather"], **kw)
    bounds = [0, *cuts, len(text)]
    pieces = [stream.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [stream.finish()]
    reasoning = "".join(p.reasoning for p in pieces)
    content = "".join(p.content for p in pieces)
    calls = [(c.name, json.loads(c.arguments)) for c in pieces[-1].calls]
    return reasoning, content, calls, [p.reasoning for p in pieces], [p.content for p in pieces]


TEXTS = [ANALYSIS_FINAL, ANALYSIS_CALL, ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}',
         "Just an answer.", "<|channel|>analysis<|message|>cut <| off", "t<|channel|>final<|message|>x",
         "<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant<|channel|>final<|message|>Done."]


@pytest.mark.parametrize("seed", range(60))
def test_every_chunking_reads_the_same(seed):
    rng = random.Random(seed)
    text = rng.choice(TEXTS)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 20))))
    whole = _read(text)
    reasoning, content, calls, reasoning_deltas, content_deltas = _streamed(text, cuts)
    assert (reasoning, content, calls) == whole
    for deltas, total in ((reasoning_deltas, whole[0]), (content_deltas, whole[1])):
        so_far = ""
        for delta in deltas:  # what was handed out is never taken back, and no piece of a marker is in it
            so_far += delta
            assert total.startswith(so_far)


@pytest.mark.parametrize("text", [ANALYSIS_FINAL, ANALYSIS_CALL])
def test_token_by_token_no_piece_of_a_marker_leaks(text):
    reasoning, content, calls, reasoning_deltas, content_deltas = _streamed(text, list(range(1, len(text))))
    assert (reasoning, content, calls) == _read(text)
    for delta in reasoning_deltas + content_deltas:
        assert "<" not in delta and "|" not in delta
    assert any(reasoning_deltas[:len(text) // 2])  # reasoning streams as it comes, before the reply ends


def test_markers_split_across_pieces():
    pieces = ["<|chan", "nel|>anal", "ysis<|mes", "sage|>Think", "ing.<|", "end|><|st", "art|>assistant<", "|channel|>fi",
              "nal<|message|>An", "swer.<|re", "turn|>"]
    stream = HarmonyStream()
    out = [stream.feed(p) for p in pieces] + [stream.finish()]
    assert "".join(o.reasoning for o in out) == "Thinking." and "".join(o.content for o in out) == "Answer."
    assert [o.reasoning for o in out[:5]] == ["", "", "", "Think", "ing."]


def test_opened_by_the_prompt_starts_in_analysis():
    stream = HarmonyStream(opened=True)
    first = stream.feed("still thinking<|end|><|start|>assistant<|channel|>final<|message|>ok")
    rest = stream.finish()
    assert (first.reasoning + rest.reasoning, first.content + rest.content) == ("still thinking", "ok")


# ---- which models: the template, the vocabulary, the settings ----------------------------------


def test_detected_from_the_gpt_oss_template_and_from_control_tokens():
    assert is_harmony([GPT_OSS_TEMPLATE]) and not is_harmony(["<|message|> only"])
    assert parser_for_template(GPT_OSS_TEMPLATE) == HARMONY
    assert tool_parsers.parser_for_template(GPT_OSS_TEMPLATE) == HARMONY
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert parser_for_template(plain, lambda: ("<|im_end|>",)) == "none"
    assert parser_for_template(plain, lambda: ("<|channel|>", "<|message|>", "<|end|>")) == HARMONY
    fmt = resolve_format("auto", GPT_OSS_TEMPLATE)
    assert fmt is not None and fmt.harmony and fmt.opened_by("<|start|>assistant<|channel|>analysis<|message|>")
    assert not fmt.opened_by("<|start|>assistant")
    assert resolve_format("harmony", None).harmony and resolve_format("none", GPT_OSS_TEMPLATE) is None


def test_plan_renders_tools_natively_and_reads_harmony_calls():
    plan = plan_tools([WEATHER], None, None, GPT_OSS_TEMPLATE)
    assert plan.parser.name == HARMONY and plan.native
    tokenizer = ScriptedTokenizer(GPT_OSS_TEMPLATE, HARMONY_CONTROLS)
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    prompt = ChatTemplate(tokenizer).render(plan.prepare_messages(history), tools=plan.template_tools())
    assert "namespace functions" in prompt and "type get_weather" in prompt and prompt.endswith("<|start|>assistant")
    assert '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>' in prompt
    parsed = plan.parse(ANALYSIS_CALL)
    assert parsed.content is None and [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert plan.parse(ANALYSIS_FINAL).content == "It is sunny in Paris."


# ---- the reply reader ------------------------------------------------------------------------


def _harmony_format(tool_choice=None) -> ReplyFormat:
    plan = plan_tools([WEATHER], tool_choice, None, GPT_OSS_TEMPLATE)
    return ReplyFormat(plan, resolve_format("auto", GPT_OSS_TEMPLATE), False, True)


def test_reply_reader_streamed_equals_whole():
    fmt = _harmony_format()
    whole = read_reply(ANALYSIS_CALL, fmt)
    assert whole.reasoning == "Need the weather tool." and whole.content == ""
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    stream = ReplyStream(fmt)
    deltas = [stream.feed(ch) for ch in ANALYSIS_CALL[:-1]] + [stream.step(ANALYSIS_CALL[-1], "stop")]
    assert "".join(d.reasoning for d in deltas) == whole.reasoning and "".join(d.content for d in deltas) == ""
    assert [c.name for c in deltas[-1].tool_calls] == ["get_weather"]
    assert read_reply(ANALYSIS_FINAL, fmt).content == "It is sunny in Paris."


def test_forced_call_is_read_from_the_content():
    fmt = _harmony_format({"type": "function", "function": {"name": "get_weather"}})
    reply = read_reply('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome"}}]}', fmt)
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("get_weather", '{"city": "Rome"}')]


def test_unfinished_reply_never_shows_markers():
    fmt = _harmony_format()
    reply = read_unfinished("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>final<|message|>Par", fmt)
    assert (reply.reasoning, reply.content, reply.tool_calls) == ("Hmm.", "Par", [])
    assert read_unfinished("<think>raw", ReplyFormat()).content == "<think>raw"  # other formats: as before


# ---- the detokenizer keeps control tokens when asked -------------------------------------------


def test_detokenizer_shows_control_tokens_but_not_the_end():
    tokenizer = ScriptedTokenizer("", HARMONY_CONTROLS)
    ids = tokenizer.encode("<|channel|>final<|message|>Hi") + [EOS]
    shown = IncrementalDetokenizer(tokenizer, skip_special_tokens=False, end_ids=frozenset({EOS}))
    skipped = IncrementalDetokenizer(tokenizer)
    for token in ids:
        shown.add_token(token)
        skipped.add_token(token)
    assert shown.take_delta() == "<|channel|>final<|message|>Hi" and skipped.take_delta() == "finalHi"


def test_skip_special_tokens_is_a_checked_setting():
    assert SamplingParams(skip_special_tokens=False).skip_special_tokens is False
    with pytest.raises(ValueError, match="skip_special_tokens"):
        SamplingParams(skip_special_tokens="no")


# ---- the protocols over a scripted model whose markers are control tokens -----------------------

# No <|channel|> in the template: the model is found harmony by its vocabulary.
FAKE_TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|start|><|assistant|>{% endif %}")
SCRIPT_FINAL = ANALYSIS_FINAL.removesuffix("<|return|>")  # the end token is EOS: the scripted model's own
SCRIPT_CALL = ANALYSIS_CALL.removesuffix("<|call|>")


@pytest.fixture(scope="module")
def served():
    backend = ScriptedBackend(slots=4, max_batch_tokens=512, template=FAKE_TEMPLATE, controls=HARMONY_CONTROLS)
    with live_server(fake_config(n_seq_max=4, n_batch=512, accept_any_model=True), backend) as url:
        yield backend, url


@pytest.fixture()
def oai(served):
    return openai.OpenAI(base_url=f"{served[1]}/v1", api_key="x", max_retries=0, timeout=30)


def _chat_stream(oai, **body) -> tuple[str, str, list, str | None]:
    reasoning = content = ""
    calls: list = []
    finish = None
    for chunk in oai.chat.completions.create(model="m", stream=True, **body):
        for choice in chunk.choices:
            piece = choice.delta.content or ""
            assert "<|" not in piece and "|>" not in piece
            content += piece
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.parametrize("split", [False, True])
def test_chat_channels(served, oai, split):
    # split: the markers arrive as characters, not as control tokens (a marker across many deltas)
    served[0].set_script((SCRIPT_FINAL, False) if split else SCRIPT_FINAL)
    plain = oai.chat.completions.create(model="m", messages=MESSAGES).choices[0]
    assert plain.message.content == "It is sunny in Paris." and plain.finish_reason == "stop"
    assert plain.message.model_extra["reasoning_content"] == "The user wants the weather."
    assert _chat_stream(oai, messages=MESSAGES)[:2] == ("The user wants the weather.", "It is sunny in Paris.")


def test_chat_tool_call(served, oai):
    served[0].set_script(SCRIPT_CALL)
    plain = oai.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER]).choices[0]
    assert plain.finish_reason == "tool_calls" and plain.message.content is None
    assert plain.message.model_extra["reasoning_content"] == "Need the weather tool."
    (call,) = plain.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    reasoning, content, calls, finish = _chat_stream(oai, messages=MESSAGES, tools=[WEATHER])
    assert (reasoning, content, finish) == ("Need the weather tool.", "", "tool_calls")
    assert calls[0].function.name == "get_weather" and json.loads(calls[1].function.arguments) == {"city": "Paris"}
    # without tools the same reply is no call: the arguments are text of the commentary channel
    plain = oai.chat.completions.create(model="m", messages=MESSAGES).choices[0]
    assert plain.finish_reason == "stop" and plain.message.content == '{"city":"Paris"}' and not plain.message.tool_calls


def test_chat_cut_off_in_analysis(served, oai):
    served[0].set_script(SCRIPT_FINAL)
    # <|channel|>, "analysis" (8 characters), <|message|>, then 7 characters of the analysis
    plain = oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=17).choices[0]
    assert plain.finish_reason == "length" and plain.message.content == ""
    assert plain.message.model_extra["reasoning_content"] == "The use"
    reasoning, content, _, finish = _chat_stream(oai, messages=MESSAGES, max_tokens=17)
    assert (reasoning, content, finish) == ("The use", "", "length")


def test_completions_still_drop_control_tokens(served):
    served[0].set_script(SCRIPT_FINAL)
    body = {"model": "m", "prompt": "<|assistant|>", "max_tokens": 64}
    text = httpx.post(f"{served[1]}/v1/completions", json=body).json()["choices"][0]["text"]
    assert "<|" not in text and text.startswith("analysisThe user")


def test_responses_and_messages(served, oai):
    served[0].set_script(SCRIPT_CALL)
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    made = oai.responses.create(model="m", input="Weather in Paris?", tools=[tool])
    assert [i.type for i in made.output] == ["reasoning", "function_call"]
    assert made.output[0].content[0].text == "Need the weather tool." and made.output[1].name == "get_weather"
    ant = anthropic.Anthropic(base_url=served[1], api_key="x", max_retries=0, timeout=30)
    message = ant.messages.create(model="m", max_tokens=200, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                  tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}])
    assert [b.type for b in message.content] == ["thinking", "tool_use"] and message.stop_reason == "tool_use"
    assert message.content[1].input == {"city": "Paris"}
    served[0].set_script(SCRIPT_FINAL)
    with oai.responses.stream(model="m", input="Weather in Paris?") as stream:
        final = stream.get_final_response()
    assert final.output[0].content[0].text == "The user wants the weather." and final.output_text == "It is sunny in Paris."


def test_all_markers_known():
    assert set(HARMONY_CONTROLS) == set(MARKERS)


def test_reasoning_parser_none_keeps_analysis_as_content_without_markers():
    backend = ScriptedBackend(slots=2, max_batch_tokens=512, template=FAKE_TEMPLATE, controls=HARMONY_CONTROLS)
    backend.set_script(SCRIPT_FINAL)
    config = fake_config(n_seq_max=2, n_batch=512, accept_any_model=True, reasoning_parser="none")
    with live_server(config, backend) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)
        plain = client.chat.completions.create(model="m", messages=MESSAGES).choices[0].message
        assert plain.content == "The user wants the weather.\n\nIt is sunny in Paris."
        assert plain.model_extra.get("reasoning_content") is None
        assert _chat_stream(client, messages=MESSAGES)[:2] == ("", plain.content)

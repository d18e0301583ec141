"""The reasoning splitter and the reply reader without a server: markers, partial markers held back,
an opened block, truncation, every chunking giving the same split, tool calls after thinking."""
from __future__ import annotations

import json
import random

import pytest

from cllm.server.reasoning import MARKERS, ReasoningSplitter, parser_for_template, resolve_format, split_reasoning
from cllm.server.reply import ReplyFormat, ReplyStream, read_reply
from cllm.tools import plan_tools

THINK = resolve_format("deepseek_r1", None)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HERMES_TEMPLATE = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %} <tool_call>"


def _streamed(text: str, fmt, *, opened: bool = False, cuts: list[int] | None = None) -> tuple[str, str, list[str]]:
    """(reasoning, content, content deltas) of ``text`` fed in pieces cut at ``cuts``."""
    splitter = ReasoningSplitter(fmt, opened=opened)
    bounds = [0, *(cuts or []), len(text)]
    reasoning, content, deltas = "", "", []
    for a, b in zip(bounds, bounds[1:]):
        d = splitter.feed(text[a:b])
        reasoning += d.reasoning
        content += d.content
        deltas.append(d.content)
    d = splitter.finish()
    return reasoning + d.reasoning, content + d.content, [*deltas, d.content]


@pytest.mark.parametrize("text, opened, reasoning, content", [
    ("<think>\nLet me see.\n</think>\n\nThe answer is 4.", False, "Let me see.", "The answer is 4."),
    ("  <think>a</think>b", False, "a", "b"),
    ("Let me see.\n</think>\n\n4", True, "Let me see.", "4"),
    ("The answer is 4.", False, "", "The answer is 4."),
    ("  The answer", False, "", "  The answer"),  # a reply without reasoning is untouched
    ("4 <think>no</think>", False, "", "4 <think>no</think>"),  # only a leading block is reasoning
    ("<think>cut off by max_tok", False, "cut off by max_tok", ""),
    ("still thinking", True, "still thinking", ""),
    ("<thi", False, "", "<thi"),  # ended inside what looked like a marker: content after all
    ("<think></think>answer", False, "", "answer"),
    ("", False, "", ""),
])
def test_split(text, opened, reasoning, content):
    whole = split_reasoning(text, THINK, opened=opened)
    assert (whole.reasoning, whole.content) == (reasoning, content)


@pytest.mark.parametrize("seed", range(40))
def test_every_chunking_gives_the_same_split(seed):
    rng = random.Random(seed)
    text = rng.choice([
        "<think>\nStep 1: a < b.\nStep 2: </thin is not the end.\n</think>\n\nDone: x </think> y",
        "Plain answer with <think> inside and </think> too",
        "\n\n<think>short</think>",
        "<think>unfinished <",
    ])
    whole = split_reasoning(text, THINK)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    reasoning, content, deltas = _streamed(text, THINK, cuts=cuts)
    assert (reasoning, content) == (whole.reasoning, whole.content)
    so_far = ""
    for delta in deltas:  # what was handed out is never taken back
        so_far += delta
        assert whole.content.startswith(so_far)


def test_character_by_character_stream_holds_markers_back():
    text = "<think>abc</think>xyz"
    splitter = ReasoningSplitter(THINK)
    pieces = [splitter.feed(ch) for ch in text]
    assert "".join(p.reasoning for p in pieces) == "abc"
    assert all("<" not in p.content and ">" not in p.content for p in pieces)
    assert "".join(p.content for p in pieces) + splitter.finish().content == "xyz"


@pytest.mark.parametrize("name", sorted(MARKERS))
def test_every_parser_splits_its_markers(name):
    fmt = resolve_format(name, None)
    split = split_reasoning(f"{fmt.start}thinking{fmt.end}answer", fmt)
    assert (split.reasoning, split.content) == ("thinking", "answer")


def test_parser_from_template_and_settings():
    assert parser_for_template("{{ '<think>\\n' }}...{{ '</think>' }}") == "deepseek_r1"
    assert parser_for_template("[THINK]x[/THINK]") == "mistral"
    assert parser_for_template("<seed:think>") == "seed_oss"
    assert parser_for_template("◁think▷ ◁/think▷") == "kimi"
    assert parser_for_template("{% for m in messages %}{{ m.content }}{% endfor %}") == "none"
    assert parser_for_template(None) == "none"
    assert resolve_format("auto", "plain") is None and resolve_format("none", "</think>") is None
    assert resolve_format("auto", "</think>").start == "<think>"
    with pytest.raises(ValueError, match="reasoning_parser"):
        resolve_format("bogus", None)


def test_opened_block_is_seen_from_the_prompt_tail():
    assert THINK.opened_by("<|im_start|>assistant\n<think>\n")
    assert not THINK.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3 thinking off
    assert not THINK.opened_by("<|im_start|>assistant\n")


@pytest.mark.parametrize("step", [1, 2, 3, 5, 100])
def test_tool_calls_after_thinking_parse_streamed_and_not(step):
    plan = plan_tools([WEATHER], None, None, HERMES_TEMPLATE)
    fmt = ReplyFormat(plan, THINK)
    text = '<think>I should call get_weather for <tool_call> Paris.</think>\n\nChecking.\n' \
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    whole = read_reply(text, fmt)
    assert whole.reasoning == "I should call get_weather for <tool_call> Paris."
    assert whole.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [("get_weather", {"city": "Paris"})]
    stream = ReplyStream(fmt)
    reasoning = content = ""
    for i in range(0, len(text), step):
        d = stream.feed(text[i:i + step])
        reasoning, content = reasoning + d.reasoning, content + d.content
        assert "<tool_call>" not in d.content
    end = stream.finish()
    assert reasoning + end.reasoning == whole.reasoning
    assert content + end.content == whole.content
    assert [(c.name, c.arguments) for c in end.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]


def test_no_reasoning_format_leaves_text_alone():
    reply = read_reply("<think>x</think>y", ReplyFormat())
    assert reply.reasoning is None and reply.content == "<think>x</think>y" and reply.tool_calls == []

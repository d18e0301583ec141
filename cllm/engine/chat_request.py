"""A chat request with tools / response_format, shared by LLM.chat and AsyncLLM.chat (the server
does the same steps with its own error mapping): plan the tools, render the prompt, constrain the
params, and read tool calls out of the final output."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cllm.chat_template import normalize_messages
from cllm.multimodal.support import check_images_accepted
from cllm.outputs import RequestOutput
from cllm.sampling.params import SamplingParams
from cllm.structured.response_format import response_format_constraint
from cllm.tools import ToolPlan, plan_tools


@dataclass(slots=True)
class ChatRequest:
    """What a chat call resolves to before generation."""

    prompt_ids: list[int]  # rendered, tokenised conversation
    params: SamplingParams  # the caller's params plus any output constraint
    plan: ToolPlan | None  # the tools, when given


def prepare_chat(engine: Any, messages: Sequence[dict], params: SamplingParams | None, *, tools: Any = None,
                 tool_choice: Any = None, parallel_tool_calls: bool | None = None, response_format: Any = None,
                 add_generation_prompt: bool = True) -> ChatRequest:
    """Resolve a chat call; ValueError names a bad message or image part (``messages[0].content[2]: ...``),
    a model that takes no images, or a bad tools / tool_choice / response_format value."""
    params = params or SamplingParams()
    settings = engine.config.structured
    plan = plan_tools(tools, tool_choice, parallel_tool_calls, engine.tokenizer.chat_template,
                      settings.tool_call_parser, settings.max_parallel_tool_calls)
    constraint = response_format_constraint(response_format)
    forced = plan.forced_schema() if plan is not None else None
    if forced is not None:
        if constraint:
            raise ValueError(f"invalid tool_choice={tool_choice!r}: a forced tool call cannot be combined with response_format")
        constraint = {"json_schema": forced}
    if constraint:
        params = dataclasses.replace(params, **constraint)
    # Images are fetched and decoded here, under the engine's image limits; the template's own
    # normalize_messages then takes the decoded images as they are.
    messages = normalize_messages(messages, images=engine.config.images)
    check_images_accepted(engine, messages)
    convo = plan.prepare_messages(list(messages)) if plan is not None else list(messages)
    template_tools = plan.template_tools() if plan is not None else None
    ids = engine.tokenize_chat(convo, add_generation_prompt, template_tools)
    return ChatRequest(ids, params, plan)


def attach_tool_calls(out: RequestOutput, plan: ToolPlan | None) -> RequestOutput:
    """Parse each finished choice's text for tool calls: ``tool_calls`` set, ``text`` keeps only
    the content, finish_reason "tool_calls"."""
    if plan is None or not plan.active:
        return out
    for choice in out.outputs:
        if choice.finish_reason not in ("stop", "length"):
            continue
        parsed = plan.parse(choice.text)
        if parsed.tool_calls:
            choice.tool_calls = parsed.tool_calls
            choice.text = parsed.content or ""
            choice.finish_reason = "tool_calls"
    return out

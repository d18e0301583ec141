"""Tool (function) calling: OpenAI tool definitions in, the chat template or an injected system
message describing them, tool calls parsed out of the model's text (or forced with a JSON schema).
"""
from __future__ import annotations

from cllm.tools.plan import ToolPlan, plan_tools
from cllm.tools.spec import ToolCall, ToolChoice, ToolFunction

__all__ = ["ToolCall", "ToolChoice", "ToolFunction", "ToolPlan", "plan_tools"]

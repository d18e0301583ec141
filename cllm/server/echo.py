"""``echo: true`` on /v1/completions: the prompt's text (and its tokens' logprobs) before each choice's output.

Evaluation harnesses (lm-eval-harness's loglikelihood tasks) send a context plus
continuation with ``echo: true, logprobs: k, max_tokens: 0`` and read the
continuation tokens' logprobs from the echoed prompt. The first prompt token has
no context: its logprob and top_logprobs are null, as on OpenAI.
"""
from __future__ import annotations

from dataclasses import dataclass

from cllm.backends.base import Tokenizer
from cllm.outputs import RequestOutput
from cllm.server.logprobs import prompt_logprobs
from cllm.server.protocol import CompletionLogprobs


@dataclass(slots=True, frozen=True)
class Echo:
    """What a choice of one prompt starts with."""

    text: str  # the prompt as the client sent it (token prompts: decoded)
    logprobs: CompletionLogprobs | None  # the prompt tokens' logprobs, when logprobs were asked for


def echo_of(out: RequestOutput, tokenizer: Tokenizer, *, logprobs: int | None) -> Echo:
    """The echo of ``out``'s prompt; its prompt logprobs must be complete when ``logprobs`` is set."""
    text = out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)
    if logprobs is None:
        return Echo(text, None)
    if out.prompt_logprobs is None:
        raise RuntimeError("echo with logprobs: the engine returned no prompt logprobs")
    return Echo(text, prompt_logprobs(out.prompt_logprobs, out.prompt_token_ids, tokenizer, with_top=logprobs > 0))

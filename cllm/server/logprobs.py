"""Engine TokenLogprobs in the two OpenAI shapes (legacy completions, chat)."""
from __future__ import annotations

from collections.abc import Sequence

from cllm.outputs import TokenLogprob
from cllm.server.protocol import ChatChoiceLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs


def completion_logprobs(entries: Sequence[TokenLogprob]) -> CompletionLogprobs:
    """Parallel lists for ``/v1/completions``.

    ``text_offset`` is where each token's text starts in the choice's text, as the engine recorded
    it: summing token strings would count a partial UTF-8 character's U+FFFD stand-ins, and streamed
    chunks would have to carry that sum across chunks. As on OpenAI, each ``top_logprobs`` dict also
    holds the sampled token, so it may have k + 1 entries.
    """
    result = CompletionLogprobs()
    for entry in entries:
        result.tokens.append(entry.token)
        result.token_logprobs.append(entry.logprob)
        top = {alt.token: alt.logprob for alt in entry.top}
        top.setdefault(entry.token, entry.logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(entry.text_offset)
    return result


def chat_logprobs(entries: Sequence[TokenLogprob]) -> ChatChoiceLogprobs:
    """``choices[i].logprobs`` for ``/v1/chat/completions``."""
    return ChatChoiceLogprobs(
        content=[
            ChatTokenLogprob(
                token=e.token,
                logprob=e.logprob,
                bytes=list(e.bytes),
                top_logprobs=[ChatTopLogprob(token=t.token, logprob=t.logprob, bytes=list(t.bytes)) for t in e.top],
            )
            for e in entries
        ]
    )

"""Engine TokenLogprobs in the two OpenAI shapes (legacy completions, chat)."""
from __future__ import annotations

import codecs
import math
from collections.abc import Sequence

from cllm.backends.base import Tokenizer
from cllm.outputs import TokenLogprob
from cllm.server.protocol import ChatChoiceLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs

# What OpenAI reports for a token the model could not produce (logprob -inf): JSON has no -inf, and
# pydantic would write -inf and NaN as null, which clients read as "no logprob" (issue 27 item 12).
IMPOSSIBLE_LOGPROB = -9999.0


def finite_logprob(value: float) -> float:
    """``value`` as a JSON-safe logprob: -inf (a token the constraint or the sampler ruled out) and
    NaN become -9999.0, as on OpenAI; a positive rounding excess is 0."""
    if math.isnan(value) or value == -math.inf:
        return IMPOSSIBLE_LOGPROB
    return min(max(float(value), IMPOSSIBLE_LOGPROB), 0.0)


def _top(entry: TokenLogprob) -> dict[str, float]:
    """An entry's alternatives as OpenAI's legacy dict, holding the sampled token too (k + 1 entries)."""
    top = {alt.token: finite_logprob(alt.logprob) for alt in entry.top}
    top.setdefault(entry.token, finite_logprob(entry.logprob))
    return top


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
        result.token_logprobs.append(finite_logprob(entry.logprob))
        result.top_logprobs.append(_top(entry))
        result.text_offset.append(entry.text_offset)
    return result


def prompt_logprobs(entries: Sequence[TokenLogprob | None], prompt_ids: Sequence[int], tokenizer: Tokenizer,
                    with_top: bool) -> CompletionLogprobs:
    """Echoed prompt tokens' logprobs for ``/v1/completions``. A None entry (the first prompt token: no
    context) has a null logprob and null top_logprobs, as on OpenAI and vLLM; every other entry has
    a number and, as output tokens do, a dict holding at least the token itself.

    ``text_offset`` counts the characters the prompt's bytes before each token decode to, so a token
    that only starts a UTF-8 character shares its offset with the next one (as for output tokens).
    """
    result = CompletionLogprobs()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offset = 0
    for token_id, entry in zip(prompt_ids, entries):
        result.tokens.append(tokenizer.decode([token_id]) if entry is None else entry.token)
        result.token_logprobs.append(None if entry is None else finite_logprob(entry.logprob))
        top = None
        if entry is not None:
            top = _top(entry) if with_top else {entry.token: finite_logprob(entry.logprob)}
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(decoder.decode(tokenizer.token_bytes(token_id)))
    return result


def concat_logprobs(first: CompletionLogprobs, second: CompletionLogprobs, *, shift: int) -> CompletionLogprobs:
    """``second`` appended after ``first``, its text offsets moved ``shift`` characters on (the echoed prompt)."""
    return CompletionLogprobs(
        tokens=first.tokens + second.tokens,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        top_logprobs=first.top_logprobs + second.top_logprobs,
        text_offset=first.text_offset + [o + shift for o in second.text_offset],
    )


def chat_logprobs(entries: Sequence[TokenLogprob]) -> ChatChoiceLogprobs:
    """``choices[i].logprobs`` for ``/v1/chat/completions``."""
    return ChatChoiceLogprobs(
        content=[
            ChatTokenLogprob(
                token=e.token,
                logprob=finite_logprob(e.logprob),
                bytes=list(e.bytes),
                top_logprobs=[ChatTopLogprob(token=t.token, logprob=finite_logprob(t.logprob), bytes=list(t.bytes))
                              for t in e.top],
            )
            for e in entries
        ]
    )

"""Where a request's prompt is tokenised or checked: on the event loop when short, else in a worker thread."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

# A prompt of at most this many token ids or characters is checked or tokenised on the event loop (tens
# of µs): a worker thread's round trip costs more, and in a burst of 256 requests the hand-overs between
# the loop and the pool's threads queued every admission behind the others' (issue 28).
INLINE_PROMPT_LEN = 1024


async def prompt_token_ids(tokenize: Callable[[str | Sequence[int]], list[int]], prompt: str | Sequence[int]) -> list[int]:
    """``tokenize(prompt)``: on the event loop for a prompt of at most INLINE_PROMPT_LEN ids or characters,
    in a worker thread for a longer one, whose tokenising or checking takes a while (issue 9 defect 17)."""
    if isinstance(prompt, (str, list)) and len(prompt) <= INLINE_PROMPT_LEN:
        return tokenize(prompt)
    return await asyncio.to_thread(tokenize, prompt)

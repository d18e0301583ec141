"""Prompt tokenisation as the engine does it (no doubled BOS when the text already starts with one)."""
from __future__ import annotations

from typing import Any


def encode_prompt(tokenizer: Any, text: str, *, add_special: bool = True) -> list[int]:
    """Token ids for ``text``; like the engine, skips adding BOS when a chat template already wrote it."""
    bos = tokenizer.bos_token_id
    starts_with_bos = bos is not None and text.startswith(tokenizer.special_token(bos))
    return list(tokenizer.encode(text, add_special=add_special and not starts_with_bos))


def default_max_tokens(tokenizer: Any, prompt: str | list[int], *, max_model_len: int, limit: int) -> int | None:
    """``max_tokens`` for a request that gave none: what the context leaves, capped at the server limit.

    None when the prompt alone fills the context, so the engine reports that
    with its own context_length_exceeded error.
    """
    num_prompt = len(prompt) if isinstance(prompt, list) else len(encode_prompt(tokenizer, prompt))
    room = max_model_len - num_prompt
    return min(room, limit) if room >= 1 else None

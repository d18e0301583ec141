"""The xgrammar view of a backend's vocabulary: the raw bytes of every token id."""
from __future__ import annotations

from typing import Any

from cllm.backends.base import Tokenizer


def token_bytes_table(tokenizer: Tokenizer) -> list[bytes]:
    """One entry per logits column. Control tokens (empty ``token_bytes`` in both backends) and ids
    past the tokenizer's own vocabulary (padding of the logits) are empty: xgrammar treats empty
    tokens as special, never allowed inside the grammar, so "<|im_end|>" can't appear in a JSON string."""
    table = []
    for token_id in range(tokenizer.vocab_size):
        try:
            table.append(tokenizer.token_bytes(token_id))
        except (ValueError, IndexError, KeyError):
            table.append(b"")
    return table


def tokenizer_info(tokenizer: Tokenizer) -> Any:
    """An ``xgrammar.TokenizerInfo``: raw byte tokens, the logits width, the model's end tokens as
    the stop tokens a finished grammar allows."""
    import xgrammar as xgr

    return xgr.TokenizerInfo(token_bytes_table(tokenizer), xgr.VocabType.RAW, vocab_size=tokenizer.vocab_size,
                             stop_token_ids=sorted(tokenizer.eos_token_ids))

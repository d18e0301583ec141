"""Token ids with their text, as llama-server's ``/tokenize`` gives them when ``with_pieces`` is set."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cllm.server.protocol import TokenPiece


def token_pieces(tokenizer: Any, token_ids: Sequence[int]) -> list[TokenPiece]:
    """One ``{"id", "piece"}`` per token: the piece is the token's text when its bytes are valid UTF-8
    alone, else its byte values (a token holding part of a character, as llama-server sends it)."""
    pieces = []
    for token_id in token_ids:
        raw = tokenizer.token_bytes(token_id)
        try:
            piece: str | list[int] = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        pieces.append(TokenPiece(id=token_id, piece=piece))
    return pieces

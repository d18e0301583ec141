"""The model's own llama.cpp tokenizer behind cllm's Tokenizer interface."""
from __future__ import annotations

import ctypes
from collections.abc import Sequence

import llama_cpp as C

from cllm.backends.base import Tokenizer
from cllm.backends.llama_cpp.native import LlamaModelHandle
from cllm.chat_template import chat_template_setting


class LlamaCppTokenizer(Tokenizer):
    """Tokenises with llama_tokenize; decodes by joining each token's cached byte piece."""

    def __init__(self, *, model: LlamaModelHandle, chat_template: str | None = None) -> None:
        """``chat_template``: the chat_template setting (a file or a template), in place of the GGUF's."""
        self._model = model
        self._vocab = model.vocab
        self._n_vocab = model.n_vocab
        self._pieces: dict[int, bytes] = {}
        self._eog = frozenset(t for t in range(self._n_vocab) if C.llama_vocab_is_eog(self._vocab, t))
        bos = C.llama_vocab_bos(self._vocab)
        self._bos = bos if bos >= 0 else None
        self._template = chat_template_setting(chat_template) or model.chat_template()
        self._controls: tuple[str, ...] | None = None

    @property
    def vocab_size(self) -> int:
        return self._n_vocab

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eog

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def chat_template(self) -> str | None:
        return self._template

    @property
    def control_tokens(self) -> tuple[str, ...]:
        """Tokens llama_tokenize makes from text only with parse_special: CONTROL and UNKNOWN ones
        (USER_DEFINED tokens it parses from any text, so they are not control tokens)."""
        if self._controls is None:
            kinds = C.LLAMA_TOKEN_ATTR_CONTROL | C.LLAMA_TOKEN_ATTR_UNKNOWN
            self._controls = tuple(self.special_token(t) for t in range(self._n_vocab)
                                   if C.llama_vocab_get_attr(self._vocab, t) & kinds)
        return self._controls

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        raw = text.encode("utf-8")
        cap = len(raw) + 8
        buf = (C.llama_token * cap)()
        n = C.llama_tokenize(self._vocab, raw, len(raw), buf, cap, add_special, parse_special)
        if n < 0:  # buffer too small: -n is the size needed
            cap = -n
            buf = (C.llama_token * cap)()
            n = C.llama_tokenize(self._vocab, raw, len(raw), buf, cap, add_special, parse_special)
        if n < 0:
            raise ValueError(f"llama.cpp failed to tokenize a text of {len(raw)} bytes")
        return list(buf[:n])

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._pieces.get(token_id)
        if piece is None:
            if not 0 <= token_id < self._n_vocab:
                raise ValueError(f"token id {token_id} is outside the vocabulary (size {self._n_vocab})")
            piece = self._piece(token_id, special=False)
            self._pieces[token_id] = piece
        return piece

    def decode(self, token_ids: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in token_ids).decode("utf-8", "replace")

    def special_token(self, token_id: int) -> str:
        return self._piece(token_id, special=True).decode("utf-8", "replace")

    def _piece(self, token_id: int, *, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = C.llama_token_to_piece(self._vocab, token_id, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = C.llama_token_to_piece(self._vocab, token_id, buf, len(buf), 0, special)
        return buf.raw[:max(n, 0)]

"""A Hugging Face tokenizer as :class:`cllm.backends.base.Tokenizer`."""
from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from cllm.backends.base import Tokenizer
from cllm.chat_template import chat_template_setting

# End-of-turn markers of common chat formats; each counts as EOS when the vocabulary has it.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>")
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece byte-fallback pieces


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: printable stand-in character -> raw byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class HFTokenizer(Tokenizer):
    """Wraps a transformers tokenizer (fast or slow)."""

    def __init__(self, hf_tokenizer: Any, *, vocab_size: int, extra_eos_ids: Iterable[int] = (),
                 chat_template: str | None = None) -> None:
        """``chat_template``: the chat_template setting (a file or a template), in place of the model's."""
        self._template_setting = chat_template_setting(chat_template)
        self._tok = hf_tokenizer
        self._vocab_size = vocab_size  # the model's logits width, which may exceed len(tokenizer)
        vocab = hf_tokenizer.get_vocab()
        eos = {i for i in extra_eos_ids if i is not None}
        if hf_tokenizer.eos_token_id is not None:
            eos.add(hf_tokenizer.eos_token_id)
        ends = [t for t in END_OF_TURN_TOKENS if t in vocab]
        if "<|return|>" in vocab and "<|call|>" in vocab and "<|end|>" in ends:
            ends.remove("<|end|>")  # harmony (gpt-oss): <|end|> closes a message; <|return|> / <|call|> end the turn
        eos.update(vocab[t] for t in ends)
        self._eos = frozenset(eos)
        decoder = getattr(getattr(hf_tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        added = getattr(hf_tokenizer, "added_tokens_decoder", {}) or {}
        # Control tokens (EOS, <|im_start|> …) stand for no text, as in llama.cpp's pieces: an EOS
        # must not append "<|im_end|>" to the output, nor may a grammar spell text with them.
        self._special = frozenset(hf_tokenizer.all_special_ids) | frozenset(
            i for i, t in added.items() if getattr(t, "special", False))
        self._bytes_of: dict[int, bytes] = {}  # token_bytes, filled as ids are asked for

    @classmethod
    def load(cls, directory: Path, *, gguf_file: str | None, vocab_size: int, extra_eos_ids: Iterable[int] = (),
             chat_template: str | None = None, hf_tokenizer: Any = None) -> HFTokenizer:
        """AutoTokenizer from an HF directory, or from a GGUF file's embedded vocabulary; ``hf_tokenizer``:
        that tokenizer, already loaded (the loader reads a GGUF's vocabulary with its weights)."""
        from transformers import AutoTokenizer

        if hf_tokenizer is None:
            kwargs = {"gguf_file": gguf_file} if gguf_file else {}
            hf_tokenizer = AutoTokenizer.from_pretrained(str(directory), **kwargs)
        return cls(hf_tokenizer, vocab_size=vocab_size, extra_eos_ids=extra_eos_ids, chat_template=chat_template)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def bos_token_id(self) -> int | None:
        return self._tok.bos_token_id

    @property
    def control_tokens(self) -> tuple[str, ...]:
        """The special added tokens: those ``split_special_tokens`` keeps from being parsed."""
        added = getattr(self._tok, "added_tokens_decoder", {}) or {}
        specials = {t.content for t in added.values() if getattr(t, "special", False)}
        return tuple(specials | set(getattr(self._tok, "all_special_tokens", ())))

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        ids = self._tok(text, add_special_tokens=add_special, split_special_tokens=not parse_special)["input_ids"]
        return list(ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """Cached per id: every streamed token asks (the lookup below took several µs a token)."""
        data = self._bytes_of.get(token_id)
        if data is None:
            data = self._bytes_of[token_id] = self._token_bytes(token_id)
        return data

    def _token_bytes(self, token_id: int) -> bytes:
        if token_id in self._special:
            return b""
        piece = self._tok.convert_ids_to_tokens(int(token_id))
        if piece is None:
            return b""
        if self._byte_level:
            table = _byte_level_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
            return piece.encode("utf-8")  # added tokens are stored as plain text
        match = _BYTE_TOKEN.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")  # sentencepiece word-boundary marker

    @property
    def chat_template(self) -> str | None:
        if self._template_setting:
            return self._template_setting
        template = getattr(self._tok, "chat_template", None)
        return template if isinstance(template, str) else None

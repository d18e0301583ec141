"""A scripted backend: the "model" writes a given reply (then EOS), whatever the prompt.

Its tokenizer is character level (printable ASCII and newline) plus a few multi-character special
tokens (``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>``, role markers, gpt-oss's harmony
markers), so a test can make a reply arrive as one marker token or as single characters (a marker
split across tokens). Specials named in ``controls`` are control tokens, as in a real vocabulary:
no bytes of their own (decoding drops them), their text only through ``special_token``.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cllm.backends.base import Tokenizer
from tests.unit.fakes import FakeBackend

_CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
SPECIALS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>",
            "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|return|>", "<|call|>"]
HARMONY_CONTROLS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|return|>", "<|call|>")
EOS = len(_CHARS) + len(SPECIALS)
VOCAB = EOS + 1
ASSISTANT = len(_CHARS) + SPECIALS.index("<|assistant|>")
_UNKNOWN = _CHARS.index("?")

# A Qwen-style template: renders tools (hermes <tool_call> format), "</think>" in its source.
THINKING_TEMPLATE = (
    "{% if tools %}<|system|>Tools: {{ tools | tojson }} Call one as <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    "{# a reply may hold <think>...</think> #}"
)
# DeepSeek-R1 style: the generation prompt opens the reasoning block itself.
OPENED_TEMPLATE = THINKING_TEMPLATE.replace("<|assistant|>{% endif %}", "<|assistant|><think>\n{% endif %}")
PLAIN_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"


class ScriptedTokenizer(Tokenizer):
    def __init__(self, template: str, controls: Sequence[str] = ()) -> None:
        self._template = template
        self._controls = tuple(controls)  # specials that are control tokens

    @property
    def vocab_size(self) -> int:
        return VOCAB

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({EOS})

    @property
    def bos_token_id(self) -> int | None:
        return None

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            special = next((s for s in SPECIALS if parse_special and text.startswith(s, i)), None)
            if special is not None:
                ids.append(len(_CHARS) + SPECIALS.index(special))
                i += len(special)
                continue
            ids.append(_CHARS.index(text[i]) if text[i] in _CHARS else _UNKNOWN)
            i += 1
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        if token_id == EOS:
            return b""
        if token_id < len(_CHARS):
            return _CHARS[token_id].encode()
        special = SPECIALS[token_id - len(_CHARS)]
        return b"" if special in self._controls else special.encode()

    def special_token(self, token_id: int) -> str:
        if len(_CHARS) <= token_id < EOS:
            return SPECIALS[token_id - len(_CHARS)]
        return self.decode([token_id])

    @property
    def control_tokens(self) -> tuple[str, ...]:
        return self._controls

    def decode(self, token_ids: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in token_ids).decode("utf-8", "replace")

    @property
    def chat_template(self) -> str | None:
        return self._template


class ScriptedBackend(FakeBackend):
    """Writes ``script`` after the prompt's last ``<|assistant|>`` token, then EOS."""

    def __init__(self, *, template: str = THINKING_TEMPLATE, controls: Sequence[str] = (), **kwargs) -> None:
        super().__init__(**kwargs)
        self._tok = ScriptedTokenizer(template, controls)  # type: ignore[assignment]
        self.script_ids: list[int] = []
        self.prompts: list[str] = []  # every admitted prompt, decoded, in order

    def admit(self, sequence_id, token_ids, *, reuse_prefix=True):
        admission = super().admit(sequence_id, token_ids, reuse_prefix=reuse_prefix)
        if admission is not None:
            self.prompts.append(self._tok.decode(token_ids))
        return admission

    def set_script(self, *pieces: str | tuple[str, bool]) -> None:
        """The reply: pieces of text; a ``(text, False)`` piece is written character by character
        (its markers are not special tokens)."""
        ids: list[int] = []
        for piece in pieces:
            text, special = piece if isinstance(piece, tuple) else (piece, True)
            ids += self._tok.encode(text, parse_special=special)
        self.script_ids = ids

    def forward_batch(self, flat_ids, positions, sequence_ids, *, logits_for=None, all_logits_for=()) -> np.ndarray:
        super().forward_batch(flat_ids, positions, sequence_ids, logits_for=logits_for)
        wanted = list(dict.fromkeys(sequence_ids)) if logits_for is None else list(logits_for)
        out = np.zeros((len(wanted), VOCAB), dtype=np.float32)
        for row, sid in zip(out, wanted):
            kv = self.kv[sid]
            start = len(kv) - kv[::-1].index(ASSISTANT) if ASSISTANT in kv else len(kv)
            # The generation prompt may add tokens after <|assistant|> (an opened <think>): skip them.
            done = len(kv) - start - self._prompt_tail(kv, start)
            token = self.script_ids[done] if 0 <= done < len(self.script_ids) else EOS
            row[token] = 60.0
        return out

    def _prompt_tail(self, kv: list[int], start: int) -> int:
        tail = self._tok.encode("<think>\n") if "<|assistant|><think>" in (self._tok.chat_template or "") else []
        return len(tail) if kv[start:start + len(tail)] == tail else 0

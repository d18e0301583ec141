"""A fake backend for fast scheduler/engine unit tests (no model).

The "model" counts: the next token after t is (t + 1) % vocab, so every output
is predictable. KV room, slots and failures are configurable.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from cllm.backends.base import Admission, Backend, BackendCapacity, BackendError, Tokenizer
from cllm.config import CllmConfig, load_config

VOCAB = 64
EOS = 63


class ByteTokenizer(Tokenizer):
    """Token i < 60 is the byte 0x61 + i % 26 ('a'..); tokens 60-62 are the 3 bytes of '€'; 63 is EOS."""

    EURO = "€".encode()

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
        return [(ord(c) - 0x61) % 26 for c in text]

    def token_bytes(self, token_id: int) -> bytes:
        if token_id == EOS:
            return b""
        if 60 <= token_id <= 62:
            return self.EURO[token_id - 60:token_id - 59]
        return bytes([0x61 + token_id % 26])

    def decode(self, token_ids: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in token_ids).decode("utf-8", "replace")

    @property
    def chat_template(self) -> str | None:
        return "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


class FakeBackend(Backend):
    """Slots + a KV budget in tokens + a counting model; records every batch."""

    name = "fake"
    supports_prefix_cache = False
    supports_state_swap = True
    supports_embeddings = True

    def __init__(self, *, slots: int = 4, kv_tokens: int = 10_000, max_batch_tokens: int = 64,
                 max_model_len: int = 4096, forward_sleep_s: float = 0.0) -> None:
        self._cap = BackendCapacity(slots, max_batch_tokens, max_model_len, kv_tokens)
        self._tok = ByteTokenizer()
        self.held: dict[str, int] = {}  # sequence -> KV tokens reserved
        self.kv: dict[str, list[int]] = {}  # sequence -> tokens evaluated
        self.batches: list[tuple[list[int], list[int], list[str]]] = []
        self.fail_when: set[str] = set()  # sequences whose batches fail
        self.released: list[str] = []
        self.dropped_cache: list[str] = []  # released with keep_cache=False
        self.no_reuse: list[str] = []  # admitted with reuse_prefix=False
        self.embed_calls: list[list[list[int]]] = []  # inputs of each embed() call
        # A real forward pass (llama_decode, torch ops) releases the GIL for its whole length; a fake one
        # that never does lets a pure-Python engine thread starve the caller's event loop for seconds.
        self.forward_sleep_s = forward_sleep_s

    @property
    def capacity(self) -> BackendCapacity:
        return self._cap

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tok

    def admit(self, sequence_id: str, token_ids: Sequence[int], *, reuse_prefix: bool = True) -> Admission | None:
        if len(self.held) >= self._cap.max_num_seqs:
            return None
        if not reuse_prefix:
            self.no_reuse.append(sequence_id)
        self.held[sequence_id] = 0
        self.kv[sequence_id] = []
        return Admission(0)

    def reserve(self, sequence_id: str, num_tokens: int) -> bool:
        others = sum(v for k, v in self.held.items() if k != sequence_id)
        if others + num_tokens > self._cap.kv_tokens:
            return False
        self.held[sequence_id] = max(self.held[sequence_id], num_tokens)
        return True

    def forward_batch(self, flat_ids, positions, sequence_ids, *, logits_for=None, all_logits_for=()) -> np.ndarray:
        self.batches.append((list(flat_ids), list(positions), list(sequence_ids)))
        if self.forward_sleep_s:
            time.sleep(self.forward_sleep_s)
        if self.fail_when & set(sequence_ids):
            raise BackendError("injected failure", sorted(set(sequence_ids)))
        last: dict[str, int] = {}
        for tok, pos, sid in zip(flat_ids, positions, sequence_ids):
            assert pos == len(self.kv[sid]), f"{sid}: position {pos} but KV holds {len(self.kv[sid])}"
            self.kv[sid].append(tok)
            last[sid] = tok
        wanted = list(last) if logits_for is None else list(logits_for)
        # all_logits_for: one row per token of those sequences, after the last-token rows.
        every = [tok for sid in all_logits_for for tok, s in zip(flat_ids, sequence_ids) if s == sid]
        out = np.zeros((len(wanted) + len(every), VOCAB), dtype=np.float32)
        for i, tok in enumerate([last[sid] for sid in wanted] + every):
            out[i, (tok + 1) % VOCAB] = 10.0
        return out

    def release(self, sequence_id: str, *, keep_cache: bool = True) -> None:
        if self.held.pop(sequence_id, None) is not None:
            self.released.append(sequence_id)
            if not keep_cache:
                self.dropped_cache.append(sequence_id)
        self.kv.pop(sequence_id, None)

    def num_free_slots(self) -> int:
        return self._cap.max_num_seqs - len(self.held)

    @property
    def embedding_max_tokens(self) -> int:
        return 8

    def embed(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """Token counts per id (a bag of words), so equal inputs give equal vectors."""
        self.embed_calls.append([list(x) for x in inputs])
        out = np.zeros((len(inputs), VOCAB), dtype=np.float32)
        for row, ids in zip(out, inputs):
            np.add.at(row, list(ids), 1.0)
        return out

    def save_state(self, sequence_id: str) -> bytes:
        return bytes(self.kv[sequence_id])

    def restore_state(self, sequence_id: str, state: bytes, token_ids: Sequence[int] = ()) -> bool:
        self.kv[sequence_id] = list(state)
        return True


def fake_config(**overrides) -> CllmConfig:
    return load_config(None, environ={}, **overrides)


def make_fake_backend(config: CllmConfig) -> FakeBackend:
    """Registry-style factory (what an entry point in group cllm.backends names)."""
    return FakeBackend(slots=config.model.n_seq_max, max_batch_tokens=config.model.n_batch, forward_sleep_s=0.0005)


def run_all(engine, max_steps: int = 10_000) -> dict:
    """Step ``engine`` until nothing is unfinished; the final output of every request, by id."""
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return final
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    raise AssertionError("engine did not finish")

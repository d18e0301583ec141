"""A backend whose forward pass costs nothing: for measuring everything around it.

``NullBackend`` keeps the contract's bookkeeping (slots, KV room in tokens,
position checks) and answers every ``forward_batch`` with rows of one fixed
logits table, so an engine or a server driven by it spends its time only in
scheduling, sampling, detokenising, streaming and HTTP: the per-step and
per-token overhead that a GPU's 2-5 ms steps expose (benchmarks/engine_overhead.py).

The logits live on the backend's device type: a numpy table (what the llama.cpp
backend returns, sampled by the numpy sampler) or, with ``device="torch"``, a
torch CPU tensor (what the torch backend returns with device sampling, sampled
by the torch sampler). Returned rows are views of the table, never copies
(a real forward allocates its output on the device for free as far as the host
is concerned). The table favours a token that is neither EOS nor the start of a
stop string, so greedy streams run to ``max_tokens``.

``step_ms`` (with ``token_us`` per token of the batch) simulates a device's step: the forward waits
that long with the GIL released, split over ``syncs`` waits, as a CUDA backend releases the GIL in
each of its synchronizations (the torch backend waits twice a step: for the staged inputs and for
the sampled ids). It makes a CPU-only proxy of a GPU server: the engine's Python and the event
loop then compete for the GIL around each wait exactly as they do around a CUDA sync.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from cllm.backends.base import Admission, Backend, BackendCapacity, BackendError, Tokenizer

EOS_ID = 0
FAVOURED_SPREAD = 8  # the table's top tokens cycle over this many ids per row (varied text)


class WordTokenizer(Tokenizer):
    """Token i (> 0) is the text ``" w<i>"``: 3-7 bytes, like a real subword (``word_bytes`` pads it to
    that length, for tests that need a lot of text quickly); 0 is EOS; text encodes by UTF-8 byte
    (each byte b is token b + 1, for prompts given as text)."""

    def __init__(self, vocab_size: int, word_bytes: int = 0) -> None:
        if vocab_size < 300:
            raise ValueError(f"vocab_size {vocab_size} is too small: the byte tokens need 257 ids")
        self._vocab = vocab_size
        self._bytes = [b""] + [f" w{i}".encode().ljust(word_bytes, b"x") for i in range(1, vocab_size)]

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({EOS_ID})

    @property
    def bos_token_id(self) -> int | None:
        return None

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return [b + 1 for b in text.encode()]

    def decode(self, token_ids: Sequence[int]) -> str:
        return b"".join(self._bytes[t] for t in token_ids).decode("utf-8", "replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    @property
    def chat_template(self) -> str | None:
        return ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")


class NullBackend(Backend):
    """``NullBackend(slots=256, vocab_size=1024, max_batch_tokens=8192, kv_tokens=4M, device="numpy", word_bytes=0,
    step_ms=0.0, token_us=0.0, syncs=2)``."""

    name = "null"
    supports_prefix_cache = False
    supports_state_swap = False
    supports_embeddings = False

    def __init__(self, *, slots: int = 256, vocab_size: int = 1024, max_batch_tokens: int = 8192,
                 max_model_len: int = 32768, kv_tokens: int = 1 << 22, device: str = "numpy", seed: int = 0,
                 word_bytes: int = 0, step_ms: float = 0.0, token_us: float = 0.0, syncs: int = 2) -> None:
        if device not in ("numpy", "torch"):
            raise ValueError(f"device must be 'numpy' or 'torch', got {device!r}")
        if step_ms < 0 or token_us < 0 or syncs < 1:
            raise ValueError(f"step_ms={step_ms}, token_us={token_us}, syncs={syncs}: need step_ms, token_us >= 0 and syncs >= 1")
        self._step_s = step_ms / 1000
        self._token_s = token_us / 1e6
        self._syncs = syncs
        self._cap = BackendCapacity(slots, max_batch_tokens, max_model_len, kv_tokens)
        self._tok = WordTokenizer(vocab_size, word_bytes)
        self._held: dict[str, int] = {}  # sequence -> KV tokens reserved
        self._computed: dict[str, int] = {}  # sequence -> tokens in "KV"
        rng = np.random.default_rng(seed)
        table = rng.standard_normal((max(slots, 1) * 2, vocab_size)).astype(np.float32)
        favoured = 300 + (np.arange(len(table)) % FAVOURED_SPREAD) * 7
        table[np.arange(len(table)), favoured] += 12.0  # a clear argmax, never EOS
        table[:, EOS_ID] = -30.0
        self._table: Any = table
        if device == "torch":
            import torch

            self._table = torch.from_numpy(table)
        self.num_forwards = 0

    @property
    def capacity(self) -> BackendCapacity:
        return self._cap

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tok

    def admit(self, sequence_id: str, token_ids: Sequence[int], *, reuse_prefix: bool = True) -> Admission | None:
        if len(self._held) >= self._cap.max_num_seqs:
            return None
        self._held[sequence_id] = 0
        self._computed[sequence_id] = 0
        return Admission(0)

    def reserve(self, sequence_id: str, num_tokens: int) -> bool:
        held = self._held
        if num_tokens > held[sequence_id]:  # (every decode asks each step: the common answer first)
            if num_tokens > self._cap.max_model_len:
                return False
            held[sequence_id] = num_tokens
        return True

    def forward_batch(self, flat_ids: Sequence[int], positions: Sequence[int], sequence_ids: Sequence[str], *,
                      logits_for: Sequence[str] | None = None, all_logits_for: Sequence[str] = ()) -> Any:
        self.num_forwards += 1
        counts: dict[str, int] = {}
        for sid in sequence_ids:
            counts[sid] = counts.get(sid, 0) + 1
        for sid, n in counts.items():  # positions continue each sequence's KV, as a real backend checks
            if sid not in self._computed:
                raise BackendError(f"sequence {sid!r} was not admitted", [sid])
            self._computed[sid] += n
        self._device_wait(len(flat_ids))
        wanted = len(counts) if logits_for is None else len(logits_for)
        rows = wanted + sum(counts[s] for s in all_logits_for)
        if rows > len(self._table):
            return self._table[np.arange(rows) % len(self._table)]
        return self._table[:rows]

    def _device_wait(self, num_tokens: int) -> None:
        """The simulated device step: sleeping releases the GIL and takes it back, as a CUDA sync does."""
        wait = self._step_s + self._token_s * num_tokens
        if wait > 0:
            for _ in range(self._syncs):
                time.sleep(wait / self._syncs)

    def release(self, sequence_id: str, *, keep_cache: bool = True) -> None:
        self._held.pop(sequence_id, None)
        self._computed.pop(sequence_id, None)

    def num_free_slots(self) -> int:
        return self._cap.max_num_seqs - len(self._held)

"""LlamaEmbedder: a second llama.cpp context over the same model, with embeddings and pooling on.

Generation's context returns logits and keeps KV per slot; pooled embeddings
need ``embeddings=True`` and a pooling type fixed at context creation, so they
get their own context, created on first use (a server that never embeds pays
nothing) and sized by EmbeddingConfig: ``embedding_batch_tokens`` cells shared
by up to ``embedding_max_inputs`` sequences (unified KV), n_batch = n_ubatch =
that token budget. llama.cpp pools per micro-batch, so every input of a decode
must sit in one micro-batch — hence n_ubatch equals the budget and no input may
exceed it. The KV is cleared after each decode: inputs share nothing.
"""
from __future__ import annotations

from collections.abc import Sequence

import llama_cpp as C
import numpy as np

from cllm.backends.llama_cpp.determinism import kv_type
from cllm.backends.llama_cpp.native import LlamaBatchBuffer, LlamaContextHandle, LlamaModelHandle
from cllm.backends.llama_cpp.offload import KV_CACHE_TYPES
from cllm.backends.packing import pack_inputs
from cllm.config import EmbeddingConfig

_POOLING = {"mean": C.LLAMA_POOLING_TYPE_MEAN, "cls": C.LLAMA_POOLING_TYPE_CLS, "last": C.LLAMA_POOLING_TYPE_LAST}
DECODE_OK = 0


def pooling_type(model: LlamaModelHandle, setting: str) -> int:
    """The llama.cpp pooling for ``setting``; auto = the GGUF's ``<arch>.pooling_type`` when it is
    mean, cls or last, else mean (a decoder LM carries none; none/rank give no sentence vector)."""
    if setting != "auto":
        return _POOLING[setting]
    arch = model.meta("general.architecture")
    raw = model.meta(f"{arch}.pooling_type") if arch else None
    value = int(raw) if raw is not None and raw.strip().lstrip("-").isdigit() else None
    return value if value in _POOLING.values() else C.LLAMA_POOLING_TYPE_MEAN


class LlamaEmbedder:
    """Pooled embeddings of token inputs, several per llama_decode. Not thread-safe (the engine thread uses it)."""

    def __init__(self, *, model: LlamaModelHandle, config: EmbeddingConfig, n_threads: int,
                 deterministic: bool = False) -> None:
        """``deterministic``: an input's vector must not depend on what shares its decode (model.deterministic):
        each input gets a decode of its own (mean pooling is a matmul over all of a decode's tokens), with
        flash attention's row-by-row kernel over a bf16 cache (llama_cpp/determinism.py)."""
        self.max_tokens = min(config.embedding_batch_tokens, model.n_ctx_train or config.embedding_batch_tokens)
        self._max_inputs = 1 if deterministic else config.embedding_max_inputs
        self.pooling = pooling_type(model, config.embedding_pooling)
        kv = KV_CACHE_TYPES[kv_type("f16", deterministic=deterministic)]
        self._ctx = LlamaContextHandle(
            model=model, n_ctx=self.max_tokens, n_batch=self.max_tokens, n_ubatch=self.max_tokens,
            n_seq_max=self._max_inputs, n_threads=n_threads, flash_attn=deterministic, kv_unified=True,
            type_k=kv, type_v=kv, pooling_type=self.pooling,
        )
        self._batch = LlamaBatchBuffer(capacity=self.max_tokens)

    def set_n_threads(self, n_threads: int) -> None:
        """Compute the next embeddings with ``n_threads`` threads (the generation context's count now)."""
        if self._ctx.n_threads != n_threads:
            self._ctx.set_n_threads(n_threads)

    def embed(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        out = np.empty((len(inputs), self._ctx.n_embd), dtype=np.float32)
        for group in pack_inputs([len(x) for x in inputs], max_tokens=self.max_tokens, max_inputs=self._max_inputs):
            out[group.start:group.stop] = self._embed_group([inputs[i] for i in group])
        return out

    def _embed_group(self, inputs: list[Sequence[int]]) -> np.ndarray:
        tokens = np.concatenate([np.asarray(x, dtype=np.int32) for x in inputs])
        positions = np.concatenate([np.arange(len(x), dtype=np.int32) for x in inputs])
        seqs = np.repeat(np.arange(len(inputs), dtype=np.int32), [len(x) for x in inputs])
        self._batch.fill(tokens, positions, seqs, np.arange(len(tokens)))
        try:
            rc = self._ctx.decode(self._batch)
            if rc != DECODE_OK:
                raise RuntimeError(f"llama_decode failed with code {rc} on an embedding batch of {len(tokens)} tokens")
            return np.stack([self._ctx.seq_embedding(i) for i in range(len(inputs))])
        finally:
            self._ctx.clear_memory()

    def close(self) -> None:
        self._ctx.close()

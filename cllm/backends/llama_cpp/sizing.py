"""How many sequences and KV cells the llama.cpp backend gets when the config leaves them unset.

The KV cache is split (one stream of ``n_ctx / n_seq_max`` cells per seq_id, as
llama-server's ``-np N``): a unified pool was measured 3x slower at 64 decoding
sequences on CPU, because every token attends over every sequence's cells. So
more concurrent sequences cost KV memory up front (llama.cpp allocates and
clears the whole cache at start-up), and the defaults are sized from the
machine's memory at run time:

- each sequence gets ``DEFAULT_SEQ_CTX`` cells (capped by the model's trained
  context), the per-sequence context cllm has always had;
- ``n_seq_max`` is as many such sequences as fit in ``KV_MEMORY_SHARE`` of the
  memory available now, at most ``MAX_AUTO_SEQS`` (64: the most clients
  benchmarks/vs_llama_server.py runs; a client beyond the slots waits in the queue
  and, joining mid-decode, stalls the others with its prefill), at least 1;
- given ``n_ctx`` but no ``n_seq_max`` (the memory is then fixed by ``n_ctx``): as
  many sequences as give each at least ``MIN_AUTO_SEQ_CTX`` cells, at most 64;
- given ``n_seq_max`` but no ``n_ctx``: ``n_seq_max`` sequences of the default size.

For the embedded SmolLM2-135M (23 KB of f16 KV per token) on a 24 GB machine
that is 64 sequences of 2,048 cells: 3 GB of KV. An 8B model (128 KB per token)
on the same machine gets about 12.
"""
from __future__ import annotations

import os
from pathlib import Path

DEFAULT_SEQ_CTX = 2048  # KV cells per sequence when n_ctx is unset
MIN_AUTO_SEQ_CTX = 512  # fewest cells per sequence when n_ctx is set and n_seq_max is not
MAX_AUTO_SEQS = 64  # most sequences chosen automatically
KV_MEMORY_SHARE = 0.125  # share of the available memory the automatic KV cache may take
PROMPT_CACHE_SHARE = 0.125  # share of the available memory the host prompt cache may take by default
MAX_AUTO_PROMPT_CACHE = 8 << 30  # llama-server's --cache-ram default (8192 MiB)

# Bytes per element of each KV cache type (block types: block bytes / elements per block).
KV_TYPE_BYTES = {
    "f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
    "iq4_nl": 18 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32,
}


def kv_bytes_per_token(n_layer: int, n_head_kv: int, k_len: int, v_len: int, type_k: str, type_v: str) -> float:
    """KV cache bytes one token takes in every layer together."""
    return n_layer * n_head_kv * (k_len * KV_TYPE_BYTES[type_k] + v_len * KV_TYPE_BYTES[type_v])


def available_memory(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes this process could still allocate: MemAvailable, or the cgroup's room if that is less."""
    available = None
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text())
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(0, available)


def kv_shape(n_ctx: int | None, n_seq_max: int | None, *, n_ctx_train: int, bytes_per_token: float,
             available_bytes: int) -> tuple[int, int]:
    """(n_ctx, n_seq_max) with unset values (None) chosen as the module docstring says."""
    seq_ctx = min(DEFAULT_SEQ_CTX, n_ctx_train) if n_ctx_train > 0 else DEFAULT_SEQ_CTX
    if n_seq_max is None:
        if n_ctx is None:
            n_seq_max = int(available_bytes * KV_MEMORY_SHARE // max(1.0, seq_ctx * bytes_per_token))
        else:
            n_seq_max = n_ctx // MIN_AUTO_SEQ_CTX
        n_seq_max = max(1, min(MAX_AUTO_SEQS, n_seq_max))
    if n_ctx is None:
        n_ctx = n_seq_max * seq_ctx
    return n_ctx, n_seq_max


def prompt_cache_bytes(prompt_cache_mib: int | None, *, available_bytes: int) -> int:
    """The host prompt cache's bound: the configured MiB, or unset: ``PROMPT_CACHE_SHARE`` of the
    memory available at start-up, at most llama-server's 8 GiB."""
    if prompt_cache_mib is not None:
        return prompt_cache_mib << 20
    return int(min(MAX_AUTO_PROMPT_CACHE, available_bytes * PROMPT_CACHE_SHARE))

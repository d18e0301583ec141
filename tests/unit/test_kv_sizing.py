"""How the llama.cpp backend sizes its KV cache when n_ctx / n_seq_max are unset (sizing.py)."""
from __future__ import annotations

import pytest

from cllm.backends.llama_cpp.sizing import (DEFAULT_SEQ_CTX, MAX_AUTO_SEQS, available_memory, kv_bytes_per_token,
                                             kv_shape)

GIB = 1 << 30
SMOLLM2 = kv_bytes_per_token(30, 3, 64, 64, "f16", "f16")  # 30 layers, 3 KV heads of 64
LLAMA_8B = kv_bytes_per_token(32, 8, 128, 128, "f16", "f16")


def test_kv_bytes_per_token_of_known_shapes():
    assert SMOLLM2 == 23_040 and LLAMA_8B == 131_072
    assert kv_bytes_per_token(32, 8, 128, 128, "q8_0", "q8_0") == 131_072 * 34 / 64
    with pytest.raises(KeyError):
        kv_bytes_per_token(1, 1, 1, 1, "q3_k", "f16")


def test_unset_shape_fits_an_eighth_of_memory_at_most_64_sequences():
    # 24 GB machine: the small model is capped at 64 sequences, the 8B model gets what fits in 3 GB.
    assert kv_shape(None, None, n_ctx_train=8192, bytes_per_token=SMOLLM2, available_bytes=24 * GIB) == (
        64 * DEFAULT_SEQ_CTX, MAX_AUTO_SEQS)
    n_ctx, n_seq = kv_shape(None, None, n_ctx_train=131072, bytes_per_token=LLAMA_8B, available_bytes=24 * GIB)
    assert n_seq == 12 and n_ctx == 12 * 2048 and n_ctx * LLAMA_8B <= 3 * GIB
    # a small machine still gets one sequence; a model trained shorter gets shorter sequences
    assert kv_shape(None, None, n_ctx_train=8192, bytes_per_token=LLAMA_8B, available_bytes=GIB // 4) == (2048, 1)
    assert kv_shape(None, None, n_ctx_train=512, bytes_per_token=SMOLLM2, available_bytes=24 * GIB) == (64 * 512, 64)


def test_a_set_value_is_kept_and_the_other_follows():
    assert kv_shape(None, 4, n_ctx_train=8192, bytes_per_token=SMOLLM2, available_bytes=GIB) == (4 * 2048, 4)
    assert kv_shape(32768, None, n_ctx_train=8192, bytes_per_token=SMOLLM2, available_bytes=24 * GIB) == (32768, 64)
    assert kv_shape(4096, None, n_ctx_train=8192, bytes_per_token=SMOLLM2, available_bytes=24 * GIB) == (4096, 8)
    assert kv_shape(100, None, n_ctx_train=8192, bytes_per_token=SMOLLM2, available_bytes=24 * GIB) == (100, 1)
    # n_ctx fixes the memory: the machine's does not change how it is split
    assert kv_shape(32768, None, n_ctx_train=8192, bytes_per_token=LLAMA_8B, available_bytes=GIB) == (32768, 64)
    assert kv_shape(1000, 3, n_ctx_train=8192, bytes_per_token=SMOLLM2, available_bytes=1) == (1000, 3)


def test_available_memory_reads_meminfo_and_a_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert available_memory(meminfo, cgroup) == 20_000_000 * 1024  # no cgroup files
    (cgroup / "memory.max").write_text("max\n")
    assert available_memory(meminfo, cgroup) == 20_000_000 * 1024
    (cgroup / "memory.max").write_text(f"{8 * GIB}\n")
    (cgroup / "memory.current").write_text(f"{GIB}\n")
    assert available_memory(meminfo, cgroup) == 7 * GIB

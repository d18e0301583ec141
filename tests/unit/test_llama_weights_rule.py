"""llama_cpp.weights: auto's rule and the cache key, without a model (see cllm/backends/llama_cpp/weights.py)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import llama_cpp  # noqa: F401 (the llama_cpp extra, which `make test` installs: missing is a failure, not a skip)

from cllm.backends.llama_cpp.weights import (
    AUTO_MAX_BYTES, FTYPE_Q4_1, TARGETS, auto_choice, converted_bytes, converted_path, cpu_has_avx2,
)

GIB = 1 << 30
SMALL = dict(ftype=FTYPE_Q4_1, estimate=150 << 20, gpu_layers=0, avx2=True, memory=20 * GIB)


def test_auto_converts_a_small_q4_1_model_on_an_avx2_cpu_only() -> None:
    assert auto_choice(**SMALL) == "q8_0"
    assert auto_choice(**{**SMALL, "ftype": 2}) == "file"  # Q4_0: llama.cpp repacks it for GEMM already
    assert auto_choice(**{**SMALL, "ftype": None}) == "file"  # no general.file_type: unknown
    assert auto_choice(**{**SMALL, "gpu_layers": 33}) == "file"
    assert auto_choice(**{**SMALL, "avx2": False}) == "file"
    assert auto_choice(**{**SMALL, "estimate": AUTO_MAX_BYTES + 1}) == "file"  # memory-bound at one sequence
    assert auto_choice(**{**SMALL, "memory": 400 << 20}) == "file"  # the copy would take over 1/4 of it


def test_the_estimate_bounds_a_q4_1_files_copy(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"\0" * 20_000)  # 32,000 Q4_1 weights
    assert converted_bytes(f, FTYPE_Q4_1, TARGETS["q8_0"]) == 34_000
    assert converted_bytes(f, FTYPE_Q4_1, TARGETS["f16"]) == 64_000


def test_the_copy_is_keyed_by_the_files_content_not_its_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLLM_CACHE_DIR", str(tmp_path / "cache"))
    data = bytes(range(256)) * 2000  # 512,000 bytes: more than the fingerprint's samples
    f = tmp_path / "m.gguf"
    f.write_bytes(data)
    first = converted_path(f, "q8_0")
    assert first.parent == tmp_path / "cache" / "weights" and first.name.startswith("m.q8_0.")
    assert converted_path(f, "f16") != first
    (tmp_path / "venv2").mkdir()
    other = tmp_path / "venv2" / "m.gguf"  # the same model installed elsewhere (another checkout's venv)
    other.write_bytes(data)
    os.utime(other, ns=(1, 1))
    assert converted_path(other, "q8_0") == first  # one copy for both
    for at in (0, 300_000, len(data) - 1):  # a byte changed at the start, the middle, the end: a new copy
        changed = bytearray(data)
        changed[at] ^= 1
        f.write_bytes(bytes(changed))
        assert converted_path(f, "q8_0") != first, at
    f.write_bytes(data + b"x")  # grown by one byte
    assert converted_path(f, "q8_0") != first


def test_avx2_is_read_from_the_cpu_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx fma avx2 f16c\n")
    assert cpu_has_avx2(info)
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx\n")
    assert not cpu_has_avx2(info)
    assert not cpu_has_avx2(tmp_path / "missing")
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    info.write_text("flags\t\t: avx2\n")
    assert not cpu_has_avx2(info)


def test_the_cache_root_is_cllm_cache_dir_else_xdg_else_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cllm.model_path import cache_root

    monkeypatch.delenv("CLLM_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root() == tmp_path / "home" / ".cache" / "cllm"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "cllm"
    monkeypatch.setenv("CLLM_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"

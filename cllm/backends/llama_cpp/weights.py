"""Which weights file the llama.cpp backend loads: the model file as given, or a converted copy.

Why convert: llama.cpp's CPU kernels for Q4_1 have no batched (GEMM) path on x86 —
every row of a batch runs the vector dot product again — while Q8_0 goes through
llamafile's tiled GEMM. On the 2-core AVX2 EPYC (llama-batched-bench, SmolLM2-135M,
32-token prompts, 2 threads) the same model as Q8_0 (re-encoded from the Q4_1 file)
against the Q4_1 file: prompt processing 2.1x, decoding 16 sequences 1.64x, 64
sequences 1.75x, one sequence 0.94-0.98x (llama-bench tg128, two sittings: Q8_0 streams
1.5x the bytes), which a one-client server run gains back on TTFT (prefill 2x).
A 1.2B-parameter Q4_1 model (random weights) as Q8_0: 16 sequences 1.48x, but one
sequence 0.88x — there a step streams 1.25 GB of weights and memory bandwidth, not
compute, bounds one sequence. Hence ``auto`` converts only small models
(``AUTO_MAX_BYTES`` of Q8_0 weights, between those two measured points).

What it costs in accuracy: every weight w of a Q4_1 block becomes the Q8_0 code of
w, so |w' - w| <= max|block| * (1/254 + 2**-11) (Q8_0's rounding plus its float16
scale's). Teacher-forced over 1,000 tokens of README text against the file's exact
weights in float32 (benchmarks/weights_accuracy.py): top-1 agreement 94.5-95.4 % (the
file as llama.cpp runs it, with 8-bit activations: 95.5-96.2 %), mean KL 5.1-5.3e-3
(3.7e-3). ``file`` keeps llama-server's numerics.

The copy is written once per (file, size, mtime, target, llama-cpp-python version)
under cache_root() / "weights" (~/.cache/cllm/weights), by llama.cpp's own quantizer, and
reused after.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as C

from cllm.backends.llama_cpp.native import LlamaModelHandle, _init_llama_backend
from cllm.backends.llama_cpp.sizing import available_memory
from cllm.model_path import cache_root, file_fingerprint
from cllm.progress import phase

log = logging.getLogger("cllm.llama_cpp")

# general.file_type values (llama_ftype) and bytes per weight of the block types named here.
FTYPE_Q4_1 = 3
SOURCE_BYTES_PER_WEIGHT = {FTYPE_Q4_1: 20 / 32}
UNKNOWN_BYTES_PER_WEIGHT = 0.5  # 4 bits: most quantized files have at least this many (an over-estimate of weights)


@dataclass(frozen=True)
class Target:
    ftype: int
    bytes_per_weight: float


TARGETS = {
    "q8_0": Target(C.LLAMA_FTYPE_MOSTLY_Q8_0, 34 / 32),
    "f16": Target(C.LLAMA_FTYPE_MOSTLY_F16, 2.0),
}
# auto converts a Q4_1 file when its Q8_0 copy is at most this big (measured: 144 MB gains, 1.25 GB loses
# at one sequence) and at most this share of the memory available.
AUTO_MAX_BYTES = 256 << 20
AUTO_MEMORY_SHARE = 0.25
DISK_MARGIN_BYTES = 64 << 20
# llama_model_quantize's pace for the progress estimate: the embedded 98 MB Q4_1 file converted to Q8_0
# in 0.7-1.0 s on 2 AVX2 cores (~100 MB/s of source); a little slower is assumed.
CONVERT_BYTES_PER_S = 80e6


def cpu_has_avx2(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """x86 with AVX2 (the tiled Q8_0 GEMM's path; the measured machines). Unknown -> False."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return "avx2" in line.split()
    except OSError:
        pass
    return False


def file_type(path: Path) -> int | None:
    """The model's general.file_type (llama_ftype), read from its metadata alone."""
    handle = LlamaModelHandle(path=path, vocab_only=True)
    try:
        raw = handle.meta("general.file_type")
    finally:
        handle.close()
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def converted_bytes(path: Path, ftype: int | None, target: Target) -> int:
    """An upper estimate of the converted file's size."""
    weights = path.stat().st_size / SOURCE_BYTES_PER_WEIGHT.get(ftype, UNKNOWN_BYTES_PER_WEIGHT)
    return int(weights * target.bytes_per_weight)


def auto_choice(*, ftype: int | None, estimate: int, gpu_layers: int, avx2: bool, memory: int) -> str:
    """What ``weights: auto`` runs: q8_0 for a small Q4_1 model on an AVX2 CPU, else the file."""
    small = estimate <= min(AUTO_MAX_BYTES, AUTO_MEMORY_SHARE * memory)
    return "q8_0" if ftype == FTYPE_Q4_1 and gpu_layers == 0 and avx2 and small else "file"


def converted_path(path: Path, choice: str) -> Path:
    """The copy's place in the cache: by what the file holds (``file_fingerprint``), not where it is."""
    key = f"{file_fingerprint(path)}|{choice}|{C.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "weights" / f"{path.stem}.{choice}.{digest}.gguf"


def convert(path: Path, out: Path, target: Target, *, estimate: int, n_threads: int) -> None:
    """llama.cpp's quantizer, source -> out (written beside it, then renamed: a reader never sees half a file)."""
    _init_llama_backend()  # llama.cpp's log goes to our logger, not stderr
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < estimate + DISK_MARGIN_BYTES:
        raise RuntimeError(f"{out.parent} has {free >> 20} MiB free, the copy needs about {estimate >> 20} MiB")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    params = C.llama_model_quantize_default_params()
    params.ftype = target.ftype
    params.allow_requantize = True
    params.nthread = n_threads
    try:
        rc = C.llama_model_quantize(str(path).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize returned {rc}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def prepare_weights(path: Path, choice: str, *, gpu_layers: int, n_threads: int) -> Path:
    """The file the backend should load for ``llama_cpp.weights = choice`` (see the module docstring)."""
    if choice == "file":
        return path
    ftype = file_type(path)
    wanted = choice
    if choice == "auto":
        wanted = auto_choice(ftype=ftype, estimate=converted_bytes(path, ftype, TARGETS["q8_0"]),
                             gpu_layers=gpu_layers, avx2=cpu_has_avx2(), memory=available_memory())
        if wanted == "file":
            return path
    out = converted_path(path, wanted)
    if out.is_file():
        log.info("weights: %s runs as %s from %s (llama_cpp.weights=file keeps the file)", path.name, wanted, out)
        return out
    start = time.perf_counter()
    try:
        with phase(f"converting {path.name} to {wanted} (first run only; llama_cpp.weights=file skips it)",
                   estimate_s=max(1.0, path.stat().st_size / CONVERT_BYTES_PER_S)):
            convert(path, out, TARGETS[wanted], estimate=converted_bytes(path, ftype, TARGETS[wanted]),
                    n_threads=n_threads)
    except (OSError, RuntimeError) as exc:
        if choice == "auto":
            log.warning("weights: keeping %s as it is (could not write a %s copy: %s)", path.name, wanted, exc)
            return path
        raise ValueError(f"llama_cpp.weights={choice!r}: could not convert {str(path)!r}: {exc}") from exc
    log.info("weights: converted %s to %s in %.1f s: %s (llama_cpp.weights=file keeps the file)",
             path.name, wanted, time.perf_counter() - start, out)
    return out

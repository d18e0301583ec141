"""One wrapper class per llama.cpp native handle: model, context, batch.

Each takes keyword-only arguments, turns C return codes into exceptions right
where they happen, and has an idempotent ``close()``. Free order: batch and
context before the model (LlamaCppBackend.close does that).
"""
from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp as C
import numpy as np

from cllm.backends.llama_cpp.offload import KV_CACHE_TYPES
from cllm.backends.llama_cpp.sizing import kv_bytes_per_token

log = logging.getLogger("cllm.llama_cpp")
_backend_once = threading.Lock()
_backend_ready = False


def _init_llama_backend() -> None:
    """llama_backend_init is process-wide and must run once before any model loads."""
    global _backend_ready
    with _backend_once:
        if not _backend_ready:
            C.llama_backend_init()
            C.llama_log_set(_silent_log, ctypes.c_void_p(0))
            _backend_ready = True


# ggml log levels -> Python levels. llama.cpp's INFO is per-tensor load chatter: DEBUG here.
_LOG_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}
_GGML_LOG_LEVEL_CONT = 5  # continues the previous message at its level
_last_level = [logging.DEBUG]


_capture = threading.local()  # .lines: llama.cpp's warnings and errors on this thread, while a load runs


@C.llama_log_callback
def _silent_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """Route llama.cpp's log into the `cllm.llama_cpp` logger, each line at its own level, so warnings
    show at the configured log level and load chatter only at DEBUG."""
    py_level = _last_level[0] if level == _GGML_LOG_LEVEL_CONT else _LOG_LEVELS.get(level, logging.DEBUG)
    _last_level[0] = py_level
    lines = getattr(_capture, "lines", None)
    if lines is not None and py_level >= logging.WARNING:
        lines.append(text.decode("utf-8", "replace").strip())  # logged after the load, or said in its error
        return
    if log.isEnabledFor(py_level):
        message = text.decode("utf-8", "replace").rstrip()
        if message:
            log.log(py_level, "llama.cpp: %s", message)


def q0_prefetch_blocks() -> int | None:
    """How many blocks ahead llama.cpp's quantised CPU matmul (llamafile's tinyBLAS, Q8_0/Q4_0/Q5_0/IQ4_NL
    weights, 2+ tokens a step) prefetches its weight rows: cllm's set-up builds llama-cpp-python with
    that patch (third_party/llama-cpp-python/). None for a build without it, which runs the same, with
    multi-token steps (batches, speculative verification) up to ~1.5x slower on a CPU whose weights
    stream from memory."""
    try:
        lib = ctypes.CDLL("libggml-cpu.so.0")  # the one libllama loaded (matched by its soname)
    except OSError:
        return None
    marker = getattr(lib, "cllm_q0_prefetch_blocks", None)
    return int(marker()) if marker is not None else None


def _amx_build() -> bool:
    """The installed llama.cpp was built with its AMX (Intel Advanced Matrix Extensions) CPU kernels."""
    return b"AMX_INT8 = 1" in C.llama_print_system_info()


def _without_extra_buffers(default_params: Any) -> Any:
    def params() -> C.llama_model_params:
        out = default_params()
        out.use_extra_bufts = False
        return out
    return params


def avoid_amx_extra_buffers() -> None:
    """On an AMX build, load every model of this process without llama.cpp's extra buffer types.

    A native build on an AMX CPU (a Sapphire Rapids Xeon, 2026-11-26) puts the weights in the AMX
    "extra" buffer type, and llama_decode of any batch of more than one token then crashed the process
    (SIGSEGV; one-token prompts ran). Without extra buffer types the same build runs correctly on the
    plain CPU kernels. llama-cpp-python's own ``Llama`` (the benchmarks' baseline, the tests' reference
    models) reads the defaults through the same function, so both bindings of it are wrapped, once.
    Idempotent; nothing changes on a build without AMX.
    """
    import llama_cpp.llama_cpp as low_level

    if getattr(low_level, "_cllm_without_extra_buffers", False) or not _amx_build():
        return
    if not hasattr(C.llama_model_default_params(), "use_extra_bufts"):
        return  # an older llama.cpp: nothing to turn off
    for module in {C, low_level}:
        module.llama_model_default_params = _without_extra_buffers(module.llama_model_default_params)
    low_level._cllm_without_extra_buffers = True


avoid_amx_extra_buffers()


def model_params(*, n_gpu_layers: int) -> C.llama_model_params:
    """llama.cpp's default model params with our offload choice (see offload.resolve_gpu_layers)."""
    params = C.llama_model_default_params()
    params.n_gpu_layers = n_gpu_layers
    return params


def load_failure_reason(lines: Sequence[str]) -> str:
    """llama.cpp's own words for a failed load ("unknown model architecture: 'x'", a tensor's wrong
    shape, a vocabulary error), from the warning and error lines it logged while loading."""
    said = [line for line in lines if line and "failed to load model" not in line]
    errors = [line.split("error loading model: ", 1)[1] for line in said if "error loading model: " in line]
    reason = "; ".join(errors or said[-2:])
    return reason or "llama.cpp gave no reason (is it a GGUF file?)"


class LlamaModelHandle:
    """A loaded GGUF model (llama_model*) and its vocabulary."""

    def __init__(self, *, path: Path, n_gpu_layers: int = 0, vocab_only: bool = False) -> None:
        _init_llama_backend()
        params = model_params(n_gpu_layers=n_gpu_layers)
        params.vocab_only = vocab_only  # a tokenizer alone (a Ray ingress) needs no weights
        _capture.lines = []  # llama.cpp says why a load fails only in its log
        try:
            ptr = C.llama_model_load_from_file(str(path).encode(), params)
        finally:
            said, _capture.lines = _capture.lines, None
        if not ptr:
            raise ValueError(f"llama.cpp could not load {str(path)!r}: {load_failure_reason(said)}")
        for line in said:
            if line:
                log.warning("llama.cpp: %s", line)
        self.ptr = ptr
        self.vocab = C.llama_model_get_vocab(ptr)
        self.n_vocab = C.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = C.llama_model_n_ctx_train(ptr)

    def kv_bytes_per_token(self, type_k: str, type_v: str) -> float:
        """KV cache bytes per token in all layers (for sizing; SWA / recurrent layers are over-counted)."""
        n_head = max(1, C.llama_model_n_head(self.ptr))
        arch = self.meta("general.architecture") or "llama"
        head_dim = C.llama_model_n_embd(self.ptr) // n_head
        k_len = int(self.meta(f"{arch}.attention.key_length") or head_dim)
        v_len = int(self.meta(f"{arch}.attention.value_length") or head_dim)
        return kv_bytes_per_token(C.llama_model_n_layer(self.ptr), C.llama_model_n_head_kv(self.ptr), k_len, v_len,
                                  type_k, type_v)

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = C.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode("utf-8", "replace")

    def chat_template(self) -> str | None:
        raw = C.llama_model_chat_template(self.ptr, None)
        return raw.decode("utf-8", "replace") if raw else None

    def close(self) -> None:
        if self.ptr:
            C.llama_model_free(self.ptr)
            self.ptr = None


class LlamaContextHandle:
    """An inference context (llama_context*) with a unified KV cache of ``n_ctx`` cells.

    Unified KV means all sequences share one pool of cells, so one sequence may
    grow to the whole context and ``llama_memory_seq_cp`` shares cells instead
    of copying them: prefix reuse costs no memory.
    """

    def __init__(self, *, model: LlamaModelHandle, n_ctx: int, n_batch: int, n_ubatch: int,
                 n_seq_max: int, n_threads: int, flash_attn: bool | str, kv_unified: bool,
                 type_k: int = KV_CACHE_TYPES["f16"], type_v: int = KV_CACHE_TYPES["f16"],
                 offload_kqv: bool = True, pooling_type: int | None = None) -> None:
        """``pooling_type`` set: an embeddings context (llama.cpp pools each sequence's outputs)."""
        params = C.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = min(n_ubatch, n_batch)
        params.n_seq_max = n_seq_max
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        params.kv_unified = kv_unified
        params.no_perf = True
        params.flash_attn_type = {"auto": C.LLAMA_FLASH_ATTN_TYPE_AUTO, True: C.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                                  False: C.LLAMA_FLASH_ATTN_TYPE_DISABLED}[flash_attn]
        params.type_k = type_k
        params.type_v = type_v
        params.offload_kqv = offload_kqv  # KV cache and attention ops on the GPU with the offloaded layers
        if pooling_type is not None:
            params.embeddings = True
            params.pooling_type = pooling_type
        ptr = C.llama_init_from_model(model.ptr, params)
        if not ptr:
            raise RuntimeError(f"llama.cpp could not create a context (n_ctx={n_ctx}, n_seq_max={n_seq_max}): out of memory?")
        self.ptr = ptr
        self.memory = C.llama_get_memory(ptr)
        self.n_ctx = C.llama_n_ctx(ptr)
        self.n_vocab = model.n_vocab
        self.n_embd = C.llama_model_n_embd(model.ptr)

    def decode(self, batch: LlamaBatchBuffer) -> int:
        """llama_decode; returns its code (0 ok, 1 no KV slot, other = error)."""
        return C.llama_decode(self.ptr, batch.struct)

    @property
    def n_threads(self) -> int:
        """The threads llama_decode computes with now (llama_n_threads)."""
        return C.llama_n_threads(self.ptr)

    def set_n_threads(self, n_threads: int) -> None:
        """Compute the next decodes, single tokens and batches alike, with ``n_threads`` threads."""
        C.llama_set_n_threads(self.ptr, n_threads, n_threads)

    def output_logits(self, n_outputs: int) -> np.ndarray:
        """All rows of the last decode's outputs, in batch order: a view into llama.cpp's buffer (no copy)."""
        ptr = C.llama_get_logits(self.ptr)
        if not ptr:
            raise RuntimeError("llama.cpp returned no logits")
        return np.ctypeslib.as_array(ptr, shape=(n_outputs, self.n_vocab))

    def seq_embedding(self, seq_id: int) -> np.ndarray:
        """The pooled embedding of one sequence after the last decode (a copy)."""
        ptr = C.llama_get_embeddings_seq(self.ptr, seq_id)
        if not ptr:
            raise RuntimeError(f"llama.cpp returned no pooled embedding for seq {seq_id} (pooling off?)")
        return np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).copy()

    def clear_memory(self) -> None:
        """Drop every sequence's KV (llama_memory_clear with data)."""
        C.llama_memory_clear(self.memory, True)

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        return bool(C.llama_memory_seq_rm(self.memory, seq_id, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        C.llama_memory_seq_cp(self.memory, src, dst, p0, p1)

    def seq_pos_max(self, seq_id: int) -> int:
        return C.llama_memory_seq_pos_max(self.memory, seq_id)

    def save_seq(self, seq_id: int) -> bytearray:
        size = C.llama_state_seq_get_size(self.ptr, seq_id)
        # One buffer, written in place and returned (not copied again): fresh pages are slow to touch
        # on some VMs (~6 ms for the 2.2 MB of a 95-token SmolLM2 sequence here).
        state = bytearray(size)
        written = C.llama_state_seq_get_data(self.ptr, (ctypes.c_uint8 * size).from_buffer(state), size, seq_id)
        if written != size:
            raise RuntimeError(f"llama_state_seq_get_data wrote {written} of {size} bytes for seq {seq_id}")
        return state

    def load_seq(self, seq_id: int, state: bytes | bytearray) -> bool:
        array = ctypes.c_uint8 * len(state)
        buf = array.from_buffer(state) if isinstance(state, bytearray) else array.from_buffer_copy(state)
        return C.llama_state_seq_set_data(self.ptr, buf, len(state), seq_id) > 0

    def close(self) -> None:
        if self.ptr:
            C.llama_free(self.ptr)
            self.ptr = None


class LlamaBatchBuffer:
    """A llama_batch whose arrays are numpy buffers we own (filled vectorised, freed by GC).

    Built by hand rather than with llama_batch_init so that a step fills
    token/pos/seq_id/logits with a few numpy slice assignments instead of a
    Python loop per token; each token belongs to exactly one sequence.
    """

    def __init__(self, *, capacity: int) -> None:
        self.capacity = capacity
        self.tokens = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        # seq_id is int32** : one pointer per token into self.seq.
        base = self.seq.ctypes.data
        self._seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * capacity)(
            *[ctypes.cast(base + 4 * i, ctypes.POINTER(ctypes.c_int32)) for i in range(capacity)]
        )
        self.struct = C.llama_batch()
        self.struct.embd = ctypes.POINTER(ctypes.c_float)()
        self.struct.token = self.tokens.ctypes.data_as(ctypes.POINTER(C.llama_token))
        self.struct.pos = self.pos.ctypes.data_as(ctypes.POINTER(C.llama_pos))
        self.struct.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(ctypes.POINTER(C.llama_seq_id)))
        self.struct.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def fill(self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int], output_rows: Sequence[int]) -> None:
        n = len(tokens)
        if n > self.capacity:
            raise ValueError(f"batch of {n} tokens exceeds n_batch={self.capacity}")
        self.tokens[:n] = tokens
        self.pos[:n] = positions
        self.seq[:n] = seqs
        self.logits[:n] = 0
        self.logits[output_rows] = 1
        self.struct.n_tokens = n

"""LlamaCppBackend: many sequences per llama_decode over a bounded seq_id pool.

Design decisions a reader would otherwise rediscover:
- By default the KV cache is split (``kv_unified=False``): each seq_id owns
  n_ctx/n_seq_max cells, as in llama-server. That costs flexibility but makes
  every sequence's logits independent of its batch-mates: in a unified cache a
  sequence's cells interleave with others', the SIMD reduction order in
  attention changes, and greedy outputs drift between "alone" and "batched"
  (measured: 3 of 4 prompts differed within 64 tokens). Determinism wins.
- With ``kv_unified=True`` one pool of n_ctx cells serves all sequences: one
  sequence may use the whole context and ``llama_memory_seq_cp`` shares cells.
  KV room is then accounted here, conservatively (shared cells count once per
  sequence), so the scheduler learns "full" from ``reserve`` and preempts
  before llama_decode fails for lack of cells. Should llama_decode still find
  no slot (fragmentation), it raises KVCacheFullError and the engine preempts.
- A released slot keeps its KV as prefix cache (unless the request failed or
  prefix_cache is off); the unshared tail is removed with llama_memory_seq_rm
  when the slot is reused, and idle caches are evicted LRU when room is needed.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cllm.backends.base import Admission, Backend, BackendCapacity, BackendError, KVCacheFullError, Tokenizer
from cllm.backends.llama_cpp.embedder import LlamaEmbedder
from cllm.backends.llama_cpp.determinism import kv_type
from cllm.backends.llama_cpp.determinism import report as determinism_report
from cllm.backends.llama_cpp.flash_attn import FlashAttnVerdict, resolve_flash_attn
from cllm.backends.llama_cpp.native import LlamaBatchBuffer, LlamaContextHandle, LlamaModelHandle, q0_prefetch_blocks
from cllm.backends.llama_cpp.offload import kv_cache_type, resolve_gpu_layers
from cllm.backends.llama_cpp.prompt_cache import PromptCache, SavedPrompt
from cllm.backends.llama_cpp.sizing import available_memory, kv_shape, prompt_cache_bytes
from cllm.backends.llama_cpp.slot_pool import SeqSlotPool, Slot
from cllm.backends.llama_cpp.cpu_room import CpuRoom
from cllm.backends.llama_cpp.thread_governor import ThreadGovernor, work_class
from cllm.backends.llama_cpp.threads import default_n_threads, physical_cores, usable_cpus
from cllm.backends.llama_cpp.tokenizer import LlamaCppTokenizer
from cllm.backends.llama_cpp.vision import MtmdContext, find_mmproj, llama_pos
from cllm.backends.llama_cpp.weights import prepare_weights
from cllm.config import CllmConfig
from cllm.model_path import resolve_model_path
from cllm.multimodal.prompt import MultimodalPrompt, splice_images
from cllm.multimodal.span import ImageSpan, cache_keys

log = logging.getLogger(__name__)

DECODE_OK = 0
DECODE_NO_KV_SLOT = 1
# Fewest prefix tokens copied from another split-KV sequence rather than prefilled again. A copy
# costs ~1.2 ms for a 95-token source of SmolLM2 (save + load), about what prefilling one token
# does (2.2 ms on 2 cores); below 8 tokens it is not worth the bookkeeping.
MIN_COPY_TOKENS = 8
# Fewest tokens an evicted sequence must lose to be saved to the host prompt cache: saving costs
# ~1 ms (95 tokens of SmolLM2), prefilling 8 tokens again ~18 ms.
MIN_SAVE_TOKENS = 8
# Largest state idle_work copies ahead of an eviction: a request that arrives meanwhile waits for the
# copy, and fresh memory takes up to ~3 ms per MB to touch on a VM (8 MiB: 360 tokens of SmolLM2,
# ~10-25 ms). Larger states are copied at eviction, as before.
IDLE_SAVE_MAX_BYTES = 8 << 20


def not_gguf_message(path: Path) -> str:
    """Why ``path`` is not for llama.cpp, and what to do: a Hugging Face directory can be converted or
    run on the torch backend."""
    if path.is_dir() and (path / "config.json").is_file():
        return (f"model={str(path)!r} is a Hugging Face model directory; the llama_cpp backend runs GGUF files: "
                f"convert it with llama.cpp's convert_hf_to_gguf.py (python convert_hf_to_gguf.py {str(path)!r} "
                f"--outfile model.gguf), or serve it as it is with backend=\"torch\" (--backend torch)")
    return f"model={str(path)!r}: the llama_cpp backend needs a .gguf file"


class LlamaCppBackend(Backend):
    """The llama.cpp backend (llama-cpp-python's low-level API)."""

    name = "llama_cpp"
    supports_prefix_cache = True
    supports_state_swap = True
    supports_embeddings = True
    supports_speculation = True

    def __init__(self, config: CllmConfig) -> None:
        m, lc = config.model, config.llama_cpp
        path = resolve_model_path(m.model)
        if path.is_dir() or path.suffix.lower() != ".gguf":
            raise ValueError(not_gguf_message(path))
        self.n_gpu_layers = resolve_gpu_layers(lc.n_gpu_layers)
        self.on_gpu = bool(self.n_gpu_layers)
        self._n_threads = m.n_threads or default_n_threads()  # shared by the embeddings context
        # model_path names the model; weights_path is what llama.cpp runs (a converted copy: weights.py)
        self.model_path = path
        self.weights_path = prepare_weights(path, lc.weights, gpu_layers=self.n_gpu_layers, n_threads=self._n_threads)
        self._model = LlamaModelHandle(path=self.weights_path, n_gpu_layers=self.n_gpu_layers)
        self.q0_prefetch_blocks = q0_prefetch_blocks()  # cllm's llama.cpp patch present (native.py)
        # The projector loads before the KV cache is sized, so that its weights count against the memory
        self._vision = self._load_vision(lc.mmproj)
        self.supports_images = self._vision is not None
        memory = available_memory()
        # model.deterministic: flash attention's row-by-row kernel, a bf16 cache for f16/f32 (determinism.py)
        det = m.deterministic
        self.type_k, self.type_v = kv_type(lc.type_k, deterministic=det), kv_type(lc.type_v, deterministic=det)
        self.determinism = determinism_report(deterministic=det, type_k=self.type_k, type_v=self.type_v,
                                              gpu_layers=self.n_gpu_layers)
        self._kv_bytes_per_token = self._model.kv_bytes_per_token(self.type_k, self.type_v)
        n_ctx, n_seq_max = kv_shape(m.n_ctx, m.n_seq_max, n_ctx_train=self._model.n_ctx_train,
                                    bytes_per_token=self._kv_bytes_per_token, available_bytes=memory)
        # auto on a CPU: serving steps timed on this machine once (flash_attn.py); what llama.cpp was given, and why
        self.flash_attn_verdict = FlashAttnVerdict(True, "deterministic") if det else resolve_flash_attn(
            lc.flash_attn, model=self._model, model_path=self.weights_path, n_threads=self._n_threads,
            gpu_layers=self.n_gpu_layers, type_k=self.type_k, type_v=self.type_v, n_ubatch=lc.n_ubatch,
            kv_unified=lc.kv_unified)
        self.flash_attn = self.flash_attn_verdict.setting
        self._ctx = LlamaContextHandle(
            model=self._model, n_ctx=n_ctx, n_batch=m.n_batch, n_ubatch=lc.n_ubatch,
            n_seq_max=n_seq_max, n_threads=self._n_threads, flash_attn=self.flash_attn, kv_unified=lc.kv_unified,
            type_k=kv_cache_type(self.type_k), type_v=kv_cache_type(self.type_v), offload_kqv=lc.offload_kqv,
        )
        self._batch = LlamaBatchBuffer(capacity=m.n_batch)
        # Fewer threads while other processes take the CPU (thread_governor.py); a count the user chose is
        # kept, and with layers on a GPU the CPU threads matter little.
        adapt = lc.adapt_threads == "auto" and m.n_threads is None and not self.n_gpu_layers and self._n_threads > 1
        self.thread_governor = ThreadGovernor(top=self._n_threads) if adapt else None
        self._threads_now = self._n_threads
        self._thread_share: int | None = None  # set by a router dividing the CPU (share_cpu)
        cpus = usable_cpus()
        self._cpu_room = CpuRoom(cpus) if adapt else None
        self._cores_per_cpu = physical_cores(cpus) / max(1, len(cpus))  # room counts hyper-threads; threads, cores
        self._step_clock = time.perf_counter  # what decodes are timed with (tests script it)
        self._tokenizer = LlamaCppTokenizer(model=self._model, chat_template=m.chat_template)
        self._pool = SeqSlotPool(size=n_seq_max)
        self._prefix_cache = lc.prefix_cache
        self._saved = PromptCache(capacity_bytes=prompt_cache_bytes(lc.prompt_cache_mib, available_bytes=memory)
                                  if lc.prefix_cache else 0)
        self._similarity = lc.slot_prompt_similarity
        self._unified = lc.kv_unified
        self.drafts_run_apart = not lc.kv_unified  # (llama_batch_allocr::split_equal, sequential)
        # With split KV, llama.cpp batches into one micro-batch only sequences whose seq_ids run
        # consecutively (see forward_batch), so a prompt takes an idle seq_id next to a running one
        # (SeqSlotPool.choose with pack) and its cached prefix is moved there (_copy_prefix, or a load
        # from host memory) rather than the prompt running wherever its prefix happens to be: a gap
        # costs a weight pass every step (32 sequences: 121 vs 92 ms per decode step). What the slot
        # held goes to host memory first.
        self._pack = not lc.kv_unified and self._saved.capacity_bytes > 0
        seq_cells = self._ctx.n_ctx if lc.kv_unified else self._ctx.n_ctx // n_seq_max
        self._capacity = BackendCapacity(
            max_num_seqs=n_seq_max,
            max_batch_tokens=m.n_batch,
            max_model_len=min(seq_cells, self._model.n_ctx_train or seq_cells),
            kv_tokens=self._ctx.n_ctx,
        )
        self._embedding_config = config.embeddings
        self._embedder: LlamaEmbedder | None = None  # its own context, made on first embed()
        self._queried_tokens = 0
        self._hit_tokens = 0
        # (queried, hit) of admissions not yet run: counted at the first decode, dropped on a rollback
        # (an admission refused for KV is retried later and must not count twice).
        self._uncounted: dict[str, tuple[int, int]] = {}

    def _load_vision(self, setting: str | None) -> MtmdContext | None:
        mmproj = find_mmproj(self.model_path, setting)
        if mmproj is None:
            return None
        vision = MtmdContext(path=mmproj, model=self._model, n_threads=self._n_threads, use_gpu=self.on_gpu)
        log.info("images: projector %s (M-RoPE: %s)", mmproj, vision.uses_mrope)
        self.vision_text = f"libmtmd, projector {mmproj.name}" + (", M-RoPE positions" if vision.uses_mrope else "")
        return vision

    def expand_images(self, prompt: MultimodalPrompt) -> tuple[list[int], tuple[ImageSpan, ...]]:
        if self._vision is None:
            return super().expand_images(prompt)
        return splice_images(prompt, self._vision.expand_one)

    # ------------------------------------------------------------------ info
    @property
    def capacity(self) -> BackendCapacity:
        return self._capacity

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def kv_usage(self) -> float:
        with self._pool.lock:
            live = sum(max(s.reserved, len(s.tokens)) for s in self._pool.owned())
        return min(1.0, live / self._capacity.kv_tokens)

    def num_free_slots(self) -> int:
        return self._pool.size - self._pool.num_in_use()

    def slot_of(self, sequence_id: str) -> int | None:
        """The llama.cpp seq_id a sequence holds (for /v1/engine)."""
        slot = self._pool.slot_of(sequence_id)
        return None if slot is None else slot.seq_id

    def prefix_cache_stats(self) -> tuple[int, int]:
        return (self._queried_tokens, self._hit_tokens)

    # ------------------------------------------------------------- admission
    def admit(self, sequence_id: str, token_ids: Sequence[int], *, reuse_prefix: bool = True,
              images: Sequence[ImageSpan] = ()) -> Admission | None:
        tokens = cache_keys(token_ids, images) if images else list(token_ids)
        with self._pool.lock:
            use_cache = self._prefix_cache and reuse_prefix
            min_match = max(1, math.ceil(self._similarity * len(tokens))) if use_cache else 0
            choice = self._pool.choose(tokens, min_match=min_match, pack=self._pack)
            if choice is None:
                return None
            slot, match = choice
            self._pool.acquire(sequence_id, slot)
            slot.spans = tuple(images)  # (the prefix kept below is the same under the old owner's images)
            limit = _outside_images(images, len(tokens) - 1)  # the last prompt token is always evaluated: its logits are sampled
            in_place = min(match.length, limit) if match is not None and match.slot is slot else 0
            saved = self._saved.take(tokens, min_match=max(min_match, match.length + 1 if match else 0)) \
                if use_cache and self._saved.capacity_bytes else None
            self._save_evicted(slot, keep=0 if saved else in_place)
            slot.saved = False
            if saved is not None:
                cached = self._load_saved(slot, *saved, limit=limit)
            else:
                self._truncate(slot, in_place)
                # Recurrent/hybrid memory refuses partial removal and _truncate empties the slot: the
                # cached count is what the slot really still holds, never what it held before.
                cached = min(in_place, len(slot.tokens))
                if cached == 0 and match is not None and match.slot is not slot:
                    cached = self._copy_prefix(match.slot, slot, min(match.length, limit))
            slot.reserved = len(slot.tokens)
        self._uncounted[sequence_id] = (len(tokens), cached)
        return Admission(num_cached_tokens=cached)

    def _save_evicted(self, slot: Slot, keep: int) -> None:
        """Before a new prompt cuts ``slot`` to its first ``keep`` tokens: save what it holds to the
        host prompt cache when more would be lost than kept (llama-server's rule, f_keep < 0.5),
        unless idle_work saved it already."""
        if slot.saved and slot.tokens in self._saved:
            return
        lost = len(slot.tokens) - keep
        if self._saved.capacity_bytes and lost > keep and lost >= MIN_SAVE_TOKENS:
            self._saved.put(slot.tokens, self._ctx.save_seq(slot.seq_id))

    def idle_work(self) -> bool:
        """Save one idle slot's KV (at most IDLE_SAVE_MAX_BYTES) to the host prompt cache ahead of its eviction.

        A save costs ~7 ms per 2.2 MB state on a VM whose fresh memory is slow to touch (page
        faults); done at admission, 64 of them put ~0.45 s in front of a burst's prefill. Saved
        while the engine has nothing else to do, the eviction finds the copy made (llama-server
        saves idle slots too, but when the next task arrives: on the critical path).
        """
        if not self._saved.capacity_bytes:
            return False
        most = max(MIN_SAVE_TOKENS, int(IDLE_SAVE_MAX_BYTES // max(self._kv_bytes_per_token, 1)))
        with self._pool.lock:
            slot = next((s for s in self._pool.idle() if not s.saved and MIN_SAVE_TOKENS <= len(s.tokens) <= most), None)
            if slot is None:
                return False
            slot.saved = True
            if slot.tokens not in self._saved:
                self._saved.put(slot.tokens, self._ctx.save_seq(slot.seq_id))
            return True

    def _load_saved(self, slot: Slot, saved: SavedPrompt, length: int, *, limit: int) -> int:
        """Load a saved sequence into ``slot`` and keep its first ``length`` tokens (at most ``limit``);
        the tokens the slot now holds."""
        self._truncate(slot, 0)
        if not self._ctx.load_seq(slot.seq_id, saved.state):
            self._ctx.seq_rm(slot.seq_id)  # a partial load leaves nothing usable
            return 0
        slot.tokens = list(saved.tokens)
        self._truncate(slot, min(length, limit))
        return len(slot.tokens)

    def _truncate(self, slot: Slot, keep: int) -> None:
        """Drop the slot's KV from position ``keep`` on (all of it when keep=0)."""
        if keep <= 0:
            self._ctx.seq_rm(slot.seq_id)
            slot.tokens = []
        elif len(slot.tokens) > keep:
            if not self._ctx.seq_rm(slot.seq_id, llama_pos(slot.spans, keep), -1):
                self._ctx.seq_rm(slot.seq_id)  # partial removal unsupported: start clean
                slot.tokens = []
            else:
                del slot.tokens[keep:]

    def _copy_prefix(self, src: Slot, dst: Slot, length: int) -> int:
        """Give ``dst`` the first ``length`` KV cells of another sequence.

        In a unified cache llama_memory_seq_cp shares the cells. Across split KV streams it
        copies only whole streams, and only at the next llama_decode: a source slot loaded with
        other KV before then (a prompt taking it this step) would hand over its new contents. So
        the copy goes through the state API, which copies at once (~10 us per source token to
        save, ~2 us to load, against ~2.2 ms to prefill a token), and the tail is cut off.
        """
        if self._unified:
            if length <= 0:
                return 0
            self._ctx.seq_cp(src.seq_id, dst.seq_id, 0, length)
        else:
            if length < MIN_COPY_TOKENS:
                return 0
            if not self._ctx.load_seq(dst.seq_id, self._ctx.save_seq(src.seq_id)):
                self._ctx.seq_rm(dst.seq_id)  # a partial load leaves nothing usable
                return 0
            if not self._ctx.seq_rm(dst.seq_id, length, -1):  # recurrent memory: no partial removal
                self._ctx.seq_rm(dst.seq_id)
                return 0
        dst.tokens = src.tokens[:length]
        return length

    def reserve(self, sequence_id: str, num_tokens: int) -> bool:
        with self._pool.lock:
            slot = self._owned(sequence_id)
            need = num_tokens - max(slot.reserved, len(slot.tokens))
            if need <= 0:
                return True
            if num_tokens > self._capacity.max_model_len:
                return False
            if not self._unified:  # every seq_id has its own n_ctx/n_seq_max cells
                slot.reserved = num_tokens
                return True
            while self._pool.kv_cells_counted() + need > self._capacity.kv_tokens:
                if not self._evict_one_idle_cache():
                    return False
            slot.reserved = num_tokens
            return True

    def truncate(self, sequence_id: str, num_tokens: int) -> int:
        with self._pool.lock:
            slot = self._owned(sequence_id)
            if len(slot.tokens) > num_tokens:
                self._truncate(slot, num_tokens)  # (recurrent memory cannot drop a tail: then all of it)
            return len(slot.tokens)

    def _evict_one_idle_cache(self) -> bool:
        for slot in self._pool.idle():
            if slot.tokens:
                self._truncate(slot, 0)
                return True
        return False

    def release(self, sequence_id: str, *, keep_cache: bool = True) -> None:
        self._uncounted.pop(sequence_id, None)
        with self._pool.lock:
            slot = self._pool.release(sequence_id)
            if slot is not None and not (keep_cache and self._prefix_cache):
                self._truncate(slot, 0)

    def _owned(self, sequence_id: str) -> Slot:
        slot = self._pool.slot_of(sequence_id)
        if slot is None:
            raise KeyError(f"sequence {sequence_id!r} holds no seq_id (not admitted, or released)")
        return slot

    # --------------------------------------------------------------- forward
    def forward_batch(
        self,
        flat_ids: Sequence[int],
        positions: Sequence[int],
        sequence_ids: Sequence[str],
        *,
        logits_for: Sequence[str] | None = None,
        all_logits_for: Sequence[str] = (),
    ) -> np.ndarray:
        n = len(flat_ids)
        if not (n == len(positions) == len(sequence_ids)) or n == 0:
            raise ValueError(f"forward_batch needs equal, non-empty arrays (got {n}, {len(positions)}, {len(sequence_ids)})")
        images: list[tuple[Slot, ImageSpan]] = []  # decoded this step: undone if the step fails
        if self._vision is not None:
            flat_ids, positions, sequence_ids, images = self._decode_images(flat_ids, positions, sequence_ids)
            n = len(flat_ids)
            if n == 0:  # the step was images only: nothing samples
                return np.empty((0, self._model.n_vocab), dtype=np.float32)
        slots, last_row = self._map_sequences(sequence_ids)
        wanted = list(last_row) if logits_for is None else list(logits_for)
        rows = [last_row[s] for s in wanted]
        if all_logits_for:
            rows += _rows_of(sequence_ids, all_logits_for)
        seq_ids = [slots[s].seq_id for s in sequence_ids]
        # Tokens go to llama.cpp ordered by seq_id: with a split KV cache it puts into one micro-batch
        # only sequences whose seq_ids run consecutively in batch order (llama_batch_allocr::split_equal,
        # "sequential"), so arrival order split a 32-sequence decode into many micro-batches, each
        # re-reading every weight (measured 190 vs 97 ms per step).
        # The bookkeeping is plain Python on purpose: numpy's sorts (argsort, unique, searchsorted) drop
        # the GIL, the event loop takes it, and the engine waited for it back before every decode
        # (py-spy, one streaming client: 5 % of the engine thread's samples in np.unique).
        order = sorted(range(n), key=seq_ids.__getitem__)  # stable
        position_of = [0] * n
        for new_pos, old_pos in enumerate(order):
            position_of[old_pos] = new_pos
        rows = [position_of[r] for r in rows]
        # llama.cpp computes one output row per flagged token, in batch order (a token flagged twice counts once).
        flagged = sorted(set(rows))
        llama_positions = positions if self._vision is None or not self._vision.uses_mrope else \
            [llama_pos(slots[sid].spans, p) for p, sid in zip(positions, sequence_ids)]
        self._batch.fill([flat_ids[i] for i in order], [llama_positions[i] for i in order], [seq_ids[i] for i in order],
                         flagged)
        rc = self._governed_decode(n, max(positions))
        if rc == DECODE_NO_KV_SLOT:
            self._undo_images(images)
            raise KVCacheFullError("llama_decode found no KV slot for the batch", list(slots))
        if rc != DECODE_OK:
            self._roll_back(slots)
            self._undo_images(images)
            raise BackendError(f"llama_decode failed with code {rc}", list(slots))
        for tok, sid in zip(flat_ids, sequence_ids):  # the caller's order: each sequence's tokens in order
            slots[sid].tokens.append(int(tok))
        self._count_prefix_stats(slots)
        # Reorder (and copy) the batch-order output rows into the order asked for.
        row_of = {r: i for i, r in enumerate(flagged)}
        return self._ctx.output_logits(len(flagged))[[row_of[r] for r in rows]]

    def _decode_images(self, flat_ids: Sequence[int], positions: Sequence[int], sequence_ids: Sequence[str]
                       ) -> tuple[list[int], list[int], list[str], list[tuple[Slot, ImageSpan]]]:
        """Encode and decode every image this step reaches (a sequence's chunk starts at its span:
        Request.fit_chunk), each in llama_decode calls of its own ahead of the token batch; the batch's
        other tokens, to decode as usual, and the images decoded. BackendError names the sequences whose image
        failed (the step's other images are undone: the engine runs them again, one sequence at a time)."""
        first: dict[str, int] = {}
        for i, sid in enumerate(sequence_ids):
            first.setdefault(sid, i)
        image_rows: set[int] = set()
        failed: list[str] = []
        decoded: list[tuple[Slot, ImageSpan]] = []
        for sid, i in first.items():
            slot = self._owned(sid)
            span = next((s for s in slot.spans if s.start == positions[i]), None)
            if span is None:
                continue
            try:
                self._vision.decode(self._ctx.ptr, span, pos=llama_pos(slot.spans, span.start), seq_id=slot.seq_id,
                                    n_batch=self._capacity.max_batch_tokens)
            except RuntimeError as err:
                self._ctx.seq_rm(slot.seq_id, llama_pos(slot.spans, span.start), -1)
                failed.append(sid)
                log.warning("image of %s failed: %s", sid, err)
                continue
            slot.tokens += cache_keys([0] * span.length, [ImageSpan(0, span.length, span.image)])
            decoded.append((slot, span))
            image_rows.update(range(i, i + span.length))
        if failed:
            self._undo_images(decoded)
            raise BackendError("the image encoder or its decode failed", failed)
        keep = [i for i in range(len(flat_ids)) if i not in image_rows]
        return [flat_ids[i] for i in keep], [positions[i] for i in keep], [sequence_ids[i] for i in keep], decoded

    def _undo_images(self, decoded: list[tuple[Slot, ImageSpan]]) -> None:
        """Drop what a failed step's images put in KV: the sequence holds what it held before the step."""
        for slot, span in decoded:
            self._truncate(slot, span.start)

    def _count_prefix_stats(self, slots: dict[str, Slot]) -> None:
        """Count the prefix-cache stats of sequences that just ran for the first time since admission."""
        for sid in slots:
            stats = self._uncounted.pop(sid, None)
            if stats is not None:
                self._queried_tokens += stats[0]
                self._hit_tokens += stats[1]

    def _roll_back(self, slots: dict[str, Slot]) -> None:
        """After a failed decode, drop KV cells it may have left beyond what each slot is known to hold."""
        for slot in slots.values():
            self._ctx.seq_rm(slot.seq_id, len(slot.tokens), -1)

    def _map_sequences(self, sequence_ids: Sequence[str]) -> tuple[dict[str, Slot], dict[str, int]]:
        slots: dict[str, Slot] = {}
        last_row: dict[str, int] = {}
        for i, sid in enumerate(sequence_ids):
            if sid not in slots:
                slots[sid] = self._owned(sid)
            last_row[sid] = i
        return slots, last_row

    @property
    def compute_threads(self) -> int:
        """The threads llama_decode runs with now (below n_threads while the governor has taken some away)."""
        return self._threads_now

    @property
    def cpu_threads(self) -> int | None:
        """The most threads llama_decode computes with on the CPU (None with layers on a GPU: nothing to share)."""
        return None if self.n_gpu_layers else self._n_threads

    def share_cpu(self, threads: int | None) -> None:
        """From the next decode on, at most ``threads`` threads (a router divides the CPU among the engines
        busy at once); None = this backend's own count (and its governor) again."""
        self._thread_share = threads

    def _governed_decode(self, n_tokens: int, max_position: int) -> int:
        """_run_decode with the thread count the governor chooses, timed for it (failed decodes are not).
        Under a router's share the share is the count, and the governor neither chooses nor learns."""
        governor = self.thread_governor
        share = self._thread_share
        if governor is None or share is not None:
            threads = min(share, self._n_threads) if share is not None else self._n_threads
            if threads != self._threads_now:
                self._ctx.set_n_threads(threads)
                self._threads_now = threads
            return self._run_decode()
        room = self._cpu_room.sample() if self._cpu_room is not None else None
        threads = governor.threads_for_step(None if room is None else room * self._cores_per_cpu)
        if threads != self._threads_now:
            self._ctx.set_n_threads(threads)
            self._threads_now = threads
        start = self._step_clock()
        rc = self._run_decode()
        if rc == DECODE_OK:
            governor.observe(work_class(n_tokens, max_position), self._step_clock() - start)
        return rc

    def _run_decode(self) -> int:
        """One llama_decode of the filled batch; a subclass may wrap it (fault injection in tests)."""
        return self._ctx.decode(self._batch)

    # ------------------------------------------------------------ embeddings
    @property
    def embedding_max_tokens(self) -> int:
        return min(self._embedding_config.embedding_batch_tokens, self._model.n_ctx_train or 1 << 30)

    def embed(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        if self._embedder is None:
            self._embedder = LlamaEmbedder(model=self._model, config=self._embedding_config, n_threads=self._n_threads,
                                           deterministic=self.determinism.on)
        # the thread governor learns from generation steps; embeddings run beside them on the same CPUs
        self._embedder.set_n_threads(self._threads_now)
        return self._embedder.embed(inputs)

    # ------------------------------------------------------------ swap state
    def save_state(self, sequence_id: str) -> bytes:
        return bytes(self._ctx.save_seq(self._owned(sequence_id).seq_id))

    def restore_state(self, sequence_id: str, state: bytes, token_ids: Sequence[int] = ()) -> bool:
        slot = self._owned(sequence_id)
        self._truncate(slot, 0)
        if not self._ctx.load_seq(slot.seq_id, state):
            return False
        slot.tokens = cache_keys(token_ids, slot.spans)
        slot.reserved = max(slot.reserved, len(slot.tokens))
        return True

    def close(self) -> None:
        vision, self._vision = getattr(self, "_vision", None), None
        if vision is not None:
            vision.close()
        ctx, model = getattr(self, "_ctx", None), getattr(self, "_model", None)
        embedder, self._embedder = getattr(self, "_embedder", None), None
        if embedder is not None:
            embedder.close()
        if ctx is not None:
            ctx.close()
        if model is not None:
            model.close()


def _outside_images(spans: Sequence[ImageSpan], limit: int) -> int:
    """``limit`` moved back to the start of an image it falls inside: a prefix-cache hit never ends within an
    image, whose embeddings are decoded whole."""
    for span in spans:
        if span.start < limit < span.end:
            return span.start
    return limit


def _rows_of(sequence_ids: Sequence[str], wanted: Sequence[str]) -> list[int]:
    """Batch rows of every token of the ``wanted`` sequences, grouped in ``wanted`` order."""
    rows: dict[str, list[int]] = {s: [] for s in wanted}
    for i, sid in enumerate(sequence_ids):
        if sid in rows:
            rows[sid].append(i)
    return [i for s in wanted for i in rows[s]]

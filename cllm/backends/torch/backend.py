"""TorchBackend: our native decoder (Llama family, MoE) or a family's transformers model code
(model_impl, see model_impl.py and hf_model.py) over a paged, prefix-cached KV pool.

The backend turns the scheduler's flat per-token arrays into per-sequence
chunks, checks them against what each sequence has in KV, runs one batched
forward and then records the new tokens (registering blocks that became full
in the prefix cache). Block bookkeeping lives in :class:`BlockManager`, the
tensors in :class:`PagedKVCache`, the math in :class:`CausalLM` (or :class:`TransformersCausalLM`).
"""
from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cllm.backends.base import Admission, Backend, BackendCapacity, BackendError, KVCacheFullError, Tokenizer
from cllm.backends.determinism import OFF, Determinism
from cllm.backends.packing import pack_inputs
from cllm.backends.torch import invariant
from cllm.backends.torch.attention import (
    FLEX_CHUNK_MIN_CONTEXT, MAX_TAIL_TOKENS, SeqChunk, attention_mode, build_attention_batch, is_tail, slot_mapping,
)
from cllm.backends.torch.block_manager import BlockManager, SequenceBlocks
from cllm.backends.torch.compile_errors import is_compile_error
from cllm.backends.torch.cuda_graphs import DecodeGraphs, graph_buckets
from cllm.backends.torch.device import resolve_device, resolve_dtype, resolve_fp16_weights, resolve_moe_dense
from cllm.backends.torch.embedding import pooled_hidden_states
from cllm.backends.torch.flex import flex_function
from cllm.backends.torch.kv_cache import KVCacheShape, PagedKVCache
from cllm.backends.torch.loader import LoadedModel, ModelSpec, load_model
from cllm.backends.torch.memory import activation_bytes, check_startup_free, cuda_memory, kv_bytes_per_token, size_kv_pool
from cllm.backends.torch.hf_model import TransformersCausalLM, generic_spec
from cllm.backends.torch.model import CausalLM
from cllm.backends.torch.moe import MoEWeights
from cllm.backends.torch.tokenizer import HFTokenizer
from cllm.backends.torch.transfer import to_device
from cllm.backends.torch.vision import TorchVision
from cllm.config import CllmConfig
from cllm.model_path import resolve_model_path
from cllm.multimodal.prompt import MultimodalPrompt, splice_images
from cllm.multimodal.span import ImageSpan, cache_keys
from cllm.progress import phase

log = logging.getLogger("cllm.torch")


@dataclass(slots=True)
class StepChunk:
    """One sequence's contiguous run of tokens in a forward_batch call (not frozen: a frozen dataclass's
    __init__ costs several times more, and a step builds one per sequence)."""

    seq_id: str  # the sequence
    row_start: int  # first flat row
    row_end: int  # one past the last flat row
    start_pos: int  # position of its first token
    blocks: SequenceBlocks  # its block-manager entry (looked up once per step)


def _graph_rows(config: CllmConfig, max_seqs: int) -> int:
    """The largest captured decode graph's rows: a full batch of decodes (cuda_graph_max_batch, at most
    the sequence cap) and MAX_TAIL_TOKENS more, for short tails beside it (see _forward_split): under
    load a batch is full and new requests' tails arrive beside it at every step."""
    return min(config.torch.cuda_graph_max_batch, max_seqs) + MAX_TAIL_TOKENS


class TorchBackend(Backend):
    """PyTorch runtime: CUDA (bf16) when present, else CPU; paged KV with prefix caching."""

    name = "torch"
    supports_prefix_cache = True
    supports_state_swap = True
    supports_embeddings = True
    supports_speculation = True

    def __init__(self, config: CllmConfig) -> None:
        self.device = resolve_device(config.torch.device)
        self.dtype = resolve_dtype(config.torch.dtype, self.device)
        self.fp16_weights = resolve_fp16_weights(
            config.torch.linear_weights, config.torch.dtype, self.dtype, self.device, compiled=config.torch.torch_compile
        )
        if self.device.type == "cpu":
            torch.set_num_threads(config.model.n_threads or _usable_cores())
        if self.device.type == "cuda":
            check_startup_free(cuda_memory(self.device), config.torch.gpu_memory_utilization)
        # model.deterministic on a CPU: fixed-kernel linears, tiled attention, vector-only activations (invariant.py)
        self._invariant = config.model.deterministic and self.device.type == "cpu"
        loaded = load_model(resolve_model_path(config.model.model), config.torch.model_impl, self.dtype)
        self.model: CausalLM | TransformersCausalLM
        if loaded.hf_model is not None:  # the generic path: transformers' model code over our pool
            self.model_impl = "transformers"
            self.model = TransformersCausalLM(loaded.hf_model.to(self.device, self.dtype), fp16_weights=self.fp16_weights,
                                              pad_rows=self._invariant)
            self.spec = generic_spec(self.model)
            log.info("model %s runs on transformers' model code over the paged KV cache (model_impl %s)",
                     self.spec.architecture, config.torch.model_impl)
        else:
            self.model_impl = "native"
            self.spec = loaded.spec
            self.model = CausalLM(
                loaded.spec, loaded.state_dict, dtype=self.dtype, device=self.device,
                compiled=config.torch.torch_compile and not self._invariant, fp16_weights=self.fp16_weights,
                pad_rows=self._invariant, moe_dense=resolve_moe_dense(
                    config.torch.moe_dense_decode, loaded.spec, 2 if self.fp16_weights else self.dtype.itemsize, self.device),
            )
        sparse = [layer.moe for layer in self.model.layers if layer.moe is not None] \
            if isinstance(self.model, CausalLM) else []
        if sparse and self.device.type == "cpu":
            log.info("MoE experts on CPU: %s (torch.moe_dense_decode %s)", _moe_text(sparse[0]), config.torch.moe_dense_decode)
        self._tokenizer = _load_tokenizer(loaded, self.spec.vocab_size, config.model.chat_template)
        # A vision-language checkpoint: the processor and the vision tower (vision.py)
        self._vision = TorchVision.load(self.model.hf, loaded.tokenizer_dir, device=self.device, dtype=self.dtype) \
            if loaded.vision else None
        self.supports_images = self._vision is not None
        if self._vision is not None:
            self.vision_text = f"transformers {self.model.hf.config.model_type} vision tower and projector" + (
                ", M-RoPE positions" if self._vision.uses_mrope else "")
        self._images: dict[str, tuple[ImageSpan, ...]] = {}  # sequences with images -> their spans
        del loaded
        block_size = config.torch.block_size
        max_seqs, max_tokens = _step_limits(config, self.device)
        # Sliding windows shorter than the longest context: their layers' attention reads only their window.
        longest = _max_model_len(self.spec, config.model.n_ctx or (
            self.spec.max_position_embeddings if self.device.type == "cuda" else CPU_KV_TOKENS))
        self._windows = tuple(w for w in self._model_windows() if w < longest)
        if isinstance(self.model, CausalLM):
            self.model.window = self._windows[0] if self._windows else None
        self._attention = "invariant" if self._invariant else self._attention_mode(config.torch.attention, block_size)
        self.determinism = self._determinism(config)
        if self.device.type == "cuda" and config.model.n_ctx is None:
            # CUDA, n_ctx unset: the model's trained context, as far as the pool sized from memory holds it
            # (at least CPU_KV_TOKENS must fit); it used to be capped at CPU_KV_TOKENS without a word.
            trained = _max_model_len(self.spec, self.spec.max_position_embeddings)
            num_blocks = self._num_blocks(config, block_size, max_seqs, max_tokens, min(trained, CPU_KV_TOKENS))
            max_len = min(trained, num_blocks * block_size)
            if max_len < trained:
                log.info("context capped at %d tokens (the model was trained for %d): the KV pool holds no more; "
                         "set n_ctx to choose", max_len, trained)
        else:
            max_len = _max_model_len(self.spec, _kv_tokens(config))
            num_blocks = self._num_blocks(config, block_size, max_seqs, max_tokens, max_len)
        self.blocks = BlockManager(num_blocks=num_blocks, block_size=block_size)
        # FlexAttention's eager fallback is dense over the whole pool: compiled on CUDA always, on CPU when asked.
        self._flex_fn = flex_function(self.device.type == "cuda" or config.torch.torch_compile)
        # One extra block no sequence owns: padding rows of captured decode graphs write and read only it.
        self._scratch_block = num_blocks
        self.kv = PagedKVCache(
            KVCacheShape(self.spec.num_layers, num_blocks + 1, block_size, self.spec.num_kv_heads, self.spec.head_dim,
                         max_seq_blocks=min(num_blocks, -(-max_len // block_size))),
            dtype=self.dtype, device=self.device, head_major=self._attention != "flash",
        )
        self._embedding_config = config.embeddings
        self._capacity = BackendCapacity(
            max_num_seqs=max_seqs, max_batch_tokens=max_tokens, max_model_len=max_len, kv_tokens=num_blocks * block_size,
        )
        # CUDA runs a forward asynchronously: the engine does the previous step's text work meanwhile.
        self.overlaps_host_work = self.on_gpu = self.device.type == "cuda"
        # Attention of steps that replay no graph: the chosen mode, or SDPA once FlexAttention failed to compile.
        self._eager_attention = self._attention
        self._graphs = self._decode_graphs(config, max_seqs)
        # Logits stay on the device (torch sampler) or come to the host (numpy sampler).
        self._device_sampling = config.torch.sampler == "torch" or (config.torch.sampler == "auto" and self.device.type == "cuda")
        # The lookahead launches a step on ids sampled on the device: only where they are.
        self.supports_lookahead = self._device_sampling
        if self._attention == "flex" and (self.device.type == "cuda" or config.torch.torch_compile):
            self._warm_up()

    def _model_windows(self) -> tuple[int, ...]:
        """The model's sliding windows (the native decoder's applies to every layer)."""
        if isinstance(self.model, TransformersCausalLM):
            return self.model.windows
        return (self.spec.sliding_window,) if self.spec.sliding_window else ()

    def _determinism(self, config: CllmConfig) -> Determinism:
        """What model.deterministic changed here, and what it cannot promise (the ready block says it)."""
        if not config.model.deterministic:
            return OFF
        if self.device.type != "cpu":
            return Determinism(on=True, not_promised=(
                f"torch on {self.device.type}: cuBLAS and the attention kernels choose by shape and no batch-invariant "
                "kernels are built for it yet; the setting changes nothing there",))
        how = ("linears padded to a multiple of 8 rows", f"attention over fixed {invariant.TILE}-key tiles",
               "SiLU and rotary tables on vector code only", "one embedding input per forward", "no torch.compile")
        if self.model_impl == "transformers":
            return Determinism(on=True, how=how, not_promised=(
                f"{self.spec.architecture} on transformers' own modules (model_impl transformers): their activations "
                "and rotary tables run torch's elementwise kernels, whose per-thread tails follow the batch size",))
        return Determinism(on=True, how=how)

    def _attention_mode(self, setting: str, block_size: int) -> str:
        """The attention path (attention.attention_mode), SDPA where the model asks for sliding windows,
        its own scale, softcapping, sinks or mixed head geometry, which only that path serves."""
        needs_sdpa = bool(self._windows) or (isinstance(self.model, TransformersCausalLM) and self.model.needs_sdpa)
        if needs_sdpa and setting not in ("auto", "sdpa"):
            raise ValueError(f"attention={setting!r}: this {self.spec.architecture} model's attention (sliding windows, "
                             "softcapping, sinks or its own scale) runs on the sdpa path only")
        if needs_sdpa:
            if self.device.type == "cuda":
                log.info("attention: sdpa (this model's sliding windows, softcapping, sinks or scale need it; "
                         "no FlexAttention or CUDA graphs)")
            return "sdpa"
        return attention_mode(setting, self.device, block_size)

    def _decode_graphs(self, config: CllmConfig, max_seqs: int) -> DecodeGraphs | None:
        """Captured decode graphs: CUDA with FlexAttention and cuda_graphs on; None elsewhere. On the generic
        path too (transformers' forward): each graph is checked against the eager step at capture
        (DecodeGraphs.check), and a forward that cannot be captured (a host sync in the model's code, as
        transformers' MoE routing has) leaves the decode steps eager, with a warning."""
        if not (config.torch.cuda_graphs and self.device.type == "cuda" and self._attention == "flex"):
            return None
        graphs = DecodeGraphs(
            self.model, self.kv, buckets=graph_buckets(_graph_rows(config, max_seqs)),
            scratch_block=self._scratch_block, flex_fn=self._flex_fn, capture=True,
            q_per_kv=self.spec.num_heads // self.spec.num_kv_heads,
        )
        what = f"capturing CUDA graphs for decode steps (batch sizes {graphs.buckets[0]}..{graphs.buckets[-1]})"
        try:
            with phase(what, total=len(graphs.buckets), unit="graph", estimate_s=0.3 * len(graphs.buckets)) as progress, \
                    torch.inference_mode():
                graphs.capture_all(on_each=progress.advance)
        except Exception as err:  # a capture or compile failure costs speed, never a request
            log.warning("CUDA graph capture failed (%s: %s): decode steps run without graphs",
                        type(err).__name__, str(err).splitlines()[0] if str(err) else "")
            return None  # the graphs and their pool are freed with this frame
        return graphs

    def _warm_up(self) -> None:
        """Run each kind of step whose attention is compiled once, before the engine says it is ready:
        a chunk after a cached prefix (one and two sequences), decodes beside a chunk (one and two),
        and a pure decode outside the graphs. FlexAttention is compiled with dynamic shapes, so one
        call per kind compiles what every later size of it uses; a first request no longer waits
        seconds for it (the first burst of 16 streams waited 5.4 s on an H200), and a compile failure
        shows here, where it switches the eager steps to SDPA (see _forward_eager)."""
        with phase("compiling attention kernels for prefill and mixed steps", estimate_s=30.0):
            self._warm_up_steps()
        log.info("attention for steps without a graph: %s", self._eager_attention)

    def _warm_up_steps(self) -> None:
        seqs = [f"__warm_up_{i}" for i in range(3)]
        # Sequence 0 has a long prefix (FlexAttention serves chunks after one: FLEX_CHUNK_MIN_CONTEXT);
        # its prefill is split to fit the step budget.
        long = FLEX_CHUNK_MIN_CONTEXT + 64 <= self._capacity.max_model_len
        prefix = FLEX_CHUNK_MIN_CONTEXT if long else 40
        per_step = max(1, self._capacity.max_batch_tokens - 64)
        tokens = [[1 + (7 * i + j) % 97 for j in range((prefix if i == 0 else 0) + 96)] for i in range(3)]
        steps = [[(0, min(per_step, prefix - k))] for k in range(0, prefix, per_step)]  # sequence 0's prefix
        steps += [  # (sequence, tokens this step) per step; positions follow each sequence's KV
            [(1, 40)],  # a fresh prefill (SDPA's causal kernel, nothing compiled)
            [(0, 40)],  # a chunk after a (long) cached prefix: FlexAttention's chunk kernel
            [(0, 17), (1, 33)],  # a short tail (decode group) and a chunk after a short prefix (SDPA)
            [(0, 1), (1, 5)],  # a decode beside a chunk
            [(0, 1), (1, 1), (2, 30)],  # two decodes beside a fresh prefill
            [(0, 1), (1, 1), (2, 1)],  # a pure decode, run without the graphs below
        ]
        try:
            for i, s in enumerate(seqs):
                if self.admit(s, tokens[i], reuse_prefix=False) is None or not self.reserve(s, len(tokens[i])):
                    return  # no room to warm up in (a tiny pool): the first requests compile instead
            done = [0, 0, 0]
            graphs, self._graphs = self._graphs, None
            try:
                for step in steps:
                    flat = [t for i, n in step for t in tokens[i][done[i]:done[i] + n]]
                    pos = [p for i, n in step for p in range(done[i], done[i] + n)]
                    ids = [seqs[i] for i, n in step for _ in range(n)]
                    self.forward_batch(flat, pos, ids)
                    for i, n in step:
                        done[i] += n
            except BackendError as err:  # not a compile failure (those fall back inside): requests will show it
                log.warning("warm-up step failed: %s", err)
                return
            finally:
                self._graphs = graphs
        finally:
            for s in seqs:
                self.release(s, keep_cache=False)

    def _num_blocks(self, config: CllmConfig, block_size: int, max_seqs: int, max_tokens: int, max_len: int) -> int:
        """CPU: n_ctx tokens. CUDA: what gpu_memory_utilization leaves after the weights (ValueError if
        not even one max_model_len sequence fits)."""
        if self.device.type != "cuda":
            return -(-_kv_tokens(config) // block_size)
        s = self.spec
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        graphs = config.torch.cuda_graphs and self._attention == "flex"
        intermediate = s.intermediate_size
        if s.num_experts:  # an MoE layer holds, per token, k routed copies of its input, gate|up and output
            intermediate = max(intermediate, s.num_experts_per_tok * (3 * s.hidden_size + 3 * s.moe_intermediate_size))
        reserve = activation_bytes(
            max_batch_tokens=max_tokens, max_num_seqs=max_seqs, hidden=s.hidden_size, intermediate=intermediate,
            heads=s.num_heads, head_dim=s.head_dim, vocab=s.vocab_size, itemsize=itemsize,
            graph_rows=_graph_rows(config, max_seqs) if graphs else 0,
        ) + (self._vision.encoder_bytes(config.images.max_image_pixels) if self._vision is not None else 0)
        per_block = block_size * kv_bytes_per_token(s.num_layers, s.num_kv_heads, s.head_dim, self.dtype)
        torch.cuda.empty_cache()  # blocks the allocator cached while converting weights are free, not "in use"
        sizing = size_kv_pool(
            cuda_memory(self.device), utilization=config.torch.gpu_memory_utilization, activation_reserve=reserve,
            bytes_per_block=per_block, block_size=block_size, min_tokens=max_len,
        )
        return sizing.num_blocks - 1  # one block of the budget is the scratch block

    # ----- contract: fixed facts -----------------------------------------------------------

    @property
    def capacity(self) -> BackendCapacity:
        return self._capacity

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise RuntimeError("this model directory ships no tokenizer; add tokenizer files to it to generate from text")
        return self._tokenizer

    # ----- contract: KV room ---------------------------------------------------------------

    def expand_images(self, prompt: MultimodalPrompt) -> tuple[list[int], tuple[ImageSpan, ...]]:
        if self._vision is None:
            return super().expand_images(prompt)
        return splice_images(prompt, self._vision.expand_one)

    def admit(self, sequence_id: str, token_ids: Sequence[int], *, reuse_prefix: bool = True,
              images: Sequence[ImageSpan] = ()) -> Admission | None:
        if len(self.blocks) >= self._capacity.max_num_seqs:
            return None
        if images:  # blocks are hashed over the images' pixel keys (a hit may end inside an image: its rest is encoded again)
            self._images[sequence_id] = tuple(images)
            token_ids = cache_keys(token_ids, images)
        return Admission(num_cached_tokens=self.blocks.admit(sequence_id, token_ids, reuse_prefix=reuse_prefix))

    def _keys(self, sequence_id: str, token_ids: Sequence[int]) -> Sequence[int]:
        spans = self._images.get(sequence_id)
        return cache_keys(token_ids, spans) if spans else token_ids

    def reserve(self, sequence_id: str, num_tokens: int) -> bool:
        return self.blocks.reserve(sequence_id, num_tokens)

    def release(self, sequence_id: str, *, keep_cache: bool = True) -> None:
        self._images.pop(sequence_id, None)
        self.blocks.release(sequence_id, keep_cache=keep_cache)

    def truncate(self, sequence_id: str, num_tokens: int) -> int:
        self.blocks.roll_back(sequence_id, num_tokens)
        return min(num_tokens, self.blocks.sequence(sequence_id).num_computed)

    def kv_usage(self) -> float:
        return self.blocks.num_used_blocks / self.blocks.num_blocks

    def num_free_slots(self) -> int:
        return self._capacity.max_num_seqs - len(self.blocks)

    def prefix_cache_stats(self) -> tuple[int, int]:
        return (self.blocks.queried_tokens, self.blocks.hit_tokens)

    # ----- contract: forward ---------------------------------------------------------------

    def forward_batch(
        self,
        flat_ids: Sequence[int],
        positions: Sequence[int],
        sequence_ids: Sequence[str],
        *,
        logits_for: Sequence[str] | None = None,
        all_logits_for: Sequence[str] = (),
    ) -> np.ndarray:
        """See :meth:`Backend.forward_batch`. Rows follow ``logits_for`` (default: first-appearance order),
        then every row of the ``all_logits_for`` sequences (the LM head simply runs on more rows)."""
        ids = np.asarray(flat_ids, dtype=np.int64)
        pos = np.asarray(positions, dtype=np.int64)
        chunks = self._split(ids, pos, sequence_ids)
        wanted = [c.seq_id for c in chunks] if logits_for is None else list(logits_for)
        rows = self._logit_rows(chunks, wanted) + self._all_rows(chunks, all_logits_for)
        self._ensure_room(chunks)
        try:
            images = self._image_rows(chunks) if self._images else []
            rope = self._rope_positions(chunks, pos) if self._images and self._vision.uses_mrope else None
            logits = self._run(ids, pos, chunks, rows, images, rope)
        except Exception as err:  # the engine fails these sequences and lives on
            raise BackendError(f"torch forward failed: {type(err).__name__}: {err}", [c.seq_id for c in chunks]) from err
        flat = ids.tolist()  # one conversion, sliced per sequence (not one small array's tolist each)
        for c in chunks:
            tokens = flat[c.row_start : c.row_end]
            spans = self._images.get(c.seq_id)
            if spans and c.start_pos < spans[-1].end:  # (decodes past the last image: plain ids, no key list)
                tokens = cache_keys([0] * c.start_pos + tokens, spans)[c.start_pos:]
            self.blocks.record_computed_of(c.blocks, c.start_pos, tokens)
        return logits

    def _both_ways(self, c: StepChunk) -> tuple[tuple[int, int], ...]:
        """The image ranges of a chunk whose tokens see each other both ways (vision.bidirectional)."""
        if not self._vision.bidirectional:
            return ()
        end = c.start_pos + c.row_end - c.row_start
        ranges = (self._vision.image_range(s) for s in self._images.get(c.seq_id, ()))
        return tuple((a, b) for a, b in ranges if a < end and b > c.start_pos)

    def _rope_positions(self, chunks: list[StepChunk], pos: np.ndarray) -> torch.Tensor | None:
        """M-RoPE: the step's ``[3, T]`` rope positions where a sequence has images (time, row, column of each
        image token; text after an image continues from its largest position + 1); None when no sequence in
        the step has one (each token's index is its position)."""
        rope: np.ndarray | None = None
        for c in chunks:
            spans = self._images.get(c.seq_id)
            if not spans:
                continue
            if rope is None:
                rope = np.broadcast_to(pos, (3, len(pos))).copy()
            start, n = c.start_pos, c.row_end - c.row_start
            index = np.arange(start, start + n)
            shift = np.zeros(n, dtype=np.int64)
            for span in spans:
                mrope = span.payload.mrope
                base = span.start - int(shift[0]) if False else None  # (set below, per span)
                before = sum(s.length - s.positions for s in spans if s.end <= span.start)
                inside = (index >= span.start) & (index < span.end)
                if inside.any():
                    base = span.start - before
                    rope[:, c.row_start + np.flatnonzero(inside)] = base + mrope[:, index[inside] - span.start].numpy()
                shift[index >= span.end] += span.length - span.positions
            text = ~np.isin(index, [i for s in spans for i in range(s.start, s.end)])
            rope[:, c.row_start + np.flatnonzero(text)] = (index - shift)[text]
        return None if rope is None else self._to_device(rope)

    def _image_rows(self, chunks: list[StepChunk]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(flat rows, embeddings) of every image placeholder this step evaluates: the rows whose token
        embeddings the image's features replace."""
        out = []
        for c in chunks:
            start, end = c.start_pos, c.start_pos + c.row_end - c.row_start
            for span in self._images.get(c.seq_id, ()):
                if span.end <= start or span.start >= end:
                    continue
                offsets, feats = self._vision.features(span)
                at = span.start + offsets  # positions of the placeholders
                keep = (at >= start) & (at < end)
                out.append(((at[keep] - start + c.row_start).to(self.device), feats[keep.to(feats.device)]))
        return out

    def forward_ahead(self, token_ids: torch.Tensor | None, positions: Sequence[int], sequence_ids: Sequence[str], *,
                      flat_ids: Sequence[int] = (), flat_positions: Sequence[int] = (),
                      flat_sequence_ids: Sequence[str] = (), logits_for: Sequence[str] = ()) -> torch.Tensor:
        """See :meth:`Backend.forward_ahead`: one step (a graph replay where it is a pure decode that fits,
        else as a mixed step is run) whose decode ids are copied on the device from the sampler's output;
        nothing is recorded until ``confirm_ahead``."""
        n = len(positions)
        if len(set(sequence_ids)) != n or (token_ids.shape if n else (0,)) != (n,):  # type: ignore[union-attr]
            raise ValueError(f"forward_ahead takes one token per decode sequence (got {len(sequence_ids)} sequences, "
                             f"{n} positions, ids of shape {None if token_ids is None else tuple(token_ids.shape)})")
        if set(sequence_ids) & set(flat_sequence_ids):
            raise ValueError("a sequence is either a decode row or a host chunk of a step launched ahead, not both")
        pos = np.asarray(list(positions) + list(flat_positions), dtype=np.int64)
        seqs = list(sequence_ids) + list(flat_sequence_ids)
        chunks = self._split(pos, pos, seqs)
        self._ensure_room(chunks)
        host = np.asarray(flat_ids, dtype=np.int64)
        if not n:
            ids: np.ndarray | torch.Tensor = host
        elif not len(host):
            ids = token_ids  # type: ignore[assignment]
        else:
            ids = torch.cat([token_ids.to(self.device), self._to_device(host)])  # type: ignore[union-attr]
        rows = list(range(n)) + self._logit_rows(chunks, list(logits_for)) if logits_for else list(range(n))
        try:
            return self._run(ids, pos, chunks, rows)
        except Exception as err:
            raise BackendError(f"torch forward failed: {type(err).__name__}: {err}", [c.seq_id for c in chunks]) from err

    def confirm_ahead(self, sequence_ids: Sequence[str], token_ids: Sequence[Sequence[int]]) -> None:
        blocks = self.blocks
        for seq_id, tokens in zip(sequence_ids, token_ids):
            seq = blocks.sequence(seq_id)
            blocks.record_computed_of(seq, seq.num_computed, tokens)

    def _split(self, ids: np.ndarray, pos: np.ndarray, sequence_ids: Sequence[str]) -> list[StepChunk]:
        """Contiguous per-sequence runs, checked against each sequence's KV state."""
        if not (len(ids) == len(pos) == len(sequence_ids)) or len(ids) == 0:
            raise ValueError(
                f"flat_ids, positions and sequence_ids must be equally long and non-empty "
                f"(got {len(ids)}, {len(pos)}, {len(sequence_ids)})"
            )
        n = len(sequence_ids)
        if len(set(sequence_ids)) == n:  # one row per sequence (a decode step): no run to find
            starts: list[int] = list(range(n))
        else:
            starts = [0] + [r for r in range(1, n) if sequence_ids[r] != sequence_ids[r - 1]]
            if len({sequence_ids[r] for r in starts}) != len(starts):
                raise BackendError("each sequence's tokens must be contiguous in the batch",
                                   list(dict.fromkeys(sequence_ids)))
        ends = starts[1:] + [n]
        chunks = [self._chunk(sequence_ids[start], start, end) for start, end in zip(starts, ends)]
        # every row's position continues its sequence's KV: pos[r] == start_pos + (r - row_start)
        offsets = np.fromiter((c.start_pos - c.row_start for c in chunks), dtype=np.int64, count=len(chunks))
        lengths = np.fromiter((c.row_end - c.row_start for c in chunks), dtype=np.int64, count=len(chunks))
        wrong = np.flatnonzero(pos != np.repeat(offsets, lengths) + np.arange(n))
        if wrong.size:
            c = next(c for c in chunks if c.row_start <= wrong[0] < c.row_end)
            raise BackendError(
                f"sequence {c.seq_id!r}: positions must continue from its {c.start_pos} tokens in KV "
                f"(got {pos[c.row_start : c.row_end][:4].tolist()}...)",
                [c.seq_id],
            )
        return chunks

    def _chunk(self, seq_id: str, row_start: int, row_end: int) -> StepChunk:
        seq = self.blocks.get(seq_id)
        if seq is None:
            raise BackendError(f"sequence {seq_id!r} was not admitted", [seq_id])
        return StepChunk(seq_id, row_start, row_end, seq.num_computed, seq)

    def _logit_rows(self, chunks: list[StepChunk], wanted: list[str]) -> list[int]:
        if len(wanted) == len(chunks) and all(w == c.seq_id for w, c in zip(wanted, chunks)):
            return [c.row_end - 1 for c in chunks]  # every sequence, in batch order (a decode step, typically)
        last_row = {c.seq_id: c.row_end - 1 for c in chunks}
        missing = [s for s in wanted if s not in last_row]
        if missing:
            raise ValueError(f"logits_for names sequences with no tokens in this batch: {missing}")
        return [last_row[s] for s in wanted]

    @staticmethod
    def _all_rows(chunks: list[StepChunk], wanted: Sequence[str]) -> list[int]:
        by_id = {c.seq_id: c for c in chunks}
        missing = [s for s in wanted if s not in by_id]
        if missing:
            raise ValueError(f"all_logits_for names sequences with no tokens in this batch: {missing}")
        return [row for s in wanted for row in range(by_id[s].row_start, by_id[s].row_end)]

    def _ensure_room(self, chunks: list[StepChunk]) -> None:
        """Grow block tables the scheduler did not reserve; KVCacheFullError if the pool is out."""
        block_size = self.blocks.block_size
        for c in chunks:
            end = c.start_pos + c.row_end - c.row_start
            if len(c.blocks.block_ids) * block_size >= end:
                continue  # reserved already (the scheduler does, before each step)
            if not self.blocks.reserve(c.seq_id, end):
                raise KVCacheFullError(f"KV cache full: no block free for sequence {c.seq_id!r}", [c.seq_id])

    @torch.inference_mode()
    def _run(self, ids: np.ndarray | torch.Tensor, pos: np.ndarray, chunks: list[StepChunk], rows: list[int],
             images: list[tuple[torch.Tensor, torch.Tensor]] = (), rope: torch.Tensor | None = None) -> np.ndarray | torch.Tensor:
        """The step's logits rows ``rows``. ``ids`` is a host array, or (a step launched ahead) a tensor
        already on the device, for a pure decode step. ``images``: (rows, embeddings) in place of those
        rows' token embeddings (a step with images runs eagerly)."""
        seq_chunks = [SeqChunk(c.row_start, c.row_end - c.row_start, c.start_pos, c.blocks.block_ids,
                               self._both_ways(c) if images else ()) for c in chunks]
        if images or rope is not None:
            return self._out(self._forward_eager(ids, pos, seq_chunks, rows, images, rope))
        if self._graphs is not None and len(chunks) == len(ids):  # a pure decode step: replay a graph
            logits = self._graphs.run(ids, seq_chunks)
            if logits is not None:  # rows in chunk order; row_start == chunk index here
                if rows != list(range(len(chunks))):
                    logits = logits.index_select(0, self._to_device(np.asarray(rows, dtype=np.int64)))
                return self._out(logits)
        elif self._graphs is not None:
            logits = self._forward_split(ids, pos, seq_chunks, rows)
            if logits is not None:
                return self._out(logits)
        return self._out(self._forward_eager(ids, pos, seq_chunks, rows))

    def _forward_split(self, ids: np.ndarray, pos: np.ndarray, seq_chunks: list[SeqChunk],
                       rows: list[int]) -> torch.Tensor | None:
        """A step with decodes or short tails (see attention.is_tail) beside other chunks: the decodes and
        the tails' tokens, one row each, replay a graph; the rest (fresh or long chunks) run eagerly after
        it. None if no row fits a graph.

        Under load nearly every step is such a step (each finished request's successor brings its
        prompt, whose start the prefix cache often holds), and one eager forward over all of it cost
        the CPU several milliseconds of kernel launches per step (at 256 streams on an H100: ~40 % of
        the engine process, steps 2.6 x the raw decode step). A tail's tokens are attended as decodes
        are (each reads its sequence's K/V up to its own position, written before attention runs in
        every layer), so the graph takes them as it takes several decodes of one sequence. The two
        parts write disjoint K/V slots and attend to their own sequences only, so their order does not
        matter; the eager part's launches overlap the graph's run on the device."""
        room = self._graphs.buckets[-1]
        graph_rows: list[SeqChunk] = []  # one-token rows (graph row numbers): decodes and tails' tokens
        flat_rows: list[int] = []  # each graph row's flat row in the step
        rest: list[SeqChunk] = []
        for c in seq_chunks:
            if (c.num_tokens == 1 or is_tail(c)) and len(graph_rows) + c.num_tokens <= room:
                graph_rows += [SeqChunk(len(graph_rows) + i, 1, c.start_pos + i, c.block_ids) for i in range(c.num_tokens)]
                flat_rows += range(c.row_start, c.row_start + c.num_tokens)
            else:
                rest.append(c)
        if not graph_rows:
            return None
        place = np.empty(len(ids), dtype=np.int64)  # each flat row's place in [graph rows; rest rows]
        starts = np.asarray(flat_rows, dtype=np.int64)
        place[starts] = np.arange(len(graph_rows))
        rest_rows = np.concatenate([np.arange(c.row_start, c.row_start + c.num_tokens) for c in rest]) if rest else starts[:0]
        place[rest_rows] = len(graph_rows) + np.arange(len(rest_rows))
        wanted = place[np.asarray(rows, dtype=np.int64)]
        logits = self._graphs.run(ids[starts], graph_rows)
        if logits is None:
            return None
        if rest:
            rest_chunks, offset = [], 0
            for c in rest:
                rest_chunks.append(SeqChunk(offset, c.num_tokens, c.start_pos, c.block_ids))
                offset += c.num_tokens
            from_rest = wanted >= len(graph_rows)
            rest_logits = self._forward_eager(ids[rest_rows], pos[rest_rows], rest_chunks,
                                              (wanted[from_rest] - len(graph_rows)).tolist())
            # combined: every graph row, then the rest's wanted rows in request order
            logits = torch.cat([logits, rest_logits.to(logits.dtype)])
            wanted[from_rest] = len(graph_rows) + np.arange(int(from_rest.sum()))
        return logits.index_select(0, self._to_device(wanted))

    def _forward_eager(self, ids: np.ndarray | torch.Tensor, pos: np.ndarray, seq_chunks: list[SeqChunk], rows: list[int],
                       images: list[tuple[torch.Tensor, torch.Tensor]] = (), rope: torch.Tensor | None = None) -> torch.Tensor:
        """One step without a graph. If FlexAttention fails to compile for it, the step is run again with
        SDPA (its K/V writes land in the same slots with the same values) and so is every later eager step:
        a compile failure costs speed, never a request (logged once)."""
        inputs = (self._to_device(ids), self._to_device(pos))
        logit_rows = self._to_device(np.asarray(rows, dtype=np.int64))
        q_per_kv = self.spec.num_heads // self.spec.num_kv_heads
        # (image tokens that see each other both ways: only the SDPA path's masks say so)
        mode = "sdpa" if any(c.bidirectional for c in seq_chunks) else self._eager_attention
        batch = build_attention_batch(seq_chunks, self.kv, q_per_kv=q_per_kv, mode=mode,
                                      flex_fn=self._flex_fn, windows=self._windows)
        extra = {"images": images} if images else {}
        if rope is not None:
            extra["rope_positions"] = rope
        try:
            return self.model(*inputs, self.kv, batch, logit_rows, **extra)
        except Exception as err:
            if self._eager_attention != "flex" or not is_compile_error(err):
                raise
            log.warning("FlexAttention failed to compile for a %d-token step (%s: %s); steps without a CUDA graph "
                        "use SDPA from now on", len(ids), type(err).__name__, str(err).splitlines()[0] if str(err) else "")
            self._eager_attention = "sdpa"
        batch = build_attention_batch(seq_chunks, self.kv, q_per_kv=q_per_kv, mode="sdpa")
        return self.model(*inputs, self.kv, batch, logit_rows, **extra)

    def _out(self, logits: torch.Tensor) -> np.ndarray | torch.Tensor:
        """The step's logits for the engine: left on the device for the torch sampler, else a numpy copy."""
        if not self._device_sampling:
            return logits.cpu().numpy()
        with torch.inference_mode(False):  # a normal tensor: the grammar mask and sampler edit it in place
            return logits.clone()

    def _to_device(self, array: np.ndarray | torch.Tensor) -> torch.Tensor:
        if isinstance(array, torch.Tensor):  # (ids sampled on the device: a step launched ahead)
            return array.to(self.device)
        return to_device(array, self.device)

    # ----- optional: embeddings -----------------------------------------------------------

    @property
    def embedding_max_tokens(self) -> int:
        return min(self._embedding_config.embedding_batch_tokens, self.spec.max_position_embeddings)

    def embed(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """Pooled hidden states (see :mod:`cllm.backends.torch.embedding`); auto pooling is mean here."""
        cfg = self._embedding_config
        pooling = "mean" if cfg.embedding_pooling == "auto" else cfg.embedding_pooling
        out = np.empty((len(inputs), self.spec.hidden_size), dtype=np.float32)
        # model.deterministic: one input per forward, so nothing beside it changes its kernels' shapes
        groups = pack_inputs([len(x) for x in inputs], max_tokens=self.embedding_max_tokens,
                             max_inputs=1 if self.determinism.on else cfg.embedding_max_inputs)
        for group in groups:
            out[group.start:group.stop] = pooled_hidden_states(self.model, [inputs[i] for i in group], pooling, self.device)
        return out

    # ----- optional: state swap ------------------------------------------------------------

    def save_state(self, sequence_id: str) -> bytes:
        """The sequence's computed tokens and their K/V (all layers), serialised."""
        seq = self.blocks.sequence(sequence_id)
        rows = self._cache_rows(seq.block_ids, 0, seq.num_computed)
        keys, values = zip(*(self.kv.read(layer, rows) for layer in range(self.spec.num_layers)))
        buffer = io.BytesIO()
        torch.save(
            {"tokens": seq.token_ids[: seq.num_computed], "k": torch.stack(keys).cpu(), "v": torch.stack(values).cpu()},
            buffer,
        )
        return buffer.getvalue()

    def restore_state(self, sequence_id: str, state: bytes, token_ids: Sequence[int] = ()) -> bool:
        """Load a save_state snapshot into the admitted sequence; False if its blocks do not fit.

        Afterwards the sequence holds exactly the snapshot's tokens in KV, even
        if its admission matched a longer cached prefix (that surplus is let go,
        since the scheduler continues from the snapshot's length).
        """
        snap = torch.load(io.BytesIO(state), map_location="cpu", weights_only=True)
        tokens: list[int] = snap["tokens"]
        token_ids = self._keys(sequence_id, token_ids)
        if token_ids and list(token_ids) != tokens:
            raise ValueError(f"sequence {sequence_id!r}: token_ids differ from the snapshot's tokens")
        self.blocks.truncate(sequence_id, len(tokens))
        if not self.blocks.reserve(sequence_id, len(tokens)):
            return False
        seq = self.blocks.sequence(sequence_id)
        start = seq.num_computed  # blocks matched in the prefix cache already hold these
        if len(tokens) > start:
            rows = self._cache_rows(seq.block_ids, start, len(tokens))
            k, v = snap["k"][:, start:].to(self.device, self.dtype), snap["v"][:, start:].to(self.device, self.dtype)
            for layer in range(self.spec.num_layers):
                self.kv.write(layer, rows, k[layer], v[layer])
        self.blocks.record_computed(sequence_id, 0, tokens)
        return True

    # ----- optional: KV hand-off (segments: a geometry header, then one per block) ---------

    def export_kv(self, sequence_id: str) -> list[bytes]:
        """The sequence's computed KV: a JSON header, then each block of its (non-contiguous) block
        table as one segment holding that block's K and V for every layer ``[2, layers, *block]``
        (PagedKVCache.block)."""
        seq = self.blocks.sequence(sequence_id)
        n = seq.num_computed
        segments = [json.dumps(self._kv_geometry(n)).encode()]
        block_ids = seq.block_ids[: -(-n // self.blocks.block_size)]
        if block_ids:
            # One gather and one device-to-host copy for every block (a copy per block was a sync per
            # block inside the engine step), then sliced per block on the host.
            segments.extend(self._segments_of(self._gather_blocks(block_ids)))
        return segments

    def _segments_of(self, blocks: torch.Tensor) -> list[bytes]:
        """``[blocks, ...]`` as one bytes segment per block, through one copy to the host. On CUDA the
        copy lands in pinned memory from PyTorch's caching host allocator: a fresh pageable buffer
        of a long sequence's size page-faults on every hand-off (measured slower than per-block
        copies on an H200)."""
        flat = blocks.reshape(blocks.shape[0], -1).view(torch.uint8)
        if flat.device.type == "cuda":
            host = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(flat)
        else:
            host = flat.cpu()
        return [row.tobytes() for row in host.numpy()]

    def _blocks_from(self, segments: Sequence[bytes], block_shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Equal-sized block segments as ``[blocks, 2, *block_shape]`` on the device, through one copy
        from the host (pinned on CUDA, as in :meth:`_segments_of`)."""
        size = len(segments[0])
        host = torch.empty((len(segments), size), dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        rows = host.numpy()
        for row, segment in zip(rows, segments):
            if len(segment) != size:
                raise ValueError(f"handed-over KV blocks differ in size ({len(segment)} and {size} bytes)")
            row[:] = np.frombuffer(segment, dtype=np.uint8)
        return host.view(dtype).view(len(segments), 2, *block_shape).to(self.device)

    def _block_dim(self) -> int:
        """The block axis of the K/V pools ([layers, heads, blocks, ...] or [layers, blocks, ...])."""
        return 2 if self.kv.head_major else 1

    def _gather_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """K and V of these blocks as ``[blocks, 2, layers, *block]`` (contiguous, on the pool's device):
        block i is the hand-off segment of ``block_ids[i]``."""
        dim = self._block_dim()
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.kv.k.device)
        both = torch.stack((self.kv.k.index_select(dim, index), self.kv.v.index_select(dim, index)))
        return both.movedim(dim + 1, 0).contiguous()

    def import_kv(self, sequence_id: str, segments: Sequence[bytes], token_ids: Sequence[int]) -> bool:
        """Write handed-over blocks into this sequence's own blocks (a scatter into its block table).

        Blocks its admission matched in the local prefix cache already hold these tokens' KV
        (and may be shared), so they are kept, not overwritten.
        """
        tokens = list(self._keys(sequence_id, token_ids))
        header = json.loads(bytes(segments[0]))
        expected = self._kv_geometry(len(tokens))
        if header != expected:
            raise ValueError(f"sequence {sequence_id!r}: handed-over KV has geometry {header}, this engine needs {expected}")
        if len(segments) - 1 != -(-len(tokens) // self.blocks.block_size):
            raise ValueError(f"sequence {sequence_id!r}: {len(segments) - 1} KV blocks handed over for {len(tokens)} tokens")
        self.blocks.truncate(sequence_id, len(tokens))
        if not self.blocks.reserve(sequence_id, len(tokens)):
            return False
        seq = self.blocks.sequence(sequence_id)
        first = seq.num_computed // self.blocks.block_size
        if first < len(segments) - 1:
            # Every block in one host-to-device copy and one scatter per pool (not a copy per block).
            k0, _ = self.kv.block(seq.block_ids[first])
            count = len(segments) - 1 - first
            blocks = self._blocks_from(segments[first + 1:], k0.shape, k0.dtype)
            self._scatter_blocks(seq.block_ids[first:first + count], blocks)
        self.blocks.record_computed(sequence_id, 0, tokens)
        return True

    def _scatter_blocks(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Write ``[blocks, 2, layers, *block]`` (what _gather_blocks gives) into these blocks."""
        dim = self._block_dim()
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.kv.k.device)
        self.kv.k.index_copy_(dim, index, blocks[:, 0].movedim(0, dim))
        self.kv.v.index_copy_(dim, index, blocks[:, 1].movedim(0, dim))

    def _kv_geometry(self, num_tokens: int) -> dict[str, object]:
        """What two engines must agree on for their KV blocks to be interchangeable."""
        s = self.kv.shape
        return {"format": "cllm-torch-kv-blocks/1", "num_tokens": num_tokens, "block_size": s.block_size,
                "num_layers": s.num_layers, "num_kv_heads": s.num_kv_heads, "head_dim": s.head_dim,
                "dtype": str(self.kv.k.dtype), "head_major": self.kv.head_major}

    def _cache_rows(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Cache rows (every kv head) of positions start..end-1 of a sequence with these blocks."""
        chunk = SeqChunk(0, end - start, start, block_ids)
        return self._to_device(self.kv.write_rows(slot_mapping([chunk], self.blocks.block_size)))

    def close(self) -> None:
        """Drop the weights and KV pool (the backend is unusable afterwards). Idempotent."""
        for held in ("_graphs", "model", "kv"):  # the captured graphs hold the model, the pool and their own memory
            self.__dict__.pop(held, None)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _load_tokenizer(loaded: LoadedModel, vocab_size: int, chat_template: str | None = None) -> HFTokenizer | None:
    """The model's tokenizer; None for a bare weights directory (forward_batch still works)."""
    directory = loaded.tokenizer_dir
    has_files = loaded.gguf_file is not None or any(
        (directory / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    )
    if not has_files:
        return None
    return HFTokenizer.load(directory, gguf_file=loaded.gguf_file, vocab_size=vocab_size, extra_eos_ids=loaded.eos_token_ids,
                            chat_template=chat_template, hf_tokenizer=loaded.hf_tokenizer)


CPU_N_SEQ_MAX = 8  # sequences at once on CPU when n_seq_max is unset
CPU_KV_TOKENS = 16384  # KV pool in tokens on CPU when n_ctx is unset


def _kv_tokens(config: CllmConfig) -> int:
    return config.model.n_ctx or CPU_KV_TOKENS


def _step_limits(config: CllmConfig, device: torch.device) -> tuple[int, int]:
    """Sequences at once and tokens per step: n_seq_max / n_batch (CPU-sized), or the gpu_* values on CUDA."""
    m, t = config.model, config.torch
    n_seq_max = m.n_seq_max or CPU_N_SEQ_MAX
    if device.type == "cuda":
        return t.gpu_n_seq_max or n_seq_max, t.gpu_n_batch or m.n_batch
    return n_seq_max, m.n_batch


def _moe_text(moe: MoEWeights) -> str:
    """How a CPU runs the sparse layers' experts, for the load log."""
    if moe.dense is None:
        return "a matmul per expert hit"
    if not moe.dense_max_tokens:
        return "a matmul per expert hit (the dense copy was never faster when timed at load)"
    first = -(-len(moe.experts) // moe.top_k)
    return (f"batches of {first}-{moe.dense_max_tokens} tokens as two GEMMs over all experts (a second copy of them),"
            " others a matmul per expert hit")


def _usable_cores() -> int:
    """Cores this process may run on (the affinity mask, not the machine's total)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _max_model_len(spec: ModelSpec, n_ctx: int) -> int:
    """Longest sequence: KV room and trained context (a sliding window does not cap it: its layers
    attend over their window, see attention.AttentionBatch.windowed)."""
    return min(n_ctx, spec.max_position_embeddings)

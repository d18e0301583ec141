"""The backend contract every inference runtime implements.

The scheduler decides *which* tokens of *which* sequences run each step; a
backend only evaluates them and keeps each sequence's KV cache. One step is one
call::

    logits = backend.forward_batch(flat_ids, positions, sequence_ids,
                                   logits_for=sampled_ids)

Besides the forward pass a backend owns its KV room, so the scheduler asks it
for room before scheduling tokens (``admit`` for a new sequence, ``reserve`` to
grow one) and gives room back with ``release``. Both sides work with plain
request-id strings: how an id maps onto a llama.cpp seq_id or onto a paged
block table is the backend's business.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cllm.backends.determinism import OFF, Determinism
from cllm.multimodal.prompt import MultimodalPrompt
from cllm.multimodal.span import ImageSpan
from cllm.sampling.dispatch import launch_sample
from cllm.sampling.sampler import SamplingRow


class BackendError(RuntimeError):
    """A forward pass failed for some sequences; only they fail, the engine lives.

    ``sequence_ids`` names the sequences whose tokens were in the failing batch.
    Their KV state is unknown afterwards, so the engine releases them.
    """

    def __init__(self, message: str, sequence_ids: Sequence[str]) -> None:
        super().__init__(message)
        self.sequence_ids = list(sequence_ids)


class KVCacheFullError(BackendError):
    """The backend found no KV room mid-batch: the scheduler should preempt and retry."""


@dataclass(slots=True, frozen=True)
class BackendCapacity:
    """What the scheduler may ask of a backend in one step and overall."""

    max_num_seqs: int  # sequences that can hold KV at once (llama.cpp: n_seq_max)
    max_batch_tokens: int  # tokens one forward_batch call may carry (llama.cpp: n_batch)
    max_model_len: int  # longest sequence (prompt + output) one request may reach
    kv_tokens: int  # KV cache room in tokens, shared by all sequences


@dataclass(slots=True, frozen=True)
class Admission:
    """A sequence got a place in the backend (slot / block table)."""

    num_cached_tokens: int  # leading prompt tokens already in KV (prefix reuse); never all of them


class Tokenizer(ABC):
    """The model's tokenizer, as the engine needs it."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of logits per row."""

    @property
    @abstractmethod
    def eos_token_ids(self) -> frozenset[int]:
        """Tokens that end generation (EOS and end-of-turn)."""

    @property
    @abstractmethod
    def bos_token_id(self) -> int | None:
        """Beginning-of-sequence token, if the model uses one."""

    @abstractmethod
    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Text to token ids; ``add_special`` adds BOS where the model wants it; ``parse_special``
        turns special-token text ("<|im_end|>") into its control token (never for untrusted text)."""

    @abstractmethod
    def decode(self, token_ids: Sequence[int]) -> str:
        """Token ids to text; invalid/incomplete UTF-8 shows as U+FFFD."""

    @abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (for logprobs' ``bytes`` field)."""

    @property
    @abstractmethod
    def chat_template(self) -> str | None:
        """The Jinja chat template from the model's metadata, if it has one."""

    def special_token(self, token_id: int) -> str:
        """The text form of a special token, for templates ("<|im_end|>")."""
        return self.decode([token_id])

    @property
    def control_tokens(self) -> Sequence[str]:
        """The texts that special-token parsing turns into control tokens ("<|im_start|>"): a chat
        template may write them, a caller's message never (cllm.chat_template). None by default,
        for tokenizers that parse no special-token text."""
        return ()


class Backend(ABC):
    """An inference runtime the scheduler drives. See the module docstring."""

    name: str = "base"
    # True when forward_batch returns before the device has finished (logits still being computed, e.g.
    # CUDA): the engine then does the previous step's host-side text work in that time (LLMEngine.step).
    overlaps_host_work: bool = False
    # True when steps run on a GPU: a prompt's prefill there costs little beside a decode step, and the
    # scheduler's auto stall bound (max_decode_stall_ms: auto) is off (it cost 5-10 % of the server's
    # throughput on an H200 with no steady latency gain; docs/gpu.md).
    on_gpu: bool = False
    # True when the backend can launch a decode step on ids its device sampled and the host has not read
    # (forward_ahead / confirm_ahead): the engine's one-step lookahead (scheduler.lookahead).
    supports_lookahead: bool = False
    # model.deterministic: what the backend changed to make results batch-invariant, and what it cannot
    # promise here (the ready block and /v1/engine say it; docs/reproducibility.md)
    determinism: Determinism = OFF

    @property
    @abstractmethod
    def capacity(self) -> BackendCapacity:
        """Fixed limits, read once by the scheduler."""

    @property
    @abstractmethod
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""

    @abstractmethod
    def admit(self, sequence_id: str, token_ids: Sequence[int], *, reuse_prefix: bool = True) -> Admission | None:
        """Give a new (or resumed) sequence a place; None when none is free now.

        ``reuse_prefix=False`` forbids a prefix-cache hit (num_cached_tokens is 0):
        the engine asks for that when it needs the logits of every prompt token
        (prompt logprobs), which cached tokens would skip. The engine passes the
        keyword only then, so a backend without prefix reuse may ignore it.

        ``token_ids`` is everything the sequence holds so far (prompt, plus
        output already generated for a recompute-resumed sequence). A backend
        with prefix reuse may report leading tokens already in KV; it never
        reports all of them, because the last token must be evaluated to get
        logits.
        """

    @abstractmethod
    def reserve(self, sequence_id: str, num_tokens: int) -> bool:
        """Make room for the admitted sequence to hold ``num_tokens`` tokens in KV.

        False means the KV cache is full: the scheduler must preempt someone.
        """

    @abstractmethod
    def forward_batch(
        self,
        flat_ids: Sequence[int],
        positions: Sequence[int],
        sequence_ids: Sequence[str],
        *,
        logits_for: Sequence[str] | None = None,
        all_logits_for: Sequence[str] = (),
    ) -> np.ndarray:
        """Evaluate one step's tokens and return next-token logits.

        flat_ids: every scheduled sequence's new tokens, concatenated; each
            sequence's tokens are contiguous and in position order.
        positions: the absolute position of each token in its own sequence.
        sequence_ids: the sequence owning each token.
        logits_for: the sequences whose last-token logits are wanted, in the
            order of the returned rows; default: every sequence in the batch in
            order of first appearance. A sequence whose prefill chunk is not
            its last needs none.
        all_logits_for: sequences whose logits are wanted at *every* token
            they have in this batch, not only the last (prompt logprobs score
            each prompt token under the logits of the position before it).
            Their rows follow the ``logits_for`` rows: for each sequence in
            ``all_logits_for`` order, one row per token of its chunk, in
            position order. A sequence may be in both lists (its last row then
            appears twice). Empty (the default) costs nothing extra.

        Returns a float32 array of shape ``(len(logits_for) + T, vocab_size)``,
        T being the number of tokens the ``all_logits_for`` sequences have in
        the batch: a numpy array, or a torch tensor left on the backend's device
        when the backend samples there (the engine then uses the torch sampler;
        see cllm/sampling/dispatch.py).
        Raises BackendError naming the sequences that failed.
        """

    @abstractmethod
    def release(self, sequence_id: str, *, keep_cache: bool = True) -> None:
        """Free the sequence's place and KV. Idempotent.

        With ``keep_cache`` a backend with prefix reuse may keep the tokens as
        reusable cache until the room is needed; without it the KV is dropped
        (failed sequences, whose KV may be garbage).
        """

    def sample(self, logits: Any, rows: Sequence[SamplingRow]) -> Any:
        """Sample one token per row of this backend's logits, launched: see ``dispatch.launch_sample``
        (``token_ids`` on the device, ``results()`` waits for it). A backend whose device is simulated
        (the null backend's asynchronous mode) makes ``results()`` wait as a real device would."""
        return launch_sample(logits, rows)

    def forward_ahead(self, token_ids: Any, positions: Sequence[int], sequence_ids: Sequence[str], *,
                      flat_ids: Sequence[int] = (), flat_positions: Sequence[int] = (),
                      flat_sequence_ids: Sequence[str] = (), logits_for: Sequence[str] = ()) -> Any:
        """Launch a step before the host has read the ids it runs on: one decode token per sequence of
        ``sequence_ids`` whose ids are ``token_ids``, a device tensor (a ``sample()``'s ``token_ids``, in
        order; None when there are none) at ``positions``, plus host tokens given as ``forward_batch``
        takes them (``flat_*``: prompt chunks that join the step; other sequences). Returns, without
        waiting for the device, one logits row per decode sequence, then one per ``logits_for`` sequence
        (its last flat token), as ``forward_batch`` would.

        Positions are checked as ``forward_batch`` checks them and the K/V is written there, but the
        sequences do not hold these tokens yet: only ``confirm_ahead`` adds them (to the KV length and
        the prefix cache), once the host knows the ids. A row the engine drops (its request ended, was
        preempted or aborted meanwhile) is never confirmed, so it is simply forgotten: its slots are
        rewritten by whatever comes next. The engine reserves the room (``reserve``) first. Only where
        ``supports_lookahead``."""
        raise NotImplementedError(f"the {self.name} backend has no lookahead")

    def confirm_ahead(self, sequence_ids: Sequence[str], token_ids: Sequence[Sequence[int]]) -> None:
        """The host knows the tokens a ``forward_ahead`` ran: each named sequence now holds
        ``token_ids[i]`` at the positions that step wrote (its KV length grows by their number)."""
        raise NotImplementedError(f"the {self.name} backend has no lookahead")

    def truncate(self, sequence_id: str, num_tokens: int) -> int:
        """Forget the sequence's KV past its first ``num_tokens`` tokens (draft tokens a speculative step
        evaluated and the target rejected); the sequence keeps its place and its reserved room. What is
        forgotten never serves a prefix-cache hit. Returns the tokens it still holds: fewer than
        ``num_tokens`` where the memory cannot drop a tail (they are evaluated again). Only called where
        ``supports_speculation``."""
        raise RuntimeError(f"backend {self.name!r} cannot truncate a sequence's KV")

    def kv_usage(self) -> float:
        """Fraction of KV room in use by live sequences (0..1)."""
        return 0.0

    def num_free_slots(self) -> int:
        """Sequence places free now (idle cached slots count as free)."""
        return self.capacity.max_num_seqs

    def idle_work(self) -> bool:
        """Do one short unit of housekeeping while no request is live (the server's engine calls it
        between waits for work, a unit at a time, so a new request waits at most one unit); True if
        it did something and may have more."""
        return False

    # Optional capabilities. Each is discoverable through a `supports_*` flag.
    supports_prefix_cache: bool = False
    supports_state_swap: bool = False
    supports_embeddings: bool = False
    supports_speculation: bool = False  # truncate() works: draft tokens can be verified and rolled back
    # A sequence with draft tokens in a step with other sequences runs them as a forward pass of its own
    # (llama.cpp's split KV cache: a micro-batch holds consecutive seq_ids with equal token counts).
    drafts_run_apart: bool = False
    # Images in prompts (a projector / vision tower loaded): expand_images, and admit(images=...)
    supports_images: bool = False
    vision_text: str | None = None  # what encodes images, for the ready block and /v1/engine

    def expand_images(self, prompt: MultimodalPrompt) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """A prompt's ids with each image replaced by the ids that stand for it (the model's image
        markers around placeholder ids, one per embedding the encoder will give), and the images' spans
        in those ids. Called once per request, before admission; ``admit`` then gets the spans as
        ``images=`` and ``forward_batch`` evaluates a span's placeholders as the image's embeddings
        (the scheduler never splits a span over two steps: ``Request.fit_chunk``). A backend keys its
        prefix cache on each span's ``image.hash`` besides the ids. ValueError for an image the
        encoder refuses."""
        raise ValueError(f"this model does not accept images (backend {self.name!r}, no vision encoder loaded)")

    @property
    def embedding_max_tokens(self) -> int:
        """Longest input ``embed`` takes (0 without embeddings)."""
        return 0

    def embed(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """Pooled final hidden states: float32 ``[len(inputs), hidden]``, one row per input, not normalised.

        Several inputs run in one forward (packed up to the backend's embedding
        budget). Embedding never touches generation's sequence slots or KV
        cache, so it may run between any two ``forward_batch`` steps (the engine
        calls it on its own thread, never concurrently with a step).
        """
        raise RuntimeError(f"backend {self.name!r} cannot compute embeddings")

    def save_state(self, sequence_id: str) -> bytes:
        """Snapshot one sequence's KV (swap-out preemption, migration)."""
        raise RuntimeError(f"backend {self.name!r} cannot save sequence state")

    def restore_state(self, sequence_id: str, state: bytes, token_ids: Sequence[int] = ()) -> bool:
        """Load a snapshot of ``token_ids``' KV into an admitted sequence; False if it fails."""
        raise RuntimeError(f"backend {self.name!r} cannot restore sequence state")

    def export_kv(self, sequence_id: str) -> list[bytes]:
        """One sequence's KV as segments, for a hand-off to another engine (KV hand-off).

        Default: one segment, the ``save_state`` snapshot. A paged backend gives one
        segment per block, so the transfer gathers straight from scattered blocks.
        """
        return [self.save_state(sequence_id)]

    def import_kv(self, sequence_id: str, segments: Sequence[bytes], token_ids: Sequence[int]) -> bool:
        """Load segments from another engine's ``export_kv`` into an admitted sequence; False if they
        do not fit now. ``token_ids`` are the tokens the KV holds."""
        return self.restore_state(sequence_id, b"".join(segments), token_ids)

    def prefix_cache_stats(self) -> tuple[int, int]:
        """(prompt tokens asked for, prompt tokens served from cache) since start."""
        return (0, 0)

    def close(self) -> None:
        """Free native resources. Idempotent."""

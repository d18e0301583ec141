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

``device_ms`` instead simulates a device that runs *asynchronously*, as a GPU does: a forward is
launched onto a timeline where each step takes ``device_ms`` plus ``token_us`` per token, one after
another (``SimulatedDevice``), and returns at once; the host waits only when it reads sampled ids
(``sample(...).results()`` waits for every step launched before that sample, as ``.tolist()`` does
for CUDA). Host work placed between a launch and that wait overlaps the device; host work placed
after it does not. With ``device="torch"`` it also runs the engine's one-step lookahead
(``forward_ahead``). ``keyed=True`` makes each row's logits a function of the sequence's last token
and its position only (not of the row's place in the batch), so two schedules of the same requests
must give the same tokens: what the lookahead's tests compare.
"""
from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from cllm.backends.base import Admission, Backend, BackendCapacity, BackendError, Tokenizer
from cllm.sampling.dispatch import launch_sample
from cllm.sampling.sampler import SampledToken, SamplingRow

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


class SimulatedDevice:
    """A device's timeline: launched steps run one after another, each taking its duration from when the
    device is free (so a step launched while another runs starts when that one ends); ``wait(n)`` sleeps
    (GIL released) until step ``n`` is done. Nothing runs between: completion is a time, not a thread
    that would need the GIL to finish (a GPU does not), so a busy host never delays the device."""

    def __init__(self) -> None:
        self._free_at = 0.0  # when the last launched step ends (perf_counter seconds)
        self._done_at: dict[int, float] = {}  # launched, not yet waited for: number -> end time
        self.launched = 0
        self.busy_s = 0.0  # seconds of device time launched

    def launch(self, seconds: float) -> int:
        """Launch a step of ``seconds``; returns its number (for ``wait``)."""
        self.launched += 1
        self._free_at = max(time.perf_counter(), self._free_at) + seconds
        self._done_at[self.launched] = self._free_at
        self.busy_s += seconds
        return self.launched

    def wait(self, number: int) -> None:
        """Return once step ``number`` (and so every step before it) has run."""
        done = self._done_at.get(number)
        for n in [n for n in self._done_at if n <= number]:  # (at most a few are pending)
            del self._done_at[n]
        if done is not None and (left := done - time.perf_counter()) > 0:
            time.sleep(left)

    def close(self) -> None:
        self._done_at.clear()


class _DeviceSample:
    """A sample whose host values are ready once the device has run the steps launched before it."""

    def __init__(self, launched: Any, device: SimulatedDevice, number: int) -> None:
        self.token_ids = launched.token_ids
        self._launched, self._device, self._number = launched, device, number

    def results(self) -> list[SampledToken]:
        self._device.wait(self._number)
        return self._launched.results()


class NullBackend(Backend):
    """``NullBackend(slots=256, vocab_size=1024, max_batch_tokens=8192, kv_tokens=4M, device="numpy", word_bytes=0,
    step_ms=0.0, token_us=0.0, syncs=2, device_ms=0.0, keyed=False)``."""

    name = "null"
    supports_prefix_cache = False
    supports_state_swap = False
    supports_embeddings = False

    def __init__(self, *, slots: int = 256, vocab_size: int = 1024, max_batch_tokens: int = 8192,
                 max_model_len: int = 32768, kv_tokens: int = 1 << 22, device: str = "numpy", seed: int = 0,
                 word_bytes: int = 0, step_ms: float = 0.0, token_us: float = 0.0, syncs: int = 2,
                 device_ms: float = 0.0, keyed: bool = False) -> None:
        if device not in ("numpy", "torch"):
            raise ValueError(f"device must be 'numpy' or 'torch', got {device!r}")
        if step_ms < 0 or token_us < 0 or syncs < 1 or device_ms < 0:
            raise ValueError(f"step_ms={step_ms}, token_us={token_us}, syncs={syncs}, device_ms={device_ms}: "
                             "need step_ms, token_us, device_ms >= 0 and syncs >= 1")
        if step_ms and device_ms:
            raise ValueError("give step_ms (a synchronous device) or device_ms (an asynchronous one), not both")
        # An asynchronous device (device_ms): forwards are launched onto it and waited for in sample().
        self._device = SimulatedDevice() if device_ms else None
        self._device_s = device_ms / 1000
        # (a GPU's proxy: the scheduler treats it as one, e.g. no auto stall bound on prompt chunks)
        self.overlaps_host_work = self.on_gpu = self._device is not None
        self.supports_lookahead = device == "torch"
        self._keyed = keyed
        self._step_s = step_ms / 1000
        self._token_s = token_us / 1e6
        self._syncs = syncs
        self._cap = BackendCapacity(slots, max_batch_tokens, max_model_len, kv_tokens)
        self._tok = WordTokenizer(vocab_size, word_bytes)
        self._held: dict[str, int] = {}  # sequence -> KV tokens reserved
        self._held_total = 0  # their sum (at most kv_tokens)
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
            grow = num_tokens - held[sequence_id]
            if num_tokens > self._cap.max_model_len or self._held_total + grow > self._cap.kv_tokens:
                return False  # (the scheduler preempts someone)
            held[sequence_id] = num_tokens
            self._held_total += grow
        return True

    def forward_batch(self, flat_ids: Sequence[int], positions: Sequence[int], sequence_ids: Sequence[str], *,
                      logits_for: Sequence[str] | None = None, all_logits_for: Sequence[str] = ()) -> Any:
        self.num_forwards += 1
        counts = collections.Counter(sequence_ids)  # (C-speed: a prompt is hundreds of rows)
        for sid, n in counts.items():  # positions continue each sequence's KV, as a real backend checks
            if sid not in self._computed:
                raise BackendError(f"sequence {sid!r} was not admitted", [sid])
            self._computed[sid] += n
        self._device_wait(len(flat_ids))
        wanted = len(counts) if logits_for is None else len(logits_for)
        rows = wanted + sum(counts[s] for s in all_logits_for)
        if self._keyed:
            return self._keyed_rows(flat_ids, positions, sequence_ids, logits_for, all_logits_for)
        return self._rows(rows)

    def _rows(self, n: int) -> Any:
        """The table's first ``n`` rows (cycled past its end)."""
        if n > len(self._table):
            return self._table[np.arange(n) % len(self._table)]
        return self._table[:n]

    def _keyed_rows(self, flat_ids: Sequence[int], positions: Sequence[int], sequence_ids: Sequence[str],
                    logits_for: Sequence[str] | None, all_logits_for: Sequence[str]) -> Any:
        last: dict[str, int] = {}  # sequence -> its last row in the batch
        for r, sid in enumerate(sequence_ids):
            last[sid] = r
        order = [last[s] for s in (last if logits_for is None else logits_for)]
        order += [r for s in all_logits_for for r in range(len(sequence_ids)) if sequence_ids[r] == s]
        keys = [self._key(flat_ids[r], positions[r]) for r in order]
        if isinstance(self._table, np.ndarray):
            return self._table[np.asarray(keys, dtype=np.int64)]
        return self._table.index_select(0, _index(keys))

    def _key(self, token: Any, position: Any) -> Any:
        """The table row of a sequence whose last token is ``token`` at ``position`` (keyed mode)."""
        return (token * 31 + position * 7) % len(self._table)

    def forward_ahead(self, token_ids: Any, positions: Sequence[int], sequence_ids: Sequence[str], *,
                      flat_ids: Sequence[int] = (), flat_positions: Sequence[int] = (),
                      flat_sequence_ids: Sequence[str] = (), logits_for: Sequence[str] = ()) -> Any:
        """See :meth:`Backend.forward_ahead`: checked like a step, advancing nothing until confirmed."""
        self.num_forwards += 1
        computed, held = self._computed, self._held
        counts = collections.Counter(flat_sequence_ids)
        firsts = dict(zip(reversed(flat_sequence_ids), reversed(flat_positions)))  # each one's first position
        for sid, pos, n in [(s, p, 1) for s, p in zip(sequence_ids, positions)] + [(s, firsts[s], n) for s, n in counts.items()]:
            if computed.get(sid) != pos:
                raise BackendError(f"sequence {sid!r}: a step ahead at position {pos}, but it holds {computed.get(sid)} tokens", [sid])
            if held[sid] < pos + n:
                raise BackendError(f"sequence {sid!r}: no room reserved for positions {pos}..{pos + n - 1}", [sid])
        self._device_wait(len(sequence_ids) + len(flat_ids))
        parts = []
        if len(sequence_ids):
            parts.append(self._table.index_select(0, self._key(token_ids, _index(positions))) if self._keyed
                         else self._rows(len(sequence_ids)))
        if logits_for:
            parts.append(self._keyed_rows(flat_ids, flat_positions, flat_sequence_ids, logits_for, ()) if self._keyed
                         else self._rows(len(logits_for)))
        if not parts:
            return self._table[:0]
        return parts[0] if len(parts) == 1 else _cat(parts)

    def confirm_ahead(self, sequence_ids: Sequence[str], token_ids: Sequence[Sequence[int]]) -> None:
        for sid, tokens in zip(sequence_ids, token_ids):
            self._computed[sid] += len(tokens)

    def sample(self, logits: Any, rows: Sequence[SamplingRow]) -> Any:
        launched = launch_sample(logits, rows)
        if self._device is None:
            return launched
        return _DeviceSample(launched, self._device, self._device.launched)

    def _device_wait(self, num_tokens: int) -> None:
        """The simulated device step: sleeping releases the GIL and takes it back, as a CUDA sync does;
        on an asynchronous device (device_ms) the step is launched there instead."""
        if self._device is not None:
            self._device.launch(self._device_s + self._token_s * num_tokens)
            return
        wait = self._step_s + self._token_s * num_tokens
        if wait > 0:
            for _ in range(self._syncs):
                time.sleep(wait / self._syncs)

    def release(self, sequence_id: str, *, keep_cache: bool = True) -> None:
        self._held_total -= self._held.pop(sequence_id, 0)
        self._computed.pop(sequence_id, None)

    def num_free_slots(self) -> int:
        return self._cap.max_num_seqs - len(self._held)

    def close(self) -> None:
        if self._device is not None:
            self._device.close()


def _cat(parts: list[Any]) -> Any:
    import torch

    return torch.cat(parts)


def _index(values: Sequence[int]) -> Any:
    import torch

    return torch.as_tensor(values, dtype=torch.int64)

"""The continuous-batching scheduler: schedule() -> (backend runs) -> update_from_output().

Each step, running sequences are served first (so decodes never stall behind
a long prompt), then waiting ones are admitted while the token budget, the
sequence cap and the backend's slots allow. A prompt longer than the budget is
prefilled in chunks across steps. When the backend has no KV room, the
lowest-ranked running sequence is preempted (recompute, or swap where the
backend can save state) and resumes later from the waiting queue.
"""
from __future__ import annotations

import heapq
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cllm.backends.base import Backend
from cllm.config import SchedulerConfig
from cllm.request import Request, RequestStatus
from cllm.scheduler.output import ScheduledChunk, SchedulerOutput
from cllm.scheduler.queue import WaitingQueue

if TYPE_CHECKING:
    from cllm.sampling.sampler import SampledToken
    from cllm.speculative import Speculator


# A prompt whose logprobs are asked for is evaluated at most this many tokens a step: every one of its
# tokens then needs a row of logits ([tokens, vocab] float32: 4 GB for 8,192 tokens at a 128 k
# vocabulary, then copied to the host for the log-softmax), not only the last.
SCORED_CHUNK_TOKENS = 512
MIN_PREFILL_PER_STEP = 16  # prompt tokens a step carries beside decodes however slow a token is
COST_SAMPLE_TOKENS = 32  # smallest step whose time counts towards the cost per token
COST_SMOOTHING = 0.2  # weight of the newest step in that moving average


@dataclass(slots=True, frozen=True)
class _RefusedAdmission:
    """The last admission the backend refused, and the state it was refused in."""

    request: Request  # the queue head that could not be placed
    epoch: int  # the scheduler's release count at the time
    budget: int  # token budget it was offered (a smaller first chunk may fit)


class Scheduler:
    """Owns request state transitions; only the engine thread calls it."""

    def __init__(self, backend: Backend, config: SchedulerConfig) -> None:
        cap = backend.capacity
        self.backend = backend
        self.max_num_seqs = min(config.max_num_seqs or cap.max_num_seqs, cap.max_num_seqs)
        self.token_budget = min(config.max_num_batched_tokens or cap.max_batch_tokens, cap.max_batch_tokens)
        # Prompt tokens per step while sequences decode (None: the whole budget; see config.yaml).
        self.prefill_chunk = min(config.max_prefill_chunk or self.token_budget, self.token_budget)
        # Seconds per batched token (an average over steps of at least COST_SAMPLE_TOKENS), measured by
        # the engine: with max_decode_stall_ms it turns a step-time bound into a token bound.
        stall = config.max_decode_stall_ms
        self.stall_s = stall / 1000 if isinstance(stall, (int, float)) else None
        # auto: the bound is stall_factor x the measured time of a pure decode step of as many sequences
        # (on a CPU; on a GPU auto is no bound: Backend.on_gpu)
        self.stall_factor = config.decode_stall_factor if stall == "auto" and not backend.on_gpu else None
        self.prefill_per_prompt = config.min_prefill_per_prompt  # (auto: the fewest prompt tokens a step carries, per prompt)
        self.seconds_per_token: float | None = None
        self.decode_seconds: dict[int, float] = {}  # batch-size class (bit length) -> pure decode step, moving average
        self._decode_probed: set[int] = set()  # classes a step was kept prompt-free for, to time a pure decode
        self._probing = False  # this step is such a step: no prompt tokens, no drafts
        self.swap = config.preemption_mode == "swap" and backend.supports_state_swap
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self._running_sorted = True  # running is in policy order (admissions append out of it)
        # (deadline, arrival, request) of requests with a deadline, earliest first; finished ones are
        # dropped when they come up (a step looks only at the earliest, not at every request)
        self._deadlines: list[tuple[float, int, Request]] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._arrivals = 0
        # Bumped whenever a sequence gives its slot and KV back (finish, preemption): only then can an
        # admission the backend refused succeed, so a refused head is not retried before that.
        self._release_epoch = 0
        self._refused: _RefusedAdmission | None = None
        self.speculator: Speculator | None = None  # set by the engine when speculative decoding is on

    # ------------------------------------------------------------ lifecycle
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self._arrivals += 1
        req.arrival_seq = self._arrivals
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.push(req)
        if req.deadline is not None:
            if len(self._deadlines) > 2 * len(self.requests) + 64:  # mostly ended requests: keep the live ones
                self._deadlines = [e for e in self._deadlines if self.requests.get(e[2].request_id) is e[2]]
                heapq.heapify(self._deadlines)
            heapq.heappush(self._deadlines, (req.deadline, req.arrival_seq, req))

    def finish(self, req: Request, status: RequestStatus, error: str | None = None) -> None:
        """Move a request to a final status and give its slot and KV back. Idempotent."""
        if req.status.is_finished:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        req.error = error
        req.swapped_state = None
        req.metrics.finished_time = time.monotonic()
        self.backend.release(req.request_id, keep_cache=status != RequestStatus.FAILED)
        self._release_epoch += 1
        self.requests.pop(req.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_preempted(self) -> int:
        return sum(1 for r in self.waiting if r.status == RequestStatus.PREEMPTED)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._probing = False
        self._expire(out, time.monotonic())
        budget = self._schedule_running(out, self.token_budget)
        if not out.preempted:
            self._admit_waiting(out, budget)
        if self.speculator is not None and not out.preempted and not self._probing:
            self._add_drafts(out)
        return out

    def _add_drafts(self, out: SchedulerOutput) -> None:
        """Append the speculator's draft tokens to decode chunks, within the token budget and the KV
        room the backend has now (a draft never preempts anyone)."""
        proposals = self.speculator.propose(out, self.token_budget - out.num_tokens, self.backend.capacity.max_model_len)
        for chunk, draft in proposals:
            req = chunk.request
            if draft and self.backend.reserve(req.request_id, req.num_tokens + len(draft)):
                chunk.draft = draft
                chunk.num_tokens += len(draft)
                out.num_tokens += len(draft)

    def _expire(self, out: SchedulerOutput, now: float) -> None:
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            req = heapq.heappop(deadlines)[2]
            if self.requests.get(req.request_id) is req:  # still live here (not finished, not handed off)
                self.finish(req, RequestStatus.FINISHED_TIMEOUT, "request timed out")
                out.finished.append(req)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Decodes first, in policy order, then the chunks of prompts still being prefilled (a
        long prompt, a recompute after preemption). A prefill of any rank thus never takes the
        budget running decodes need: a decode waits at most one step, whose prefill part the token
        budget bounds (issue 8: a high-priority or recomputing prefill used to skip every decode
        ranked after it for as many steps as its prompt had chunks)."""
        if not self._running_sorted:  # (a sort's key calls were 6 % of a 256-sequence step)
            self.running.sort(key=self.waiting.sort_key)
            self._running_sorted = True
        decoding: list[Request] = []
        prefilling: list[Request] = []
        for r in self.running:
            left = len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens
            (decoding if left == 1 else prefilling).append(r)
        # While anyone decodes, prompts get at most one bounded chunk per step (the decodes' wait);
        # with nobody decoding (a burst of arrivals) they may fill the whole budget, as llama-server
        # fills its n_batch, since no one waits on them.
        prefill_left = (self._prefill_while_decoding(len(decoding), len(prefilling) + len(self.waiting)) if decoding
                        else self.token_budget)
        if not self._schedule_decodes(out, decoding):
            return 0
        for req in prefilling:
            budget = self.token_budget - out.num_tokens
            if budget <= 0:
                return 0
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted as a victim earlier this step
            if prefill_left <= 0:
                break
            n = req.fit_chunk(min(_scored_cap(req, min(req.num_tokens - req.num_computed_tokens, budget)), prefill_left))
            if not self._reserve_or_preempt(req, req.num_computed_tokens + n, out):
                break  # req itself was preempted: the rest, ranked lower, already was
            out.add(self._chunk(req, n))
            prefill_left -= n
        return min(self.token_budget - out.num_tokens, prefill_left)

    def _schedule_decodes(self, out: SchedulerOutput, decoding: list[Request]) -> bool:
        """One token each for the decoding sequences, in rank order; False once the token budget is spent.
        (The hot path at hundreds of sequences: no per-request chunk-size arithmetic. A decode samples
        unless it only scores its prompt: max_tokens 0.)"""
        budget = self.token_budget
        for req in decoding:
            if out.num_tokens >= budget:
                return False
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted as a victim earlier this step
            start = req.num_computed_tokens
            if not self._reserve_or_preempt(req, start + 1, out):
                break  # req itself was preempted: the rest, ranked lower, already was
            out.add(ScheduledChunk(req, start, 1, req.max_tokens > 0))
        return out.num_tokens < budget

    def _prefill_while_decoding(self, num_decoding: int, num_prompts: int) -> int:
        """Prompt tokens a step may carry beside ``num_decoding`` decodes while ``num_prompts`` prompts wait
        or are being prefilled: max_prefill_chunk, and what keeps the step within the stall bound at the
        measured cost per token (under auto at least min_prefill_per_prompt per prompt: config.yaml). With
        the auto bound and no decode step of this size measured yet, the step carries none, once per size
        class, so that one is: a burst of long prompts otherwise never leaves a step without prompt
        tokens, and the first sequences to finish their prefill would decode beside 2,048-token chunks
        (3 s a step on 2 cores) until every prompt is in."""
        chunk = self.prefill_chunk
        stall = self.stall_bound(num_decoding)
        if stall is None and self.stall_factor is not None and self.seconds_per_token is not None:
            cls = num_decoding.bit_length()
            if cls not in self._decode_probed:
                self._decode_probed.add(cls)
                self._probing = True
                return 0
        if stall is not None and self.seconds_per_token is not None:
            least = MIN_PREFILL_PER_STEP if self.stall_factor is None else self.prefill_per_prompt * max(1, num_prompts)
            chunk = min(chunk, max(least, int(stall / self.seconds_per_token) - num_decoding))
        return chunk

    def stall_bound(self, num_decoding: int) -> float | None:
        """Seconds a step carrying prompt tokens beside ``num_decoding`` decodes should take at most:
        max_decode_stall_ms, or (auto) stall_factor x a measured decode step of that many sequences
        (None until one is measured: the first steps are not cut)."""
        if self.stall_factor is None:
            return self.stall_s
        decode = self.decode_seconds.get(num_decoding.bit_length())
        return None if decode is None else self.stall_factor * decode

    def observe_step(self, num_tokens: int, seconds: float, num_sequences: int = 0) -> None:
        """The engine reports each forward pass (``num_sequences``: the step's chunks): keeps the cost
        per token current (a moving average of steps big enough that the per-step overhead does not
        dominate), and the time of a pure decode step (one token per sequence) per batch-size class."""
        if seconds <= 0:
            return
        if num_tokens == num_sequences > 0:
            cls = num_sequences.bit_length()
            prev = self.decode_seconds.get(cls)
            self.decode_seconds[cls] = seconds if prev is None else prev + COST_SMOOTHING * (seconds - prev)
        if num_tokens < COST_SAMPLE_TOKENS:
            return
        cost = seconds / num_tokens
        prev = self.seconds_per_token
        self.seconds_per_token = cost if prev is None else prev + COST_SMOOTHING * (cost - prev)

    def _reserve_or_preempt(self, req: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        while not self.backend.reserve(req.request_id, num_tokens):
            victim = self.running[-1]
            # A lower-ranked decode may already be in this step's batch: take its chunk out.
            out.drop(victim)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        if self.swap and req.num_computed_tokens > 0:
            req.swapped_state = self.backend.save_state(req.request_id)
            # Swapped-out KV is valid: keep it as prefix cache (other live sequences may share it).
            self.backend.release(req.request_id, keep_cache=True)
        else:
            self.backend.release(req.request_id, keep_cache=True)
            req.num_computed_tokens = 0
        self._release_epoch += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.push(req)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.peek()
            if req is None or self._refused_before(req, budget):
                return
            n = self._try_admit(req, budget)
            if n is None:
                return
            self.waiting.pop()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._running_sorted = False
            out.add(self._chunk(req, n))
            budget -= n

    def _refused_before(self, req: Request, budget: int) -> bool:
        """Whether admitting ``req`` was refused and nothing that could change the answer happened since.

        An admission costs a prefix scan, a truncation and maybe a seq_cp (issue 9 defect 6); a head
        the backend cannot place is retried only after a release, or with a smaller first chunk. It
        keeps its place at the head, so it is never starved by later arrivals.
        """
        refused = self._refused
        return (refused is not None and refused.request is req and refused.epoch == self._release_epoch
                and budget >= refused.budget)

    def _try_admit(self, req: Request, budget: int) -> int | None:
        """Give the request a backend place and KV for its first chunk; the chunk's size, or None."""
        if req.needs_prompt_logits:  # every prompt token must be evaluated to be scored: no cache hit
            admission = self.backend.admit(req.request_id, req.all_token_ids, reuse_prefix=False, **_images(req))
        else:
            admission = self.backend.admit(req.request_id, req.all_token_ids, **_images(req))
        if admission is None:
            self._refused = _RefusedAdmission(req, self._release_epoch, budget)
            return None
        if req.swapped_state is None:
            req.num_computed_tokens = admission.num_cached_tokens
            if req.num_cached_tokens is None:
                req.num_cached_tokens = admission.num_cached_tokens
        n = req.fit_chunk(_scored_cap(req, min(req.num_tokens - req.num_computed_tokens, budget)))
        ok = self.backend.reserve(req.request_id, req.num_computed_tokens + n)
        restore_failed = False
        if ok and req.swapped_state is not None:
            ok = self._restore(req)
            if not ok:
                # Retrying the same restore could fail forever and spin the loop with the queue head
                # stuck: fall back to recompute, which the next admission does like any other.
                req.swapped_state = None
                req.num_computed_tokens = 0
                restore_failed = True
        if not ok:
            # A rollback: what the admission matched is valid cache (a failed restore leaves nothing
            # claimed), so keep it; dropping it would withdraw blocks that live sequences share.
            self.backend.release(req.request_id, keep_cache=True)
            if not restore_failed:  # after a failed restore the recompute retry must not wait for a release
                self._refused = _RefusedAdmission(req, self._release_epoch, budget)
            return None
        req.swapped_state = None
        return n

    def _restore(self, req: Request) -> bool:
        """Load saved KV: bytes from a swap-out here, or segments handed over by another engine."""
        tokens = req.all_token_ids[: req.num_computed_tokens]
        if isinstance(req.swapped_state, list):
            return self.backend.import_kv(req.request_id, req.swapped_state, tokens)
        return self.backend.restore_state(req.request_id, req.swapped_state, tokens)

    def detach(self, req: Request) -> list[bytes]:
        """Take a live request out without finishing it (a hand-off to another engine).

        Returns its KV as segments (``Backend.export_kv``), holding the request's first
        ``num_computed_tokens`` tokens; [] (and num_computed_tokens 0) when it holds none or
        the backend cannot export, so the receiver recomputes. Its place and KV are given
        back here (kept as prefix cache).
        """
        if req.status.is_finished or self.requests.get(req.request_id) is not req:
            raise ValueError(f"request {req.request_id!r} is not live in this scheduler ({req.status.name})")
        segments: list[bytes] = []
        if req.status == RequestStatus.RUNNING:
            if req.num_computed_tokens > 0 and self.backend.supports_state_swap:
                segments = self.backend.export_kv(req.request_id)
            self.running.remove(req)
        else:
            self.waiting.remove(req)
            state = req.swapped_state
            if state is not None:
                segments = list(state) if isinstance(state, list) else [state]
        if not segments:
            req.num_computed_tokens = 0
        req.swapped_state = None
        self.backend.release(req.request_id, keep_cache=True)
        self.requests.pop(req.request_id, None)
        return segments

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = time.monotonic()
        end = req.num_computed_tokens + n
        # max_tokens=0 (score the prompt only) never samples: the request ends when its prompt is evaluated.
        return ScheduledChunk(req, req.num_computed_tokens, n, sample=end == req.num_tokens and req.max_tokens > 0)

    # --------------------------------------------------------------- update
    def update_from_output(self, out: SchedulerOutput, sampled: Mapping[str, SampledToken]) -> list[Request]:
        """Record computed tokens and sampled ones (by request id); returns requests that got a token."""
        got_token = []
        for chunk in out.chunks:
            req = chunk.request
            if req.status != RequestStatus.RUNNING or chunk.draft:
                continue  # finished during the step (abort); a draft chunk is verified by the engine
            req.num_computed_tokens += chunk.num_tokens
            if req.max_tokens == 0 and req.num_computed_tokens >= req.num_tokens:
                self.finish(req, RequestStatus.FINISHED_LENGTH)
                continue
            got = sampled.get(req.request_id)
            if chunk.sample and got is not None:
                token = got.token_id
                req.output_token_ids.append(token)
                got_token.append(req)
                status = self.stop_status(req, token)
                if status is not None:
                    # As vLLM: a stop token id is the stop_reason; EOS (and length) leave it null.
                    req.stop_reason = token if token in req.params.stop_token_ids else None
                    self.finish(req, status)
        return got_token

    @staticmethod
    def stop_status(req: Request, token: int) -> RequestStatus | None:
        """The status ``token`` (just appended) ends the request with: a stop token (after min_tokens), or
        max_tokens reached; None while it runs on."""
        p = req.params
        produced = len(req.output_token_ids)
        if produced >= p.min_tokens:
            if token in p.stop_token_ids or (not p.ignore_eos and token in req.eos_token_ids):
                return RequestStatus.FINISHED_STOPPED
        if produced >= req.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def fail(self, request_ids: list[str], error: str) -> list[Request]:
        """Fail the named requests (a backend error); the rest carry on."""
        failed = [self.requests[r] for r in request_ids if r in self.requests]
        for req in failed:
            self.finish(req, RequestStatus.FAILED, error)
        return failed

    def preempt_for_kv(self, request_ids: list[str]) -> Request | None:
        """llama_decode found no KV room: preempt the lowest-ranked of the batch's sequences."""
        ids = set(request_ids)
        candidates = [r for r in self.running if r.request_id in ids]
        if not candidates:
            return None
        victim = max(candidates, key=self.waiting.sort_key)
        self._preempt(victim)
        return victim


def _images(req: Request) -> dict:
    """admit()'s images keyword, given only when the prompt has images (backends without images need not take it)."""
    return {"images": req.mm_spans} if req.mm_spans else {}


def _scored_cap(req: Request, n: int) -> int:
    """``n`` tokens, at most SCORED_CHUNK_TOKENS while the request's prompt is being scored."""
    return min(n, SCORED_CHUNK_TOKENS) if req.needs_prompt_logits else n

"""LLMEngine: the synchronous step loop. schedule() -> forward + sample -> update_from_output().

Single-threaded by design: LLM calls it directly, AsyncLLM from its one loop
thread. Nothing else mutates request state.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cllm.backends.base import Backend, BackendError, KVCacheFullError
from cllm.backends.registry import create_backend
from cllm.chat_template import IMAGE_MARK, ChatTemplate, encode_segments, encode_with_images
from cllm.config import CllmConfig
from cllm.engine import migration
from cllm.engine.prompt_logprobs import score_prompt_chunk
from cllm.engine.request_group import RequestGroup
from cllm.engine.stats import EngineStats, RateMeter, RunningRequestInfo
from cllm.errors import ContextLengthError, QueueFullError
from cllm.gc_freeze import raise_gc_threshold
from cllm.handoff.snapshot import RequestSnapshot
from cllm.multimodal.prompt import MultimodalPrompt
from cllm.multimodal.span import ImageSpan
from cllm.outputs import EmbeddingOutput, RequestOutput
from cllm.request import FIRST_FINAL, Request, RequestStatus
from cllm.sampling.params import SamplingParams
from cllm.sampling.dispatch import sample_logits, stack_rows, take_rows
from cllm.sampling.sampler import SampledToken, SamplingRow
from cllm.scheduler.output import ScheduledChunk, SchedulerOutput
from cllm.scheduler.scheduler import Scheduler
from cllm.speculative.speculator import create_speculator
from cllm.structured import StructuredOutputs
from cllm.structured.limits import ConstraintLimits, check_constraint
from cllm.structured.manager import PendingMask

Prompt = str | Sequence[int] | MultimodalPrompt


@dataclass(slots=True)
class _Ahead:
    """A step launched before the host read the ids it runs on (the one-step lookahead): one decode row
    per sequence on the ids the device sampled, plus chunks of host tokens (prompts) that joined it."""

    chunks: list[ScheduledChunk]  # what it computed, the decodes first (each as the next step would schedule it)
    rows: list[int | None]  # each chunk's row in the logits (None: a prompt chunk short of its last token)
    logits: object  # on the device


@dataclass(slots=True)
class _Verification:
    """One sequence's draft tokens being verified this step (LLMEngine._verify)."""

    chunk: ScheduledChunk  # its chunk: the last token and the draft tokens
    logits: np.ndarray  # its rows of logits, one per token of the chunk
    group: RequestGroup  # the request group it belongs to
    index: int  # its choice index in the group
    emitted: int = 0  # tokens emitted so far
    accepted: int = 0  # draft tokens kept so far
    status: RequestStatus | None = None  # what ended the request, if anything did
    reason: str | int | None = None  # its stop_reason


class LLMEngine:
    """Owns one backend and one scheduler; ``step()`` runs one batch."""

    def __init__(self, config: CllmConfig, backend: Backend | None = None) -> None:
        self.config = config
        raise_gc_threshold()
        self.backend = backend if backend is not None else create_backend(config)
        self.tokenizer = self.backend.tokenizer
        self.scheduler = Scheduler(self.backend, config.scheduler)
        self.speculator = create_speculator(config, self.backend)  # None: speculative decoding off
        self.scheduler.speculator = self.speculator
        self.structured = StructuredOutputs(self.tokenizer, config.structured.grammar_cache_size, constraint_limits(config))
        self.max_model_len = self.backend.capacity.max_model_len
        self.supports_images = self.backend.supports_images
        self._groups: dict[str, RequestGroup] = {}
        self._group_of: dict[str, tuple[RequestGroup, int]] = {}
        # Each sequence's sampling state (params, its own generator, its token lists), built once: the
        # lists are the request's own, so the row is up to date at every step.
        self._rows: dict[str, SamplingRow] = {}
        self._seed_source = np.random.default_rng(config.model.seed)
        self._chat: ChatTemplate | None = None
        self._finished_counts: collections.Counter[str] = collections.Counter()
        self._rate = RateMeter()
        self._prompt_tokens = 0
        self._generated_tokens = 0
        self._ids = itertools.count()
        self.num_handed_off = 0  # requests exported to another engine
        # Text work deferred to the next step's forward pass (see step()): (group, choice, token) in order,
        # and the outputs it made, for step() to return.
        self._defer_text = self.backend.overlaps_host_work
        self._deferred: list[tuple[RequestGroup, int, SampledToken]] = []
        self._ready: list[RequestOutput] = []
        # hold_outputs (the engine core sets it while the API process is behind): a running group's
        # outputs after its first token's are not made per step; the group waits here and take_held_outputs()
        # makes one output of all its news (what merging the per-step outputs would give).
        self.hold_outputs = False
        self._held: dict[str, RequestGroup] = {}
        self.lookahead = _lookahead_on(config, self.backend, self.speculator is not None)
        self._ahead: _Ahead | None = None  # the step launched ahead, if any (lookahead)
        self._put_off: set[str] = set()  # requests whose chunk the last step put off to the next launch
        self.ahead_rows = self.ahead_used = 0  # rows launched ahead, and of those, rows a step used (stats)

    # ------------------------------------------------------------- requests
    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, *, continue_final_message: bool = False) -> str:
        """The prompt text; ``continue_final_message``: it ends inside the last message (assistant
        prefill), which generation continues, instead of opening a new turn."""
        if self._chat is None:
            self._chat = ChatTemplate(self.tokenizer)
        text = self._chat.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                 continue_final_message=continue_final_message)
        return _valid_text(text, "messages")

    def tokenize_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                      tools: list[dict] | None = None, *,
                      continue_final_message: bool = False) -> list[int] | MultimodalPrompt:
        """Token ids of a conversation, as transformers' ``apply_chat_template(tokenize=True)`` gives
        them; special-token text in the caller's strings stays plain text (no role injection:
        ChatTemplate.render_segments). With image parts, a MultimodalPrompt: the text's ids and where
        each image goes (the backend expands them when the request is added)."""
        if self._chat is None:
            self._chat = ChatTemplate(self.tokenizer)
        segments, images = self._chat.render_with_images(
            messages, add_generation_prompt=add_generation_prompt, tools=tools,
            continue_final_message=continue_final_message)
        for piece, _ in segments:
            _valid_text(piece.replace(IMAGE_MARK, ""), "messages")
        if images:
            ids, at = encode_with_images(self.tokenizer, segments)
            return MultimodalPrompt(ids, tuple(zip(at, images)))
        # The template writes the BOS where the model wants one (transformers and vLLM add none either).
        ids = encode_segments(self.tokenizer, segments, add_bos=False)
        if not ids:
            raise ValueError("messages render to an empty prompt")
        return ids

    def tokenize_prompt(self, prompt: Prompt) -> list[int]:
        """Validated prompt token ids (ValueError on an empty or out-of-vocabulary prompt). For a prompt with
        images, its text's ids: the images' own ids are known once the backend expands them (add_request)."""
        if isinstance(prompt, MultimodalPrompt):
            self.check_images(prompt)
            prompt = prompt.ids
        if isinstance(prompt, str):
            _valid_text(prompt, "prompt")
            bos = self.tokenizer.bos_token_id
            starts_with_bos = bos is not None and prompt.startswith(self.tokenizer.special_token(bos))
            ids = self.tokenizer.encode(prompt, add_special=not starts_with_bos)
        elif isinstance(prompt, Sequence) and _are_token_ids(prompt):
            ids = list(prompt)
            vocab = self.tokenizer.vocab_size
            bad = [] if not ids or (min(ids) >= 0 and max(ids) < vocab) else [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (size {self.tokenizer.vocab_size})")
        else:
            raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        return ids

    def resolve_max_tokens(self, num_prompt: int, params: SamplingParams) -> int:
        room = self.max_model_len - num_prompt
        if params.max_tokens == 0 and room >= 0:  # scoring a prompt needs no room for output
            return 0
        if room < 1:
            raise ContextLengthError(
                f"prompt has {num_prompt} tokens but the context holds {self.max_model_len}: "
                "shorten the prompt or raise n_ctx")
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ContextLengthError(
                f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds the context length "
                f"{self.max_model_len}: lower max_tokens to at most {room} or raise n_ctx")
        return params.max_tokens

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                    priority: int = 0, timeout_s: float | None = None, prompt_ids: list[int] | None = None) -> str:
        """Queue a request (n choices); returns its id. Raises ValueError / QueueFullError."""
        params = params or SamplingParams()
        if prompt_ids is not None:  # tokenised by the caller: the limits on the request itself still hold
            self.check_params(params)
        ids = prompt_ids if prompt_ids is not None else self.validate_request(prompt, params)
        spans: tuple[ImageSpan, ...] = ()
        if isinstance(prompt, MultimodalPrompt):
            ids, spans = self._expand_images(prompt, params)
            params = self._fit_max_tokens(prompt, params, self.max_model_len - len(ids))
        max_tokens = self.resolve_max_tokens(len(ids), params)
        if not self.has_room_for(params.n):
            raise QueueFullError(f"waiting queue is full ({self.config.scheduler.max_waiting} requests); retry later")
        group_id = request_id or f"req-{uuid.uuid4().hex[:16]}"
        self._check_id_free(group_id, params.n)
        timeout = timeout_s if timeout_s is not None else self.config.scheduler.request_timeout_s
        self.structured.compile(params)  # a cache hit when validate_request (or AsyncLLM) compiled it
        children = [self._child(group_id, i, ids, params, max_tokens, priority, timeout, spans) for i in range(params.n)]
        group = RequestGroup(group_id, prompt if isinstance(prompt, str) else None, children, self.tokenizer)
        self._groups[group_id] = group
        for i, child in enumerate(children):
            self._group_of[child.request_id] = (group, i)
            self.structured.add(child)
            self.scheduler.add(child)
        return group_id

    def check_images(self, prompt: MultimodalPrompt) -> None:
        """ValueError when the model takes no images, or the prompt holds more than ``max_images_per_request``."""
        if not self.supports_images:
            raise ValueError(f"model {self.config.model.model!r} does not accept images: serve a vision model "
                             "with its projector (llama.cpp: --mmproj FILE; torch: a transformers VLM directory)")
        limit = self.config.images.max_images_per_request
        if len(prompt.images) > limit:
            raise ValueError(f"the request holds {len(prompt.images)} images; at most {limit} "
                             "(max_images_per_request) are taken")

    def _expand_images(self, prompt: MultimodalPrompt, params: SamplingParams) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """The prompt's ids with its images' ids in place, and their spans (the backend's expand_images)."""
        self.check_images(prompt)
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs cannot be given for a prompt with images (image positions have no token to score)")
        ids, spans = self.backend.expand_images(prompt)
        if spans and spans[-1].end >= len(ids):
            raise ValueError("a prompt must not end with an image: put text (the chat template's generation prompt) after it")
        return ids, spans

    def expanded_ids(self, prompt: list[int] | MultimodalPrompt) -> list[int]:
        """A rendered prompt's ids as the context holds them, its images' ids included (/tokenize, count_tokens)."""
        if isinstance(prompt, MultimodalPrompt):
            self.check_images(prompt)
            return self.backend.expand_images(prompt)[0]
        return list(prompt)

    @staticmethod
    def _fit_max_tokens(prompt: Prompt, params: SamplingParams, room: int) -> SamplingParams:
        """A default max_tokens chosen before the images were expanded, lowered to the context's room."""
        if isinstance(prompt, MultimodalPrompt) and prompt.fit_max_tokens and params.max_tokens is not None \
                and params.max_tokens > room >= 1:
            return dataclasses.replace(params, max_tokens=room)
        return params

    def validate_request(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """Everything add_request checks about the request itself; returns the prompt's token ids.

        Raises ValueError without touching engine state, so a caller can check a whole batch first.
        """
        self.check_params(params)
        ids = self.tokenize_prompt(prompt)
        self.resolve_max_tokens(len(ids), params)
        self.structured.compile(params)
        return ids

    def check_params(self, params: SamplingParams) -> None:
        """The limits on a request's settings that need neither its prompt nor engine state: token ids in
        the vocabulary, stop strings no longer than ``max_stop_string_chars``, the constraint's size and
        depth. ValueError naming the field. Every path runs it: ``add_request`` (prompt ids given or
        not), and the API process before it registers anything (AsyncLLM, ProcessEngine, which borrows
        this method: it needs only ``config`` and ``tokenizer``)."""
        params.check_vocab(self.tokenizer.vocab_size)
        limit = self.config.scheduler.max_stop_string_chars
        too_long = [s for s in params.stop if len(s) > limit]
        if too_long:
            raise ValueError(f"invalid stop=<a string of {len(too_long[0])} characters>: longer than this server's "
                             f"max_stop_string_chars ({limit}); send shorter stop strings")
        try:
            key = params.constraint_key
        except RecursionError:  # json.dumps of a schema nested past the interpreter's stack
            raise ValueError("invalid json_schema=<nested too deeply to read>: flatten the JSON schema") from None
        if key is not None:
            check_constraint(key[0], key[1], constraint_limits(self.config))

    # ----------------------------------------------------------- embeddings
    def embedding_token_ids(self, inputs: Sequence[Prompt]) -> list[list[int]]:
        """Validated token ids of embedding inputs (text or ids); ValueError naming the bad input."""
        if not self.backend.supports_embeddings:
            raise ValueError(f"the {self.backend.name!r} backend cannot compute embeddings")
        if isinstance(inputs, str) or not inputs:
            raise ValueError("embedding inputs must be a non-empty list of texts or token-id lists")
        limit = self.backend.embedding_max_tokens
        token_ids = []
        for i, item in enumerate(inputs):
            try:
                ids = self.tokenize_prompt(item)
            except (ValueError, TypeError) as err:
                raise ValueError(f"input {i}: {err}") from None
            if len(ids) > limit:
                raise ValueError(f"input {i} has {len(ids)} tokens but an embedding input holds at most {limit}: "
                                 "shorten it or raise embedding_batch_tokens")
            token_ids.append(ids)
        return token_ids

    def embed_token_ids(self, token_ids: Sequence[list[int]]) -> list[EmbeddingOutput]:
        """Embeddings of already validated inputs, several per forward pass; L2-normalised."""
        vectors = self.backend.embed(token_ids).astype(np.float32)
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors /= np.maximum(norms, np.finfo(np.float32).tiny)
        return [EmbeddingOutput(v.tolist(), list(ids)) for v, ids in zip(vectors, token_ids)]

    def has_room_for(self, num_sequences: int) -> bool:
        """Whether the waiting queue can take ``num_sequences`` more sequences now."""
        return self.scheduler.num_waiting + num_sequences <= self.config.scheduler.max_waiting

    def _check_id_free(self, group_id: str, n: int) -> None:
        # A child id ("x#0") may equal another request's id: refuse any overlap, both ways.
        child_ids = [group_id] if n == 1 else [f"{group_id}#{i}" for i in range(n)]
        taken = [i for i in {group_id, *child_ids} if i in self._groups or i in self._group_of]
        if taken:
            raise ValueError(f"request_id {group_id!r} is already in use (clashes with {taken[0]!r})")

    def _child(self, group_id: str, index: int, ids: list[int], params: SamplingParams, max_tokens: int,
               priority: int, timeout: float | None, spans: tuple[ImageSpan, ...] = ()) -> Request:
        now = time.monotonic()
        rid = group_id if params.n == 1 else f"{group_id}#{index}"
        seed = params.seed + index if params.seed is not None else int(self._seed_source.integers(1 << 62))
        # OpenAI seeds are int64 and may be negative; numpy takes non-negative ints: wrap to 64 bits.
        # Prompt logprobs are the same for every choice: only the first one scores the prompt.
        req = Request(rid, list(ids), params, max_tokens, priority=priority, arrival_time=now,
                      deadline=now + timeout if timeout else None, eos_token_ids=self.tokenizer.eos_token_ids,
                      scores_prompt=index == 0 and params.prompt_logprobs is not None, mm_spans=spans)
        self.keep_sampling_row(req, seed % (1 << 64))  # (the generator is made from it on first use)
        return req

    def keep_sampling_row(self, req: Request, rng: np.random.Generator | int) -> None:
        """Sample ``req`` with ``rng`` (a generator, or the seed of one made on first use) from now on."""
        self._rows[req.request_id] = SamplingRow(req.params, rng, req.prompt_token_ids, req.output_token_ids, req.stop_ids)

    def rng_of(self, request_id: str) -> np.random.Generator:
        return self._rows[request_id].rng

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request (all its choices); returns its final output, or None if unknown."""
        group = self._groups.get(request_id)
        if group is None:
            return None
        self._flush_text()
        if request_id not in self._groups:  # it finished with the text just flushed
            final = [o for o in self._ready if o.request_id == request_id and o.finished]
            return final[-1] if final else None
        for child in group.children:
            self.scheduler.abort(child.request_id)
        return self._collect([group])[0]

    def export_request(self, request_id: str) -> tuple[RequestSnapshot, list[bytes]]:
        """Take a live n=1 request out for a hand-off: its snapshot and KV segments (cllm.engine.migration)."""
        self._flush_text()
        if request_id in self._held:  # its caller has not had every token: the importer would skip some
            raise RuntimeError(f"request {request_id!r} has held outputs: take_held_outputs() before exporting it")
        return migration.export_request(self, request_id)

    def import_request(self, snapshot: RequestSnapshot, segments: list[bytes]) -> str:
        """Continue a request handed over by another engine (cllm.engine.migration); returns its id."""
        return migration.import_request(self, snapshot, segments)

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    def idle_work(self, *, queued_ok: bool = False) -> bool:
        """One unit of the backend's housekeeping (see Backend.idle_work), only while no request is
        live, or (``queued_ok``) while none is running: requests queued for an idle engine's first
        step hold no slot yet, so the work touches none of theirs."""
        idle = not self.scheduler.running if queued_ok else not self._groups
        if idle:
            self._ahead = None  # (rows of ended requests only)
        return idle and self.backend.idle_work()

    def request_ids(self) -> list[str]:
        return list(self._groups)

    # ----------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one batch; returns an output for every request that changed (but those ``hold_outputs``
        keeps for ``take_held_outputs``).

        On a backend whose forward runs asynchronously (the torch backend on CUDA: ``overlaps_host_work``),
        the text work of a step's tokens (detokenising, logprob entries, the outputs) is done during the
        *next* step's forward pass, which it then no longer delays; those outputs come one step later.
        Only tokens of requests without stop strings are deferred, so nothing deferred can change which
        requests run next (EOS, stop token ids, max_tokens and grammars are all settled at once)."""
        out = self.scheduler.schedule()
        touched: dict[str, RequestGroup] = {}
        for req in out.finished + out.preempted:
            self._touch(touched, req)
        if not out.is_empty:
            self._run(out, touched)
        else:
            self._ahead = None  # every row it ran belonged to requests that ended
        if not self._defer_text or out.is_empty:
            self._flush_text()
        ready, self._ready = self._ready, []
        return ready + self._collect(list(touched.values()))

    def _flush_text(self) -> None:
        """Detokenise the deferred tokens and make their groups' outputs (kept for step() to return)."""
        if not self._deferred:
            return
        deferred, self._deferred = self._deferred, []
        groups: dict[str, RequestGroup] = {}
        for group, index, sampled in deferred:
            group.on_token(index, sampled)
            groups[group.group_id] = group
        self._ready += self._collect(list(groups.values()))

    def _run(self, out: SchedulerOutput, touched: dict[str, RequestGroup]) -> None:
        ahead, self._ahead = self._ahead, None
        covered, later = self._reconcile(out, ahead)
        if not out.chunks:  # all put off (what was launched ahead ended): they go in the next launch now
            self._launch_ahead([], None, later)
            if self._defer_text:
                self._flush_text()
            return
        sampled_reqs = [c.request for c in out.chunks if c.sample and not c.draft]
        # The grammar masks of this step's constrained rows are filled while the forward pass runs.
        mask = self.structured.start_fill(sampled_reqs)
        started = time.perf_counter()
        try:
            logits, verify = self._forward_step(out.chunks, ahead, covered)
            self.scheduler.observe_step(out.num_tokens, time.perf_counter() - started, len(out.chunks))
        except KVCacheFullError as err:
            if self.scheduler.preempt_for_kv(err.sequence_ids) is None:
                self._fail(err.sequence_ids, str(err), touched)
            return
        except BackendError as err:
            if len(out.chunks) == 1:
                self._fail(err.sequence_ids, str(err), touched)
                return
            # Which sequence broke the batch is unknown: rerun each alone so only the culprit fails.
            logits, sampled_reqs, verify = self._forward_one_by_one(out.chunks, touched)
        finally:
            if self._defer_text:
                self._flush_text()  # the previous step's text work, while this forward runs on the device
        for c in out.chunks:  # decodes (start past the prompt) add nothing: skipped cheaply
            n_prompt = len(c.request.prompt_token_ids)
            if c.start < n_prompt and not c.request.status.is_finished:
                self._prompt_tokens += min(c.start + c.num_tokens, n_prompt) - c.start
        self._sample_and_update(out, sampled_reqs, logits, touched, mask, verify, later)
        if self.speculator is not None and all(c.num_tokens == 1 + len(c.draft) for c in out.chunks):
            # A decode step's cost by its size (every token has a logits row: the rows drafts add), its
            # sampling and verification included (on CUDA the host waits for the device there).
            self.speculator.observe_step(out.chunks, time.perf_counter() - started)

    def _reconcile(self, out: SchedulerOutput, ahead: _Ahead | None) -> tuple[dict[int, int | None], list[ScheduledChunk]]:
        """Match the step the scheduler just made against the one launched ahead. Returns the chunks it
        computed already (chunk index -> its logits row, None for a prompt chunk that samples nothing),
        and the chunks put off to the next launch: while a step launched ahead runs, this step's other
        chunks (admissions' prompts, decodes the lookahead skipped) join the next one, launched after
        this step's sampling, instead of costing a forward of their own; they are taken out of ``out``
        (the scheduler schedules them again, unchanged, next step). A chunk put off once is never put off
        again (so a prompt whose chunk size changes between steps still progresses), and neither are
        chunks that need every logits row (drafts, scored prompts). Rows launched for requests that ended,
        were preempted or aborted since are dropped: never confirmed, never in the KV length or the
        prefix cache."""
        if ahead is None:
            return {}, []
        launched = {c.request.request_id: (c, row) for c, row in zip(ahead.chunks, ahead.rows)}
        covered: dict[int, int | None] = {}
        later: list[ScheduledChunk] = []
        kept: list[ScheduledChunk] = []
        put_off_before, self._put_off = self._put_off, set()
        for c in out.chunks:
            hit = launched.get(c.request.request_id)
            if hit is not None and hit[0].request is c.request and hit[0].start == c.start \
                    and hit[0].num_tokens == c.num_tokens and not c.draft:
                covered[len(kept)] = hit[1]
                kept.append(c)
            elif (self.lookahead and not c.draft and not c.request.needs_prompt_logits
                  and c.request.request_id not in put_off_before):
                later.append(c)
                self._put_off.add(c.request.request_id)
            else:
                kept.append(c)
        if later:
            out.chunks = kept
            out.num_tokens = sum(c.num_tokens for c in kept)
        return covered, later

    def _forward_step(self, chunks: list[ScheduledChunk], ahead: _Ahead | None, covered: dict[int, int | None]
                      ) -> tuple[np.ndarray, list[tuple[ScheduledChunk, np.ndarray]]]:
        """:meth:`_forward`, taking what the lookahead already computed (``covered``, see
        :meth:`_reconcile`): those chunks are confirmed to the backend (the host knows their tokens now)
        and give their logits rows; the rest run in a forward now. If that forward fails, nothing is
        confirmed: the caller's fallbacks rerun the whole step as usual."""
        if ahead is None or not covered:
            return self._forward(chunks)
        rest = [c for ci, c in enumerate(chunks) if ci not in covered]
        logits, verify = self._forward(rest) if rest else (None, [])
        confirmed = [chunks[ci] for ci in covered]
        self.backend.confirm_ahead([c.request.request_id for c in confirmed],
                                   [c.request.tokens_between(c.start, c.start + c.num_tokens) for c in confirmed])
        self.ahead_used += len(covered)
        index: list[int] = []
        offset, taken = sum(r is not None for r in ahead.rows), 0
        for ci, c in enumerate(chunks):
            if not c.sample or c.draft:
                continue
            if ci in covered:
                index.append(covered[ci])  # type: ignore[arg-type]
            else:
                index.append(offset + taken)
                taken += 1
        if not taken and index == list(range(offset)):
            return ahead.logits, verify  # the step is exactly what was launched (the steady state)
        parts = [ahead.logits] if not taken else [ahead.logits, logits]
        return take_rows(parts, index), verify

    def _launch_ahead(self, reqs: list[Request], sample: object | None, later: list[ScheduledChunk]) -> None:
        """The lookahead: launch the next step before the host reads this one's sampled ids: a decode row
        for each request just sampled, on the ids the device chose (``sample.token_ids``), plus the chunks
        put off from this step (host tokens). Decode rows are skipped for requests that this token ends
        for sure (max_tokens), that score their prompt, or whose KV room cannot grow; a failure to
        launch only means the next step runs as today's do."""
        rows: list[int] = []
        decodes: list[ScheduledChunk] = []
        running, reserve = RequestStatus.RUNNING, self.backend.reserve  # (looked up once: 256 rows a step)
        for i, req in enumerate(reqs):
            if (req.status is not running or (req.scores_prompt and req.needs_prompt_logits)
                    or len(req.output_token_ids) + 1 >= req.max_tokens):
                continue
            at = len(req.prompt_token_ids) + len(req.output_token_ids)  # num_tokens: the sampled token goes here
            if not reserve(req.request_id, at + 1):
                continue
            rows.append(i)
            decodes.append(ScheduledChunk(req, at, 1, True))
        if not decodes and not later:
            return
        ids = None
        if decodes:
            ids = sample.token_ids if len(rows) == len(reqs) else take_rows([sample.token_ids], rows)  # type: ignore[union-attr]
        flat: list[int] = []
        pos: list[int] = []
        seqs: list[str] = []
        for c in later:
            flat += c.request.tokens_between(c.start, c.start + c.num_tokens)
            pos += range(c.start, c.start + c.num_tokens)
            seqs += [c.request.request_id] * c.num_tokens
        sampling = [c.request.request_id for c in later if c.sample]
        try:
            logits = self.backend.forward_ahead(ids, [c.start for c in decodes], [c.request.request_id for c in decodes],
                                                flat_ids=flat, flat_positions=pos, flat_sequence_ids=seqs,
                                                logits_for=sampling)
        except (BackendError, KVCacheFullError):
            return  # the next step runs these itself (and reports what fails there)
        row_of_later: list[int | None] = []
        n = len(decodes)
        for c in later:
            row_of_later.append(n if c.sample else None)
            n += c.sample
        self._ahead = _Ahead(decodes + later, list(range(len(decodes))) + row_of_later, logits)
        self.ahead_rows += len(decodes) + len(later)

    def _forward(self, chunks: list[ScheduledChunk]) -> tuple[np.ndarray, list[tuple[ScheduledChunk, np.ndarray]]]:
        """The step's forward pass: the logits rows of the chunks that sample (no draft), and for each
        chunk with draft tokens its rows at every token, to verify them."""
        flat: list[int] = []
        pos: list[int] = []
        seqs: list[str] = []
        for c in chunks:
            req, start, n = c.request, c.start, c.num_tokens
            if n == 1 and not c.draft:  # a decode (most chunks of a busy step): no list building
                flat.append(req.token_at(start))
                pos.append(start)
                seqs.append(req.request_id)
                continue
            if c.draft:
                flat += req.tokens_between(start, start + n - len(c.draft)) + c.draft
            else:
                flat += req.tokens_between(start, start + n)
            pos += range(start, start + n)
            seqs += [req.request_id] * n
        wanted = [c.request.request_id for c in chunks if c.sample and not c.draft]
        scored = [c for c in chunks if c.request.needs_prompt_logits]
        drafted = [c for c in chunks if c.draft]
        if not scored and not drafted:
            return self.backend.forward_batch(flat, pos, seqs, logits_for=wanted), []
        logits = self.backend.forward_batch(flat, pos, seqs, logits_for=wanted,
                                            all_logits_for=[c.request.request_id for c in scored + drafted])
        row = len(wanted)
        for c in scored:
            score_prompt_chunk(c.request, c.start, logits[row:row + c.num_tokens], self.tokenizer)
            row += c.num_tokens
        verify = []
        for c in drafted:
            verify.append((c, logits[row:row + c.num_tokens]))
            row += c.num_tokens
        return logits[:len(wanted)], verify

    def _forward_one_by_one(self, chunks: list[ScheduledChunk], touched: dict[str, RequestGroup]
                            ) -> tuple[np.ndarray, list[Request], list[tuple[ScheduledChunk, np.ndarray]]]:
        rows: list[np.ndarray] = []
        reqs: list[Request] = []
        verify: list[tuple[ScheduledChunk, np.ndarray]] = []
        for c in chunks:
            try:
                logits, drafted = self._forward([c])
            except BackendError as err:
                self._fail([c.request.request_id], str(err), touched)
                continue
            verify += drafted
            if c.sample and not c.draft:
                rows.append(logits[0])
                reqs.append(c.request)
        return stack_rows(rows, self.tokenizer.vocab_size), reqs, verify

    def _sample_and_update(self, out: SchedulerOutput, reqs: list[Request], logits: np.ndarray,
                           touched: dict[str, RequestGroup], mask: PendingMask | None = None,
                           verify: Sequence[tuple[ScheduledChunk, np.ndarray]] = (),
                           later: list[ScheduledChunk] | None = None) -> None:
        structured = self.structured if self.structured.active else None
        if mask is not None:
            self.structured.apply(logits, [r.request_id for r in reqs], mask)
        kept = self._rows
        rows = [kept[r.request_id] for r in reqs]
        sampled = []
        launched = self.backend.sample(logits, rows) if reqs else None
        if self.lookahead:
            self._launch_ahead(reqs if launched is not None else [], launched, later or [])
        if launched is not None:
            sampled = launched.results()  # (the host waits for the device here)
        by_id = {r.request_id: s for r, s in zip(reqs, sampled)}
        now = time.monotonic()
        for req in self.scheduler.update_from_output(out, by_id):
            group, index = self._group_of[req.request_id]
            metrics = req.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            if self._defer_text and not req.params.stop:  # (stop strings decide the next step: never deferred)
                self._deferred.append((group, index, by_id[req.request_id]))
                if structured is not None and structured.accept(req) and req.status is RequestStatus.RUNNING:
                    self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)  # the grammar is complete
                continue
            stop = group.on_token(index, by_id[req.request_id])
            if stop is not None and req.status is RequestStatus.FINISHED_LENGTH:
                req.status = RequestStatus.FINISHED_STOPPED  # the last allowed token completed a stop string
            if stop is not None and req.status in (RequestStatus.RUNNING, RequestStatus.FINISHED_STOPPED):
                req.stop_reason = stop
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
            if structured is not None and structured.accept(req) and req.status is RequestStatus.RUNNING:
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)  # the grammar is complete
            touched[group.group_id] = group
        if verify:
            self._verify(verify, touched, now)
        for request_id, error in self.structured.take_broken().items():
            self._fail([request_id], error, touched)
        for chunk in out.chunks:  # requests that ended without a token (max_tokens=0 scores the prompt only)
            if chunk.request.status >= FIRST_FINAL:
                self._touch(touched, chunk.request)
        self._generated_tokens += len(by_id)
        self._rate.add(len(by_id), now)

    def _verify(self, verify: Sequence[tuple[ScheduledChunk, np.ndarray]], touched: dict[str, RequestGroup],
                now: float) -> None:
        """Keep the draft tokens the model itself would have produced, and the model's next token.

        Position by position, exactly as one step at a time would (penalties over the output so far, the
        grammar's mask in its current state, one draw from the request's generator per token): sample
        the model's token, emit it, and go on while it equals the draft token evaluated there. So greedy
        output is the model's argmax path, and a sampled request's tokens follow the model's
        distribution with the same seeded draws as without speculation (a draft is a single proposed
        token, for which accepting when the draw equals it is the exact rejection-sampling rule). Each
        position is one batched sampling call over every sequence still verifying. The KV of rejected
        draft tokens is then dropped; whatever ends a request (a stop token or string, max_tokens, a
        complete grammar) ends it at that token, as it would have."""
        pending = [_Verification(chunk, rows, *self._group_of[chunk.request.request_id])
                   for chunk, rows in verify if chunk.request.status is RequestStatus.RUNNING]  # (else aborted mid-step)
        depth = 0
        while pending:
            reqs = [v.chunk.request for v in pending]
            logits = stack_rows([v.logits[depth] for v in pending], self.tokenizer.vocab_size)
            constrained = [r for r in reqs if self.structured.is_constrained(r.request_id)]
            if constrained:
                self.structured.apply(logits, [r.request_id for r in reqs], self.structured.start_fill(constrained))
            rows = [self._rows[r.request_id] for r in reqs]
            going_on = []
            for v, sampled in zip(pending, sample_logits(logits, rows)):
                if self._take_token(v, depth, sampled):
                    going_on.append(v)
                else:
                    self._end_verification(v, touched, now)
            pending = going_on
            depth += 1

    def _take_token(self, v: _Verification, depth: int, sampled: SampledToken) -> bool:
        """Emit one verified position's token; True while the sequence goes on to its next draft token."""
        req, draft = v.chunk.request, v.chunk.draft
        token = sampled.token_id
        if depth == 0:
            req.num_computed_tokens = v.chunk.start + 1  # its last token's KV
        req.output_token_ids.append(token)
        v.emitted += 1
        status = self.scheduler.stop_status(req, token)
        reason = token if status is RequestStatus.FINISHED_STOPPED and token in req.params.stop_token_ids else None
        if self._defer_text and not req.params.stop:
            self._deferred.append((v.group, v.index, sampled))
        else:
            stop = v.group.on_token(v.index, sampled)
            if stop is not None:
                status, reason = RequestStatus.FINISHED_STOPPED, stop
        if self.structured.accept(req) and status is None:
            status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
        v.status, v.reason = status, reason
        hit = depth < len(draft) and token == draft[depth]
        v.accepted += hit
        if status is not None or not hit:
            return False
        req.num_computed_tokens += 1  # the draft token's KV was computed, and it is kept
        return True

    def _end_verification(self, v: _Verification, touched: dict[str, RequestGroup], now: float) -> None:
        req, chunk = v.chunk.request, v.chunk
        if req.num_computed_tokens < chunk.start + chunk.num_tokens:
            req.num_computed_tokens = min(req.num_computed_tokens, self.backend.truncate(req.request_id, req.num_computed_tokens))
        self.speculator.verified(req, len(chunk.draft), v.accepted, v.emitted)
        if v.status is not None:
            req.stop_reason = v.reason
            self.scheduler.finish(req, v.status)
        metrics = req.metrics
        if metrics.first_token_time is None:  # a cached prompt's last token can carry drafts: its first step verifies
            metrics.first_token_time = now
        metrics.last_token_time = now
        touched[v.group.group_id] = v.group
        self._generated_tokens += v.emitted
        self._rate.add(v.emitted, now)

    def _fail(self, sequence_ids: list[str], error: str, touched: dict[str, RequestGroup]) -> None:
        for req in self.scheduler.fail(sequence_ids, error):
            self._touch(touched, req)

    def _touch(self, touched: dict[str, RequestGroup], req: Request) -> None:
        entry = self._group_of.get(req.request_id)
        if entry is not None:
            touched[entry[0].group_id] = entry[0]

    def _collect(self, groups: list[RequestGroup]) -> list[RequestOutput]:
        outputs = []
        pending = {g.group_id for g, _, _ in self._deferred} if self._deferred else ()
        hold, held = self.hold_outputs, self._held
        for group in groups:
            if group.group_id not in self._groups:
                continue  # its final output went out already (with deferred text, earlier this step)
            if group.group_id in pending:
                continue  # text still to come: its output is made when it is flushed
            if hold and group.token_out and not group.finished:
                held[group.group_id] = group  # (a first output and an end are never held)
                continue
            if held:
                held.pop(group.group_id, None)  # this output carries the news held so far
            output = group.make_output()
            outputs.append(output)
            if output.finished:
                self._forget(group)
        return outputs

    def has_held_outputs(self) -> bool:
        return bool(self._held)

    def take_held_outputs(self) -> list[RequestOutput]:
        """One output per group held since the last call (see ``hold_outputs``): its news since its last
        output, in the order the groups were first held."""
        return [group.make_output() for group in self.take_held_groups()]

    def take_held_groups(self) -> list[RequestGroup]:
        """The groups held since the last call, for a caller that makes their outputs itself
        (``make_output``, or ``plain_delta``: the engine core's flush)."""
        held, self._held = self._held, {}
        return [group for gid, group in held.items() if gid in self._groups]

    def _forget(self, group: RequestGroup) -> None:
        self._groups.pop(group.group_id, None)
        self._held.pop(group.group_id, None)
        for child in group.children:
            self._group_of.pop(child.request_id, None)
            self._rows.pop(child.request_id, None)
            self.structured.remove(child.request_id)
            if self.speculator is not None:
                self.speculator.remove(child.request_id)
            self._finished_counts[child.status.finish_reason or "unknown"] += 1

    # ---------------------------------------------------------------- stats
    def stats(self) -> EngineStats:
        sched, backend = self.scheduler, self.backend
        queried, hits = backend.prefix_cache_stats()
        total_slots = backend.capacity.max_num_seqs
        return EngineStats(
            num_running=len(sched.running), num_waiting=sched.num_waiting, num_preempted=sched.num_preempted,
            slots_in_use=total_slots - backend.num_free_slots(), slots_total=total_slots,
            kv_usage=backend.kv_usage(), prefix_cache_queried_tokens=queried, prefix_cache_hit_tokens=hits,
            prompt_tokens_total=self._prompt_tokens, generation_tokens_total=self._generated_tokens,
            num_preemptions=sched.num_preemptions, tokens_per_s=self._rate.rate(),
            requests_finished=dict(self._finished_counts), **self._speculation_stats(), **_thread_stats(backend),
        )

    def _speculation_stats(self) -> dict[str, int]:
        s = self.speculator.stats if self.speculator is not None else None
        if s is None:
            return {}
        return dict(spec_proposed_tokens=s.proposed_tokens, spec_accepted_tokens=s.accepted_tokens,
                    spec_verify_steps=s.verify_steps, spec_emitted_tokens=s.emitted_tokens)

    def running_requests(self) -> list[RunningRequestInfo]:
        now = time.monotonic()
        slot_of = getattr(self.backend, "slot_of", lambda _id: None)
        return [
            RunningRequestInfo(r.request_id, slot_of(r.request_id), r.status.name, r.num_prompt_tokens,
                               r.num_output_tokens, r.num_computed_tokens, now - r.arrival_time)
            for r in list(self.scheduler.requests.values())
        ]

    def close(self) -> None:
        self._ahead = None
        self.structured.close()
        if self.speculator is not None:
            self.speculator.close()
        self.backend.close()


def _lookahead_on(config: CllmConfig, backend: Backend, speculative: bool) -> bool:
    """Whether this engine launches each decode step ahead (scheduler.lookahead; docs/gpu.md)."""
    setting = config.scheduler.lookahead
    if setting == "off" or speculative:
        return False  # (a speculative step's drafts come from the host's tokens: today's order)
    if setting == "on" and not backend.supports_lookahead:
        raise ValueError(f"scheduler.lookahead: on needs a backend that samples on its device (the torch backend "
                         f"with torch.sampler torch, or auto on CUDA); the {backend.name} backend cannot: use auto or off")
    return backend.supports_lookahead and (setting == "on" or backend.overlaps_host_work)


def constraint_limits(config: CllmConfig) -> ConstraintLimits:
    """What one output constraint may cost, from ``config.structured``."""
    sc = config.structured
    return ConstraintLimits(max_text_bytes=sc.max_constraint_bytes, max_depth=sc.max_constraint_depth,
                            compile_timeout_s=sc.grammar_compile_timeout_s, cache_bytes=sc.grammar_cache_mib << 20)


_INT_ONLY = frozenset({int})


def _are_token_ids(prompt: Sequence[object]) -> bool:
    """Every item an int and none a bool. The set of the items' types is made at C speed (a 150-id prompt
    9.3 -> 2.8 µs on the event loop, 4,000 ids 232 -> 69 µs); only a prompt holding some other type (an int
    subclass, say) takes the per-item check."""
    return set(map(type, prompt)) <= _INT_ONLY or all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)


def _valid_text(text: str, name: str) -> str:
    """``text`` itself; ValueError if it holds a lone surrogate (JSON can carry "\\ud800"), which no
    tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{name} contains an unpaired surrogate {text[err.start]!r} at index {err.start}: "
                         "send valid Unicode text") from None
    return text


def _thread_stats(backend: Backend) -> dict[str, int]:
    """llama.cpp's compute threads now and how often its governor lowered them (for /v1/engine, /metrics)."""
    threads = getattr(backend, "compute_threads", None)
    if threads is None:
        return {}
    governor = getattr(backend, "thread_governor", None)
    return {"compute_threads": threads, "compute_threads_lowered": governor.lowered if governor is not None else 0}

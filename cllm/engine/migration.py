"""Export a live request from one engine and import it into another (KV hand-off).

Both run on the engine's own thread, between two steps. The exporting engine
forgets the request (its slot and KV are given back, kept as prefix cache);
the importing engine queues it with the handed-over KV attached, so the
scheduler's admission restores the KV (``Backend.import_kv``) and the next
step evaluates exactly the tokens the first engine had not yet evaluated.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cllm.engine.request_group import RequestGroup
from cllm.errors import ContextLengthError, QueueFullError
from cllm.handoff.snapshot import RequestSnapshot
from cllm.request import Request

if TYPE_CHECKING:
    from cllm.engine.llm_engine import LLMEngine


def model_identity(engine: LLMEngine) -> str:
    """Name and size of the weights file: two engines must run the same one to share KV."""
    backend = engine.backend
    raw = getattr(backend, "weights_path", None) or getattr(backend, "model_path", None) or engine.config.model.model
    if raw is None:
        return "embedded"  # model=None: the package's embedded model, the same file for every engine
    path = Path(raw)
    return f"{path.name}:{path.stat().st_size if path.is_file() else 0}"


def export_request(engine: LLMEngine, request_id: str) -> tuple[RequestSnapshot, list[bytes]]:
    """Take a live single-choice request out of ``engine``: its snapshot and its KV segments."""
    group = engine._groups.get(request_id)
    if group is None:
        raise KeyError(f"request {request_id!r} is not live in this engine")
    if len(group.children) != 1:
        raise ValueError(f"request {request_id!r} has n={len(group.children)} choices; a hand-off moves n=1 requests")
    req = group.children[0]
    if req.mm_spans:
        # A snapshot carries ids, not images: the receiver could not recompute an image's span.
        raise ValueError(f"request {request_id!r} holds images; requests with images are not handed off")
    segments = engine.scheduler.detach(req)
    now = time.monotonic()
    snap = RequestSnapshot(
        request_id=request_id, prompt=group.prompt, prompt_token_ids=list(req.prompt_token_ids),
        output_token_ids=list(req.output_token_ids), params=req.params, max_tokens=req.max_tokens,
        num_computed_tokens=req.num_computed_tokens, rng_state=engine.rng_of(request_id).bit_generator.state,
        backend=engine.backend.name, model=model_identity(engine), priority=req.priority,
        output_logprobs=list(req.output_logprobs), num_cached_tokens=req.num_cached_tokens,
        scores_prompt=req.scores_prompt, prompt_logprobs=list(req.prompt_logprobs),
        age_s=now - req.arrival_time,
        first_token_age_s=None if req.metrics.first_token_time is None else now - req.metrics.first_token_time,
        timeout_left_s=None if req.deadline is None else max(0.0, req.deadline - now),
    )
    engine._groups.pop(request_id, None)
    engine._group_of.pop(request_id, None)
    engine._rows.pop(request_id, None)
    engine.structured.remove(request_id)
    if engine.speculator is not None:
        engine.speculator.remove(request_id)
    engine.num_handed_off += 1
    return snap, segments


def import_request(engine: LLMEngine, snap: RequestSnapshot, segments: list[bytes]) -> str:
    """Queue a handed-over request in ``engine``; it continues where the exporting engine stopped."""
    _check_compatible(engine, snap)
    if not engine.has_room_for(1):
        raise QueueFullError(f"waiting queue is full ({engine.config.scheduler.max_waiting} requests); retry later")
    engine._check_id_free(snap.request_id, 1)
    # ValueError before any state changes, as add_request. Under AsyncLLM this runs on the engine
    # thread, so AsyncLLM.resume compiles the grammar off it first and this is a cache hit.
    engine.structured.compile(snap.params)
    req = _request_from(engine, snap, segments)
    rng = np.random.default_rng()
    rng.bit_generator.state = snap.rng_state
    group = RequestGroup(snap.request_id, snap.prompt, [req], engine.tokenizer)
    group.replay()
    engine._groups[snap.request_id] = group
    engine._group_of[snap.request_id] = (group, 0)
    engine.keep_sampling_row(req, rng)
    engine.structured.add(req)  # a constrained request's matcher replays its output tokens at the next step
    engine.scheduler.add(req)
    return snap.request_id


def _check_compatible(engine: LLMEngine, snap: RequestSnapshot) -> None:
    if snap.backend != engine.backend.name or snap.model != model_identity(engine):
        raise ValueError(f"request {snap.request_id!r} was exported by backend {snap.backend!r} with model "
                         f"{snap.model!r}; this engine runs {engine.backend.name!r} with {model_identity(engine)!r}")
    if len(snap.prompt_token_ids) + snap.max_tokens > engine.max_model_len:
        raise ContextLengthError(f"request {snap.request_id!r} needs {len(snap.prompt_token_ids) + snap.max_tokens} "
                                 f"tokens of context; this engine holds {engine.max_model_len}")


def _request_from(engine: LLMEngine, snap: RequestSnapshot, segments: list[bytes]) -> Request:
    now = time.monotonic()
    deadline = None if snap.timeout_left_s is None else now + snap.timeout_left_s
    req = Request(snap.request_id, list(snap.prompt_token_ids), snap.params, snap.max_tokens, priority=snap.priority,
                  arrival_time=now - snap.age_s, deadline=deadline, eos_token_ids=engine.tokenizer.eos_token_ids)
    req.output_token_ids = list(snap.output_token_ids)
    req.output_logprobs = list(snap.output_logprobs)
    req.scores_prompt, req.prompt_logprobs = snap.scores_prompt, list(snap.prompt_logprobs)
    req.num_cached_tokens = snap.num_cached_tokens
    if snap.first_token_age_s is not None:
        req.metrics.first_token_time = now - snap.first_token_age_s
    if segments and snap.num_computed_tokens > 0 and engine.backend.supports_state_swap:
        req.swapped_state = list(segments)
        req.num_computed_tokens = snap.num_computed_tokens
    return req

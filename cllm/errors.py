"""Errors crossing the API boundary. User mistakes are ValueErrors; the rest say who is at fault."""
from __future__ import annotations


class ContextLengthError(ValueError):
    """The prompt (plus max_tokens) does not fit the model's context. HTTP 400 context_length_exceeded."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound (scheduler.max_waiting). HTTP 429 with Retry-After."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped on a fatal error; no request can run until restart. HTTP 503."""


class RequestHandedOffError(RuntimeError):
    """The request moved to another engine mid-generation (KV hand-off); its stream here ends, the
    other engine's stream continues it."""

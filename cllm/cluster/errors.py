"""Errors of a Ray Serve deployment, as the ingress raises them (both are 503 engine_unavailable)."""
from __future__ import annotations

from cllm.errors import EngineDeadError


class ReplicaDiedError(EngineDeadError):
    """The replica running a request died; only its requests fail, and Serve replaces it."""


class ReplicaDrainingError(EngineDeadError):
    """The replica a request (or a hand-off) reached is draining: the ingress sends it to another,
    and never to ``replica`` (its Serve replica id) again."""

    def __init__(self, message: str, replica: str | None = None) -> None:
        super().__init__(message)
        self.replica = replica  # survives pickling (BaseException keeps __dict__) through Ray's RayTaskError

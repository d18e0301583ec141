"""Errors of a Ray Serve deployment, as the ingress raises them (both are 503 engine_unavailable)."""
from __future__ import annotations

from cllm.errors import EngineDeadError


class ReplicaDiedError(EngineDeadError):
    """The replica running a request died; only its requests fail, and Serve replaces it."""


class ReplicaDrainingError(EngineDeadError):
    """The replica a request (or a hand-off) reached is draining: the ingress sends it to another."""

"""What the ingress sends an engine replica (plain, picklable data)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cllm.sampling.params import SamplingParams


@dataclass(slots=True)
class GenerateCall:
    """One engine request, as routed to a replica."""

    request_id: str  # engine request id (the same on every replica it visits)
    prompt: str | Sequence[int]  # text or token ids, as the server got it
    params: SamplingParams  # sampling settings
    priority: int  # scheduling priority
    timeout_s: float | None  # per-request deadline
    prefix_keys: tuple[bytes, ...]  # prompt prefix keys (cllm.cluster.prefix): the router routes by them
    prefill_only: bool = False  # PD: hand the request to a decode replica after its first token
    avoid_replicas: frozenset[str] = field(default_factory=frozenset)  # Serve replica ids that refused it (draining)

"""Per-request and per-client caps on queued sequences, and the `priority` gate (issue 9 defect 14).

The engine's waiting queue is one bound for everybody (``max_waiting``): without these caps one
request (128 prompts x n 8) or one client sending many requests fills it and everyone else gets 429.
A client is its remote address: the API key, when set, is one key shared by all clients, so it
cannot tell them apart (behind a proxy, every client is the proxy; set the cap accordingly).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request

from cllm.config import CllmConfig
from cllm.server.errors import APIError, bad_request
from cllm.structured.limits import CompilePayer, charge_compiles_to

# How long a client over its share should wait before retrying (its own requests must finish first).
CLIENT_RETRY_AFTER_S = 2


@dataclass(slots=True, frozen=True)
class AdmissionPolicy:
    """The caps a request is checked against before it reaches the engine (from ServerConfig)."""

    max_sequences_per_request: int  # prompts x n of one request
    max_sequences_per_client: int | None  # queued + running sequences of one client; None = no cap
    allow_client_priority: bool  # whether a request may set a non-zero `priority`
    # Cold grammar compiles (json_schema, grammar, regex, forced tool calls) one client may have
    # running at once; None = no cap. A compile counts until it really ends, past its time budget too.
    max_compiles_per_client: int | None = 2


class ClientLease:
    """Sequences one request holds against its client's share; ``release()`` is idempotent."""

    def __init__(self, quota: ClientQuota | None, client: str, count: int) -> None:
        self._quota = quota
        self._client = client
        self._count = count

    def release(self) -> None:
        if self._quota is not None:
            self._quota.give_back(self._client, self._count)
            self._quota = None


class ClientQuota:
    """Counts the sequences each client has in flight; refuses those over its share with 429."""

    def __init__(self, policy: AdmissionPolicy) -> None:
        self.policy = policy
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        self._compiling: dict[str, int] = {}  # client -> cold grammar compiles running

    def in_flight(self, client: str) -> int:
        with self._lock:
            return self._in_flight.get(client, 0)

    def admit(self, request: Request, *, num_sequences: int, priority: int | None,
              param: str = "n") -> tuple[ClientLease, int]:
        """Check one request; returns its lease on the client's share and the priority to queue it with.
        ``param`` is the field a too-large request is told to shrink."""
        policy = self.policy
        if num_sequences > policy.max_sequences_per_request:
            raise bad_request(
                f"request asks for {num_sequences} sequences (prompts x n): this server allows at most "
                f"{policy.max_sequences_per_request} per request; split it", param=param, code="too_many_sequences")
        if priority and not policy.allow_client_priority:
            raise bad_request(f"invalid priority={priority}: this server does not let clients set a priority "
                              "(allow_client_priority is off)", param="priority")
        client = request.client.host if request.client is not None else "unknown"
        lease = self._acquire(client, num_sequences)
        # The request's cold grammar compiles (run later, in a thread that inherits this context)
        # are charged to this client too (issue 27 item 12).
        charge_compiles_to(self.payer(client))
        return lease, priority or 0

    def payer(self, client: str) -> CompilePayer:
        """The CompilePayer charging ``client``'s share of cold compiles."""
        return _ClientCompiles(self, client)

    def _acquire(self, client: str, count: int) -> ClientLease:
        cap = self.policy.max_sequences_per_client
        if cap is None:
            return ClientLease(None, client, count)
        with self._lock:
            held = self._in_flight.get(client, 0)
            if held + count > cap:
                raise APIError(429, f"too many sequences in flight from this client ({held} + {count} > {cap}); "
                               "wait for earlier requests to finish", code="client_quota_exceeded",
                               headers={"Retry-After": str(CLIENT_RETRY_AFTER_S)})
            self._in_flight[client] = held + count
        return ClientLease(self, client, count)

    def give_back(self, client: str, count: int) -> None:
        with self._lock:
            left = self._in_flight.get(client, 0) - count
            if left > 0:
                self._in_flight[client] = left
            else:
                self._in_flight.pop(client, None)

    def compiling(self, client: str) -> int:
        with self._lock:
            return self._compiling.get(client, 0)

    def begin_compile(self, client: str) -> Callable[[], None]:
        """Charge one cold compile to ``client`` (429 past its cap); returns the idempotent release."""
        cap = self.policy.max_compiles_per_client
        with self._lock:
            held = self._compiling.get(client, 0)
            if cap is not None and held >= cap:
                raise APIError(429, f"too many grammar compiles in flight from this client ({held} of {cap}): new "
                               "json_schema / grammar / regex constraints compile one at a time per client; wait for "
                               "earlier requests, or reuse a schema (compiled ones are cached)",
                               code="client_compile_quota_exceeded", headers={"Retry-After": str(CLIENT_RETRY_AFTER_S)})
            self._compiling[client] = held + 1
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if released:
                    return
                released = True
                left = self._compiling.get(client, 0) - 1
                if left > 0:
                    self._compiling[client] = left
                else:
                    self._compiling.pop(client, None)
        return release


def compile_quota(config: CllmConfig) -> ClientQuota | None:
    """The compile counts of an engine core in its own process (engine_core.py): there the compiles run,
    so there they are counted, per client as the API process names it (``payer_client``), against
    ``server.max_compiles_per_client``; None when there is no cap."""
    cap = config.server.max_compiles_per_client
    if cap is None:
        return None
    return ClientQuota(AdmissionPolicy(max_sequences_per_request=1, max_sequences_per_client=None,
                                       allow_client_priority=False, max_compiles_per_client=cap))


def payer_client(payer: CompilePayer | None) -> str | None:
    """The client a request's compiles are charged to (what the API process tells its engine core)."""
    return payer.client if isinstance(payer, _ClientCompiles) else None


@dataclass(slots=True, frozen=True)
class _ClientCompiles:
    """The CompilePayer of one request: its client's share of compiles."""

    quota: ClientQuota  # whose counts
    client: str  # the remote address charged

    def begin_compile(self) -> Callable[[], None]:
        return self.quota.begin_compile(self.client)

"""The bounded in-memory store of past Responses (``store: true``), for ``previous_response_id``,
``GET`` and ``DELETE /v1/responses/{id}``.

Bounded three ways (ServerConfig): entries, bytes (the stored JSON's size, roughly), and age. The
oldest entry goes first when a bound is reached; an expired entry is as good as deleted. The store
lives on one app (``app.state``), so two apps in one process share nothing.
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from cllm.server.state import get_state


@dataclass(slots=True)
class StoredResponse:
    """One stored response and the conversation it ends."""

    response: dict[str, Any]  # the Response object as returned
    history: list[dict[str, Any]]  # the conversation as chat messages, this response's output included (no instructions)
    input_items: list[dict[str, Any]]  # the input items of this request, for GET …/input_items
    size: int  # approximate bytes held
    stored_at: float  # clock() when stored


class ResponseStore:
    """An LRU of responses, bounded by count, bytes and age. Thread-safe (handlers may run in threads)."""

    def __init__(self, *, max_entries: int, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    @property
    def bytes_held(self) -> int:
        return self._bytes

    def put(self, response: dict[str, Any], history: list[dict[str, Any]], input_items: list[dict[str, Any]]) -> bool:
        """Store a response; False when it alone exceeds the byte bound (it is then not stored)."""
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(history, ensure_ascii=False)) \
            + len(json.dumps(input_items, ensure_ascii=False))
        if size > self._max_bytes or self._max_entries == 0:
            return False
        entry = StoredResponse(response, history, input_items, size, self._clock())
        with self._lock:
            self._drop(response["id"])
            self._entries[response["id"]] = entry
            self._bytes += size
            self._expire()
            while len(self._entries) > self._max_entries or self._bytes > self._max_bytes:
                self._drop(next(iter(self._entries)))
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            self._expire()
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)  # used: kept longest under the count bound
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            self._expire()
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True

    def _expire(self) -> None:
        limit = self._clock() - self._ttl_s
        # Insertion order is not storage order after move_to_end, so scan; the store is small.
        for key in [k for k, e in self._entries.items() if e.stored_at < limit]:
            self._drop(key)


def response_store(request: Request) -> ResponseStore:
    """The app's store, made on first use from the server's settings."""
    app_state = request.app.state
    store = getattr(app_state, "cllm_responses", None)
    if store is None:
        server = get_state(request).config.server
        store = ResponseStore(max_entries=server.responses_store_size, max_bytes=server.responses_store_mib << 20,
                              ttl_s=server.responses_store_ttl_s)
        app_state.cllm_responses = store
    return store

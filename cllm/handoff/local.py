"""An in-process hand-off between two engines: the KV travels as plain bytes, in chunks."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cllm.handoff.transfer import KVReceiver, KVSender, send

if TYPE_CHECKING:
    from cllm.engine.llm_engine import LLMEngine


@dataclass(slots=True, frozen=True)
class HandoffReport:
    """What one hand-off moved and how long it took."""

    request_id: str  # the request, same id on both engines
    kv_tokens: int  # tokens whose KV moved (0: the receiver recomputes)
    kv_bytes: int  # bytes moved
    num_chunks: int  # chunks sent
    seconds: float  # export + transfer + import (the KV lands at the receiver's next admission)


def hand_off(src: LLMEngine, dst: LLMEngine, request_id: str, *, chunk_bytes: int) -> HandoffReport:
    """Move a live request from ``src`` to ``dst`` between steps of both (one thread).

    If ``dst`` refuses it (full queue, other model), it goes back to ``src`` and the error is raised.
    """
    start = time.perf_counter()
    snap, segments = src.export_request(request_id)
    sender = KVSender(request_id, segments, chunk_bytes)
    receiver = KVReceiver(sender.header)
    send(sender, receiver)
    try:
        dst.import_request(snap, receiver.segments())
    except Exception:
        src.import_request(snap, segments)
        raise
    return HandoffReport(request_id, snap.num_computed_tokens if segments else 0, sender.header.total_bytes,
                         sender.header.num_chunks, time.perf_counter() - start)

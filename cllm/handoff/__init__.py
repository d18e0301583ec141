"""KV hand-off: move one running sequence (its KV and the state to continue it) between engines.

``snapshot``: what travels besides the KV; ``transfer``: the chunked, resumable KV transfer;
``local``: an in-process hand-off between two engines (plain bytes).
"""
from __future__ import annotations

from cllm.handoff.snapshot import RequestSnapshot
from cllm.handoff.transfer import KVChunk, KVReceiver, KVSender, TransferHeader, TransferStatus

__all__ = ["RequestSnapshot", "KVChunk", "KVReceiver", "KVSender", "TransferHeader", "TransferStatus"]

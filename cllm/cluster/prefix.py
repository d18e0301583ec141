"""Prefix keys for routing: chained hashes of a prompt's leading token blocks.

Block i's key hashes block i's tokens together with block i-1's key, so equal
keys mean equal prefixes up to that block. The router remembers which replica
last received each key; a new prompt's longest remembered key names the
replica most likely to hold its prefix in KV. Hashing whole blocks only (as the
torch backend's prefix cache does) keeps keys few and stable.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def prefix_keys(token_ids: Sequence[int], block_tokens: int) -> tuple[bytes, ...]:
    """One key per complete block of ``block_tokens`` tokens, in prompt order."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
    keys: list[bytes] = []
    parent = b""
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        block = token_ids[start:start + block_tokens]
        parent = hashlib.blake2b(parent + struct.pack(f"<{len(block)}q", *block), digest_size=16).digest()
        keys.append(parent)
    return tuple(keys)

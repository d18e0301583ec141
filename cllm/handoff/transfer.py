"""A chunked, resumable transfer of a sequence's KV segments.

The sender holds the KV as a list of segments (llama.cpp: one opaque state
blob; torch: one per KV block, gathered from the block table's non-contiguous
blocks) and cuts their concatenation into fixed-size chunks without joining
them first: a chunk may span segment boundaries (gather). The receiver writes
each chunk straight into per-segment buffers of the sizes the header announced
(scatter), so the importing backend gets the same segment list back.

Resumable: the receiver acknowledges chunks strictly in order; after an
interrupted transfer it asks for ``next_index`` (the chunk after the last
acknowledged one) and the sender goes on from there. A chunk already
acknowledged is accepted again as a no-op (a retried send), one from the future
is refused without harming the transfer. The status only moves forward:
WAITING -> TRANSFERRING -> DONE | FAILED, and only the final chunk is marked
``last``.
"""
from __future__ import annotations

import bisect
import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


class TransferStatus(enum.IntEnum):
    """Ordered: a transfer's status never moves back; DONE and FAILED are final."""

    WAITING = 0
    TRANSFERRING = 1
    DONE = 2
    FAILED = 3

    @property
    def is_final(self) -> bool:
        return self >= TransferStatus.DONE


class TransferError(RuntimeError):
    """A transfer cannot go on (it failed, or a chunk contradicts its header)."""


@dataclass(slots=True, frozen=True)
class TransferHeader:
    """What the receiver must know before the first chunk."""

    transfer_id: str  # names the transfer (the request id it carries, usually)
    segment_sizes: tuple[int, ...]  # byte length of each KV segment, in order
    chunk_size: int  # bytes per chunk (the last chunk may be shorter)

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be at least 1 byte, got {self.chunk_size}")
        if any(s < 0 for s in self.segment_sizes):
            raise ValueError(f"segment sizes must be non-negative, got {list(self.segment_sizes)}")

    @property
    def total_bytes(self) -> int:
        return sum(self.segment_sizes)

    @property
    def num_chunks(self) -> int:
        """At least one: an empty transfer still sends its (empty) final chunk."""
        return max(1, -(-self.total_bytes // self.chunk_size))

    def chunk_bounds(self, index: int) -> tuple[int, int]:
        """Byte range [start, end) of chunk ``index`` in the concatenated segments."""
        if not 0 <= index < self.num_chunks:
            raise ValueError(f"chunk index {index} is outside 0..{self.num_chunks - 1}")
        start = index * self.chunk_size
        return start, min(start + self.chunk_size, self.total_bytes)


@dataclass(slots=True, frozen=True)
class KVChunk:
    """One piece of a transfer."""

    transfer_id: str  # the transfer it belongs to
    index: int  # 0-based position in the transfer
    data: bytes  # header.chunk_size bytes (fewer in the last chunk)
    last: bool  # marks the final chunk


class _SegmentMap:
    """Byte offsets of segments in their concatenation, for gather/scatter by range."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.starts: list[int] = []
        offset = 0
        for size in sizes:
            self.starts.append(offset)
            offset += size
        self.sizes = list(sizes)

    def pieces(self, start: int, end: int) -> Iterator[tuple[int, int, int]]:
        """(segment index, offset inside it, length) covering bytes [start, end), in order."""
        seg = max(0, bisect.bisect_right(self.starts, start) - 1)
        pos = start
        while pos < end and seg < len(self.sizes):
            inner = pos - self.starts[seg]
            length = min(self.sizes[seg] - inner, end - pos)
            if length > 0:
                yield seg, inner, length
                pos += length
            seg += 1


class KVSender:
    """Cuts a list of KV segments into fixed-size chunks (a gather over the segments)."""

    def __init__(self, transfer_id: str, segments: Sequence[bytes | bytearray | memoryview], chunk_size: int) -> None:
        self._segments = [memoryview(s).cast("B") for s in segments]
        self.header = TransferHeader(transfer_id, tuple(len(s) for s in self._segments), chunk_size)
        self._map = _SegmentMap(self.header.segment_sizes)

    def chunk(self, index: int) -> KVChunk:
        start, end = self.header.chunk_bounds(index)
        data = b"".join(self._segments[seg][inner:inner + length] for seg, inner, length in self._map.pieces(start, end))
        return KVChunk(self.header.transfer_id, index, data, last=index == self.header.num_chunks - 1)

    def chunks(self, start: int = 0) -> Iterator[KVChunk]:
        """Chunks from ``start`` (a receiver's ``next_index`` when resuming) to the final one."""
        for index in range(start, self.header.num_chunks):
            yield self.chunk(index)


class KVReceiver:
    """Reassembles a transfer into its segments (a scatter into per-segment buffers)."""

    def __init__(self, header: TransferHeader) -> None:
        self.header = header
        self._buffers = [bytearray(size) for size in header.segment_sizes]
        self._map = _SegmentMap(header.segment_sizes)
        self._status = TransferStatus.WAITING
        self._acked = -1
        self.error: str | None = None  # why the transfer failed

    @property
    def status(self) -> TransferStatus:
        return self._status

    @property
    def next_index(self) -> int:
        """The chunk to send next: where an interrupted transfer resumes."""
        return self._acked + 1

    @property
    def bytes_received(self) -> int:
        return 0 if self._acked < 0 else self.header.chunk_bounds(self._acked)[1]

    def accept(self, chunk: KVChunk) -> int:
        """Take one chunk; returns the index of the last acknowledged chunk.

        Raises TransferError for a chunk of another transfer, a chunk after the
        transfer ended, or one from beyond ``next_index`` (the sender must resume
        from ``next_index``). A chunk whose size or ``last`` mark contradicts the
        header fails the transfer.
        """
        if chunk.transfer_id != self.header.transfer_id:
            raise TransferError(f"chunk of transfer {chunk.transfer_id!r} sent to transfer {self.header.transfer_id!r}")
        if self._status.is_final:
            if self._status is TransferStatus.DONE and chunk.index <= self._acked:
                return self._acked  # a retried send of a chunk already taken
            raise TransferError(f"transfer {self.header.transfer_id!r} is {self._status.name}; chunk {chunk.index} refused")
        if chunk.index <= self._acked:
            return self._acked
        if chunk.index != self.next_index:
            raise TransferError(f"chunk {chunk.index} arrived before chunk {self.next_index}: resume from {self.next_index}")
        self._check_shape(chunk)
        self._scatter(chunk)
        self._acked = chunk.index
        self._advance(TransferStatus.DONE if chunk.last else TransferStatus.TRANSFERRING)
        return self._acked

    def _check_shape(self, chunk: KVChunk) -> None:
        start, end = self.header.chunk_bounds(chunk.index)
        should_be_last = chunk.index == self.header.num_chunks - 1
        if len(chunk.data) != end - start or chunk.last != should_be_last:
            self.fail(f"chunk {chunk.index} has {len(chunk.data)} bytes and last={chunk.last}; "
                      f"the header says {end - start} bytes and last={should_be_last}")
            raise TransferError(self.error or "")

    def _scatter(self, chunk: KVChunk) -> None:
        start, end = self.header.chunk_bounds(chunk.index)
        view = memoryview(chunk.data)
        pos = 0
        for seg, inner, length in self._map.pieces(start, end):
            self._buffers[seg][inner:inner + length] = view[pos:pos + length]
            pos += length

    def _advance(self, status: TransferStatus) -> None:
        if status < self._status or (self._status.is_final and status != self._status):
            raise TransferError(f"transfer status cannot go from {self._status.name} to {status.name}")
        self._status = status

    def fail(self, reason: str) -> None:
        """Mark the transfer failed (final); a DONE transfer stays DONE."""
        if self._status is TransferStatus.DONE:
            return
        self.error = reason
        self._status = TransferStatus.FAILED

    def segments(self) -> list[bytes]:
        """The reassembled segments; only once DONE."""
        if self._status is not TransferStatus.DONE:
            raise TransferError(f"transfer {self.header.transfer_id!r} is {self._status.name}, not DONE")
        return [bytes(b) for b in self._buffers]


def send(sender: KVSender, receiver: KVReceiver, *, max_chunks: int | None = None) -> TransferStatus:
    """Send in-process (plain bytes), from where the receiver asks to resume; at most ``max_chunks``."""
    for n, chunk in enumerate(sender.chunks(receiver.next_index)):
        if max_chunks is not None and n >= max_chunks:
            break
        receiver.accept(chunk)
    return receiver.status

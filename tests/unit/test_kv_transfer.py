"""The chunked, resumable KV transfer (no model needed)."""
from __future__ import annotations

import os

import pytest

from cllm.handoff.transfer import KVChunk, KVReceiver, KVSender, TransferError, TransferHeader, TransferStatus, send


def segments_of(*sizes: int) -> list[bytes]:
    return [os.urandom(n) for n in sizes]


@pytest.mark.parametrize("sizes,chunk", [((10,), 3), ((7, 0, 5, 13), 4), ((4, 4, 4), 4), ((1, 2, 3), 100), ((0,), 8)])
def test_chunks_gather_across_segments_and_scatter_back(sizes, chunk):
    segs = segments_of(*sizes)
    sender = KVSender("t", segs, chunk)
    receiver = KVReceiver(sender.header)
    chunks = list(sender.chunks())
    assert len(chunks) == sender.header.num_chunks == max(1, -(-sum(sizes) // chunk))
    assert all(len(c.data) == chunk for c in chunks[:-1]) and 0 <= len(chunks[-1].data) <= chunk
    assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert b"".join(c.data for c in chunks) == b"".join(segs)
    for c in chunks:
        receiver.accept(c)
    assert receiver.status is TransferStatus.DONE
    assert receiver.segments() == segs


def test_status_moves_forward_only():
    sender = KVSender("t", segments_of(10), 4)
    receiver = KVReceiver(sender.header)
    seen = [receiver.status]
    for c in sender.chunks():
        receiver.accept(c)
        seen.append(receiver.status)
    assert seen == [TransferStatus.WAITING, TransferStatus.TRANSFERRING, TransferStatus.TRANSFERRING, TransferStatus.DONE]
    receiver.fail("late failure")  # a finished transfer stays finished
    assert receiver.status is TransferStatus.DONE
    with pytest.raises(TransferError):
        receiver._advance(TransferStatus.TRANSFERRING)


def test_interrupted_transfer_resumes_from_last_acknowledged_chunk():
    segs = segments_of(5, 9, 3)
    sender = KVSender("t", segs, 2)
    receiver = KVReceiver(sender.header)
    assert send(sender, receiver, max_chunks=4) is TransferStatus.TRANSFERRING  # the link drops after 4 chunks
    assert receiver.next_index == 4 and receiver.bytes_received == 8
    with pytest.raises(TransferError):
        receiver.segments()
    resumed = list(sender.chunks(receiver.next_index))
    assert resumed[0].index == 4
    for c in resumed:
        receiver.accept(c)
    assert receiver.status is TransferStatus.DONE and receiver.segments() == segs


def test_duplicate_chunk_is_a_no_op_and_future_chunk_is_refused():
    sender = KVSender("t", segments_of(12), 4)
    receiver = KVReceiver(sender.header)
    receiver.accept(sender.chunk(0))
    assert receiver.accept(sender.chunk(0)) == 0  # retried send
    with pytest.raises(TransferError, match="resume from 1"):
        receiver.accept(sender.chunk(2))
    assert receiver.status is TransferStatus.TRANSFERRING  # a refused chunk does not harm the transfer
    send(sender, receiver)
    assert receiver.segments()[0] == b"".join(sender.chunk(i).data for i in range(3))


def test_bad_chunks_fail_the_transfer():
    sender = KVSender("t", segments_of(12), 4)
    receiver = KVReceiver(sender.header)
    with pytest.raises(TransferError, match="transfer 'u'"):
        receiver.accept(KVChunk("u", 0, b"abcd", False))
    with pytest.raises(TransferError, match="last=True"):
        receiver.accept(KVChunk("t", 0, sender.chunk(0).data, True))  # a final mark on chunk 0 of 3
    assert receiver.status is TransferStatus.FAILED and "last" in (receiver.error or "")
    with pytest.raises(TransferError, match="FAILED"):
        receiver.accept(sender.chunk(0))


def test_short_chunk_fails_the_transfer():
    sender = KVSender("t", segments_of(12), 4)
    receiver = KVReceiver(sender.header)
    with pytest.raises(TransferError):
        receiver.accept(KVChunk("t", 0, b"ab", False))
    assert receiver.status is TransferStatus.FAILED


def test_header_validation():
    with pytest.raises(ValueError, match="chunk_size"):
        TransferHeader("t", (1,), 0)
    with pytest.raises(ValueError, match="chunk index 5"):
        TransferHeader("t", (8,), 4).chunk_bounds(5)

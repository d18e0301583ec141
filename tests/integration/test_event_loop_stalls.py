"""Issue 9 defect 17: tokenising or rendering a ~1 MiB request must not stall other streams: it runs
off the event loop. Measured as the longest gap between the chunks of a concurrent stream while the
big request is being processed, against how long that request took (about a second: the tokenizer).

/detokenize also decodes in a worker thread (tests/unit/test_server_hardening.py), but its decode is
a Python loop over token pieces that holds the GIL, so a stall measurement cannot tell it apart."""
from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Iterator

import pytest

from cllm.stress.server_process import ServerProcess, finish_server, start_server

WORDS = ["bread", "ocean", "quantum", "zebra", "marmalade", "Ünïcödé", "数据", "🙂", "lorem", "ipsum"]


def big_text(seed: int, words: int = 110_000) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))  # ~800 KB, ~260k tokens


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # Speculation off: on this repetitive stream n-gram drafts grow to 24 tokens a step, and a step's
    # chunk gap (one verification, many tokens) is then as long as half the big request; that is not a
    # stall, but this measurement cannot tell it from one.
    srv = start_server("--n-seq-max", "2", "--n-ctx", "4096", "--log-level", "warning", "--speculative", "off")
    yield srv
    finish_server(srv)


def stream_chunk_times(server: ServerProcess, times: list[float], stop: threading.Event) -> None:
    body = {"prompt": "Count slowly:", "max_tokens": 1500, "ignore_eos": True, "stream": True, "temperature": 0}
    with server.http(timeout=120) as client, client.stream("POST", "/v1/completions", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                times.append(time.monotonic())
            if stop.is_set():
                return


BIG_REQUESTS = {
    "completion text prompt": ("/v1/completions", lambda: {"prompt": big_text(1), "max_tokens": 1}),
    "chat": ("/v1/chat/completions", lambda: {"messages": [{"role": "user", "content": big_text(2)}], "max_tokens": 1}),
    "tokenize": ("/tokenize", lambda: {"prompt": big_text(3)}),
    "tokenize chat": ("/tokenize", lambda: {"messages": [{"role": "user", "content": big_text(4)}]}),
}


@pytest.mark.parametrize("kind", list(BIG_REQUESTS))
def test_a_big_request_does_not_stall_a_concurrent_stream(server: ServerProcess, kind: str) -> None:
    path, make_body = BIG_REQUESTS[kind]
    body = make_body()
    times: list[float] = []
    stop = threading.Event()
    reader = threading.Thread(target=stream_chunk_times, args=(server, times, stop))
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while len(times) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(times) >= 5, "the stream did not start"
        with server.http(timeout=120) as client:
            start = time.monotonic()
            resp = client.post(path, json=body)
            end = time.monotonic()
        # 200, or 400 for a prompt longer than the context (found only by tokenising it)
        assert resp.status_code == 200 or (resp.status_code == 400 and "context" in resp.text), resp.text[:300]
        time.sleep(0.3)
    finally:
        stop.set()
        reader.join(timeout=60)
    before = [t for t in times if t < start]
    interval = statistics.median(b - a for a, b in zip(before, before[1:]))  # the stream's usual chunk gap
    window = [t for t in times if start <= t <= end + 0.3]
    gaps = [b - a for a, b in zip([start, *window], [*window, end])]
    elapsed = end - start
    # Were the request processed on the event loop, the stream would get nothing for all of `elapsed`.
    # That is only visible if `elapsed` spans several of the stream's usual chunk gaps (the absolute
    # times depend on the machine: ~0.2 s to tokenise on a quiet fast CPU, seconds on a busy one).
    assert elapsed > 4 * interval, f"{kind} took {elapsed:.3f} s, under 4 chunk gaps ({interval:.3f} s): no stall visible"
    assert len(window) >= 2 and max(gaps) < elapsed / 2, (kind, round(elapsed, 3), [round(g, 3) for g in gaps])

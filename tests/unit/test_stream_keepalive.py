"""Issue 9 defect 15: a stream sends its headers once the engine queued it, and SSE comment
keep-alives while it waits, so proxies with a read timeout do not cut a queued stream."""
from __future__ import annotations

import threading
import time

import httpx

from tests.unit.fakes import fake_config
from tests.unit.live_server import SlowFakeBackend, live_server


def test_queued_stream_gets_headers_at_once_and_keepalives_until_its_first_token():
    config = fake_config(sse_keepalive_s=0.2, n_seq_max=1)
    with live_server(config, SlowFakeBackend(slots=1, step_s=0.05)) as url:
        # One slot, busy for ~2 s with a 40-token request: the stream below waits in the queue.
        busy = threading.Thread(target=lambda: httpx.post(
            f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 40, "temperature": 0}, timeout=30))
        busy.start()
        time.sleep(0.3)
        start = time.monotonic()
        lines: list[tuple[float, str]] = []
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                          json={"prompt": "ab", "max_tokens": 3, "temperature": 0, "stream": True}) as resp:
            headers_after = time.monotonic() - start
            assert resp.status_code == 200
            lines = [(time.monotonic() - start, line) for line in resp.iter_lines() if line]
        busy.join()
    first_data = next(t for t, line in lines if line.startswith("data: "))
    keepalives = [t for t, line in lines if line == ": keep-alive"]
    assert headers_after < 1.0 < first_data, (headers_after, first_data)
    assert len(keepalives) >= 3 and all(t < first_data for t in keepalives)
    assert lines[-1][1] == "data: [DONE]"

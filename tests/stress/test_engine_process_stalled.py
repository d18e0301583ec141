"""The stalled-reader scenario (test_battery's) with the engine core in its own process: readers that stop
reading are aborted after the stall timeout and free their slots, memory stays bounded, other requests
are served meanwhile: the stall timeout and aborts reach the core through the pipe.

The requests must still be running when the stall timeout fires (issue 46 §7: over a zero-cost forward
16,000 tokens were done before it, and the verdict accepted finishing): each step costs 2 ms, so a
request needs 32 s, ten times the 3 s timeout; and every stalled request must end as an abort."""
from __future__ import annotations

import asyncio
import os
import sys
import tempfile

import httpx

from cllm.bench.server_process import free_port
from cllm.stress import verdicts
from cllm.stress.server_process import ServerProcess, finish_server, launch
from cllm.stress.stalled import run_stalled_readers

STREAMS = 4
MAX_TOKENS = 16000
STEP_MS = 2.0  # MAX_TOKENS steps take 32 s: no stalled request can finish before the 3 s stall timeout


def _start_server() -> ServerProcess:
    port = free_port()
    log_fd, log_name = tempfile.mkstemp(prefix=f"cllm-null-{port}-", suffix=".log")
    os.close(log_fd)
    log_file = open(log_name, "wb")  # noqa: SIM115 - closed by finish_server
    cmd = [sys.executable, "-m", "cllm.bench.null_server", "--port", str(port), "--slots", "32", "--sndbuf", "16384",
           "--step-ms", str(STEP_MS)]
    for item in ("stream_stall_timeout_s=3", "log_level=warning", "engine_process=on"):
        cmd += ["--set", item]
    return launch(cmd, port, log_name, log_file)


def _finished(server: ServerProcess) -> dict[str, int]:
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        return client.get("/v1/engine").json()["stats"]["requests_finished"]


def test_stalled_readers_are_aborted_in_the_engine_process() -> None:
    server = _start_server()
    try:
        result = asyncio.run(run_stalled_readers(server, streams=STREAMS, prompt_tokens=4000, max_tokens=MAX_TOKENS))
        finished = _finished(server)
    finally:
        finish_server(server)
    assert verdicts.stalled_failures(result) == []
    # Aborted by the stall timeout, not finished: the one normal request sent meanwhile is the only "length".
    assert finished.get("abort", 0) == STREAMS and finished.get("length", 0) == 1, finished
    assert result.idle_after_s is not None and result.idle_after_s < MAX_TOKENS * STEP_MS / 1000 / 2

"""The stalled-reader scenario (test_battery's) with the engine core in its own process: readers that stop
reading are aborted after the stall timeout and free their slots, memory stays bounded, other requests
are served meanwhile: the stall timeout and aborts reach the core through the pipe."""
from __future__ import annotations

import asyncio

from cllm.stress import verdicts
from cllm.stress.server_process import finish_server
from cllm.stress.stalled import run_stalled_readers, start_null_server


def test_stalled_readers_are_aborted_in_the_engine_process() -> None:
    server = start_null_server("stream_stall_timeout_s=3", "log_level=warning", "engine_process=on", sndbuf=16384)
    try:
        result = asyncio.run(run_stalled_readers(server, streams=4, prompt_tokens=4000, max_tokens=16000))
    finally:
        finish_server(server)
    assert verdicts.stalled_failures(result) == []

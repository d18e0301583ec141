"""A stalled reader holding a connection (issue 46 item 3), with the engine in the API process and in
its own: readers that stop reading under a connection cap of 4 are reset after the stall timeout, and
then clients within the cap get 200, not 503."""
from __future__ import annotations

import asyncio
import socket

import pytest

from cllm.stress.held_connections import held_connections_failures, run_held_connections
from cllm.stress.server_process import finish_server
from cllm.stress.stalled import start_null_server

CAP = 4


@pytest.mark.skipif(not hasattr(socket, "TCP_INFO"), reason="reads the connections' state through Linux's TCP_INFO")
@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_stalled_readers_give_their_connections_back(engine_process: str) -> None:
    server = start_null_server("stream_stall_timeout_s=3", "log_level=warning", f"max_connections={CAP}",
                               f"engine_process={engine_process}", sndbuf=16384)
    try:
        result = asyncio.run(run_held_connections(server, cap=CAP))
    finally:
        finish_server(server)
    assert held_connections_failures(result) == [], result

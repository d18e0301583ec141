"""Servers for the stress battery at CI size (the full size: benchmarks/stress.py)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from cllm.stress.server_process import ServerProcess, finish_server, start_server
from cllm.stress.stalled import start_null_server


@pytest.fixture(scope="session")
def battery_server() -> Iterator[ServerProcess]:
    """8 slots of 1024 tokens: load and disconnects."""
    srv = start_server("--n-seq-max", "8", "--n-ctx", "8192", "--log-level", "warning")
    yield srv
    finish_server(srv)


@pytest.fixture(scope="session")
def fuzz_server() -> Iterator[ServerProcess]:
    """Short outputs (max_tokens_limit 4, n at most 2) so hundreds of generated requests run fast."""
    srv = start_server("--n-seq-max", "8", "--n-ctx", "8192", "--log-level", "warning",
                       "--set", "max_tokens_limit=4", "--set", "max_n=2")
    yield srv
    finish_server(srv)


@pytest.fixture(scope="session")
def flood_server() -> Iterator[ServerProcess]:
    """A 16-place waiting queue (no per-client cap: the flood comes from one address; the connection cap
    above the flood, so it meets the queue bound)."""
    srv = start_server("--n-seq-max", "8", "--n-ctx", "16384", "--max-waiting", "16", "--log-level", "warning",
                       "--set", "max_sequences_per_client=null", "--set", "max_connections=4096")
    yield srv
    finish_server(srv)


@pytest.fixture(scope="session")
def null_server() -> Iterator[ServerProcess]:
    """The real server over a backend whose forward costs nothing (faster than any socket), with a short
    stall timeout: stalled readers."""
    srv = start_null_server("stream_stall_timeout_s=3", "log_level=warning", sndbuf=16384)
    yield srv
    finish_server(srv)

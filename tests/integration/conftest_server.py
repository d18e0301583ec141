"""Fixtures that run a real `cllm serve` process on the embedded model (imported by test_server.py).

The process helpers live in cllm/stress/server_process.py, shared with the stress battery and
benchmarks/stress.py."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from cllm.stress.server_process import (  # noqa: F401 - re-exported for the tests that import them here
    API_KEY,
    STARTUP_TIMEOUT_S,
    ServerProcess,
    finish_server,
    free_port,
    start_server,
)


def _finish(server: ServerProcess) -> None:
    finish_server(server)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """The main server: 16 slots of 1024 tokens each (the error table relies on that), no API key."""
    srv = start_server("--n-seq-max", "16", "--n-ctx", "16384", "--log-level", "info")
    yield srv
    _finish(srv)


@pytest.fixture(scope="module")
def small_server() -> Iterator[ServerProcess]:
    """One slot, one waiting place, a 3 s request timeout, an API key and CORS for one origin."""
    srv = start_server(
        "--n-seq-max", "1", "--max-waiting", "1", "--request-timeout-s", "3", "--log-level", "info",
        "--set", 'cors_origins=["http://example.com"]',
        api_key=API_KEY,
    )
    yield srv
    _finish(srv)

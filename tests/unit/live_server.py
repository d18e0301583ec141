"""A real uvicorn server (cllm's own settings) on a thread, around an in-process app: for tests that
need real sockets and real streaming (slow clients, SSE keep-alives) but no model."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np
import uvicorn

import cllm
from cllm.config import CllmConfig
from cllm.server.app import create_app, uvicorn_config
from tests.unit.fakes import FakeBackend


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class SlowFakeBackend(FakeBackend):
    """The counting fake, ``step_s`` seconds per forward call (a model that takes time)."""

    def __init__(self, *, step_s: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.step_s = step_s

    def forward_batch(self, flat_ids: Sequence[int], positions: Sequence[int], sequence_ids: Sequence[str],
                      *, logits_for: Sequence[str] | None = None) -> np.ndarray:
        time.sleep(self.step_s)
        return super().forward_batch(flat_ids, positions, sequence_ids, logits_for=logits_for)


@contextlib.contextmanager
def live_server(config: CllmConfig, backend: FakeBackend, *, sndbuf: int = 0) -> Iterator[str]:
    """Serve the fake ``backend`` under ``config`` on a free port; yields the base URL. ``sndbuf``: the
    kernel send buffer of each connection in bytes (0: autotuned, megabytes on loopback), small to
    make a client that stops reading block the server's writes soon."""
    config = config.with_overrides(port=free_port(), log_level="warning")
    app = create_app(config, engine=cllm.AsyncLLM(backend=backend, config=config))
    server = uvicorn.Server(uvicorn_config(app, config))
    sockets = None
    if sndbuf:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)  # accepted connections inherit it
        sock.bind((config.server.host, config.server.port))
        sockets = [sock]
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, name="live-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{config.server.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)

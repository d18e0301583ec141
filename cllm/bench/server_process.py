"""A server under benchmark, in a subprocess: started, waited for until ready, stopped with SIGTERM.

Used by the side-by-side benchmarks (cllm serve, llama-server, llama-cpp-python's server), which must
run each server alone on the machine and take it down cleanly between levels.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx


def free_port() -> int:
    """A port nobody listens on right now (127.0.0.1 only)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until_ready(proc: subprocess.Popen, url: str, *, timeout_s: float, what: str,
                     log_tail: Callable[[], str], interval_s: float = 0.1) -> None:
    """Poll ``url`` until it answers 200; RuntimeError with the log's tail if ``proc`` exits first or
    ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log_tail()}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s:\n{log_tail()}")


class BenchServer:
    """``cmd`` started with its output in a temporary log; ready once ``ready_path`` answers 200."""

    def __init__(self, name: str, cmd: list[str], port: int, *, ready_path: str = "/health",
                 timeout_s: float = 240.0) -> None:
        self.name, self.port = name, port
        self.log = tempfile.NamedTemporaryFile(prefix=f"bench-{name}-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_until_ready(self.proc, f"{self.url}{ready_path}", timeout_s=timeout_s, what=name,
                             log_tail=lambda: Path(self.log.name).read_text(errors="replace")[-3000:], interval_s=0.2)
        except RuntimeError:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s; removes the log. Idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.log.close()
            os.unlink(self.log.name)

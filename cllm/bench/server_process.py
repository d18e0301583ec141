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
from pathlib import Path

import httpx


def free_port() -> int:
    """A port nobody listens on right now (127.0.0.1 only)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class BenchServer:
    """``cmd`` started with its output in a temporary log; ready once ``ready_path`` answers 200."""

    def __init__(self, name: str, cmd: list[str], port: int, *, ready_path: str = "/health",
                 timeout_s: float = 240.0) -> None:
        self.name, self.port = name, port
        self.log = tempfile.NamedTemporaryFile(prefix=f"bench-{name}-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited: {Path(self.log.name).read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}{ready_path}", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{name} did not become ready within {timeout_s:.0f} s")

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

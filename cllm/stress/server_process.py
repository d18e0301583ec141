"""A real `cllm serve` subprocess on the embedded model, for the integration tests, the stress battery and
benchmarks/stress.py: start it on a free port, talk to it, read its RSS, stop it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from cllm.bench.server_process import free_port, wait_until_ready

STARTUP_TIMEOUT_S = 90.0
API_KEY = "test-secret-key"


@dataclass
class ServerProcess:
    """A `cllm serve` subprocess and how to talk to it."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    api_key: str | None = None
    _log_file: object = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def http(self, timeout: float | httpx.Timeout = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers(), timeout=timeout)

    def async_http(self, timeout: float | httpx.Timeout = 120.0, max_connections: int = 100) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        return httpx.AsyncClient(base_url=self.base_url, headers=self.headers(), timeout=timeout, limits=limits)

    def openai(self) -> Any:
        import openai  # the test extra; the server helper itself needs only httpx

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key or "unused", max_retries=0, timeout=60.0)

    def async_openai(self) -> Any:
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key or "unused", max_retries=0, timeout=120.0)

    def rss_bytes(self) -> int:
        """The server process's resident memory now (Linux /proc)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for pid {self.proc.pid}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        wait_until_ready(self.proc, f"{self.base_url}/health", timeout_s=timeout_s, what="cllm serve",
                         log_tail=lambda: self.log_text()[-4000:])

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Signal the server and wait for it; kills it (and fails) if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"server did not exit {timeout_s}s after signal {sig}:\n{self.log_text()[-4000:]}")
        return int(self.proc.returncode)


STRESS_PROMPT_CACHE_MIB = 16


def start_server(*args: str, api_key: str | None = None, wait: bool = True, threads: int | None = 1,
                 new_session: bool = False) -> ServerProcess:
    """Start `python -m cllm serve` on a free port with extra CLI ``args``; ``threads=None`` leaves the
    thread count to the server's machine-chosen default; ``new_session``: the server leads a process group
    of its own (with its engine core), which a scenario can signal as systemd or ``kill -- -PGID`` would."""
    port = free_port()
    log_fd, log_name = tempfile.mkstemp(prefix=f"cllm-serve-{port}-", suffix=".log")
    os.close(log_fd)
    log_file = open(log_name, "wb")  # noqa: SIM115 - closed by the fixture
    # One thread: on a shared, busy CI machine llama.cpp's spinning thread barrier makes
    # two threads many times slower than one, and tests care about stable timing.
    cmd = [sys.executable, "-m", "cllm", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--n-threads", str(threads)] if threads is not None else []
    # The host prompt cache grows by design (up to 1/8 of memory by default) and the memory verdicts
    # look for leaks (RSS back within 10 %, growth under 128 MiB): bound it small, so it still fills,
    # evicts and reloads under the battery's load without passing for a leak.
    cmd += ["--set", f"prompt_cache_mib={STRESS_PROMPT_CACHE_MIB}", *args]
    if api_key:
        cmd += ["--api-key", api_key]
    return launch(cmd, port, log_name, log_file, api_key=api_key, wait=wait, new_session=new_session)


def launch(cmd: list[str], port: int, log_name: str, log_file: Any, *, api_key: str | None = None,
           wait: bool = True, new_session: bool = False) -> ServerProcess:
    """Start ``cmd`` (a server on ``port``, output to ``log_file``) without the caller's CLLM_* settings;
    with ``wait``, until its /health says ready (killed if it never does)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLLM_")}
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=new_session)
    server = ServerProcess(proc=proc, port=port, log_path=Path(log_name), api_key=api_key, _log_file=log_file)
    if wait:
        try:
            server.wait_ready()
        except Exception:
            server.stop(signal.SIGKILL)
            raise
    return server


def finish_server(server: ServerProcess, *, allow_tracebacks: bool = False) -> str:
    """Stop the server with SIGTERM; AssertionError unless it exited 0 (and logged no traceback).
    Returns its log; the log file is removed when all was well."""
    code = server.stop()
    server._log_file.close()  # type: ignore[attr-defined]
    log = server.log_text()
    assert code == 0, f"server exited with {code}:\n{log[-4000:]}"
    if not allow_tracebacks:
        assert "Traceback" not in log, f"the server logged an exception:\n{log[-6000:]}"
    server.log_path.unlink(missing_ok=True)  # kept only when something failed
    return log

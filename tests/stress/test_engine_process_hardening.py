"""The engine core in its own process (engine_process=on) on the embedded model (issue 46 §1): requests the
core cannot take are 400s that hold nothing, SIGTERM to the whole process group drains every stream,
and a killed core is restarted by the API process."""
from __future__ import annotations

import asyncio

from cllm.stress.engine_process import (
    core_kill_failures, group_sigterm_failures, run_core_kill, run_group_sigterm, run_unsendable, unsendable_failures,
)
from cllm.stress.server_process import finish_server, start_server

PROCESS_MODE = ("--set", "engine_process=on", "--log-level", "warning")


def test_unsendable_requests_are_400s_that_hold_nothing() -> None:
    server = start_server("--n-seq-max", "4", "--n-ctx", "4096", "--max-waiting", "4", *PROCESS_MODE)
    try:
        result = asyncio.run(run_unsendable(server, count=12))  # three times max_waiting
    finally:
        finish_server(server)
    assert unsendable_failures(result) == []


def test_sigterm_to_the_process_group_drains_every_stream() -> None:
    """systemd and container inits signal the core too: it died at once (117 of 150 tokens, then "engine
    shut down"). The API process drains within shutdown_grace_s; every stream completes; exit 0."""
    server = start_server("--n-seq-max", "8", "--n-ctx", "4096", "--set", "shutdown_grace_s=120", *PROCESS_MODE,
                          new_session=True)
    try:
        result = asyncio.run(run_group_sigterm(server, streams=8, max_tokens=150))
    finally:
        if server.proc.poll() is None:
            server.stop()
        server._log_file.close()  # type: ignore[attr-defined]
    assert group_sigterm_failures(result) == [], server.log_text()[-3000:]
    assert "Traceback" not in server.log_text()
    server.log_path.unlink(missing_ok=True)


def test_a_killed_core_is_restarted_and_only_its_streams_fail() -> None:
    server = start_server("--n-seq-max", "4", "--n-ctx", "8192", *PROCESS_MODE)  # 2,048 tokens a sequence
    try:
        result = asyncio.run(run_core_kill(server, streams=3))
    finally:
        log = finish_server(server, allow_tracebacks=True)
    assert core_kill_failures(result) == [], log[-3000:]
    assert "killed by SIGKILL" in log and "engine stopped: engine stopped" not in log

"""Issue 9's stress battery at full size (CI runs the same scenarios smaller: tests/stress/).

Every scenario comes from cllm/stress/ and is judged by the verdicts the CI tests assert; this
script prints each scenario's figures and failures as JSON and exits 1 if any scenario failed.

    .venv/bin/python benchmarks/stress.py                      # full size: 10,000 requests, 60 s slow readers
    .venv/bin/python benchmarks/stress.py --size medium        # a busy shared machine
    .venv/bin/python benchmarks/stress.py --only load,fuzz --json out.json

Full size takes long on 2 cores (10,000 requests at ~10-20 requests/s); run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cllm.stress import verdicts
from cllm.stress.cpu_contention import cpu_contention_failures, run_cpu_contention
from cllm.stress.disconnects import run_disconnects
from cllm.stress.faults import run_decode_fault
from cllm.stress.flood import run_flood, run_slow_readers
from cllm.stress.fuzz import run_fuzz
from cllm.stress.load import run_load
from cllm.stress.server_process import ServerProcess, finish_server, start_server
from cllm.stress.sigterm import run_sigterm
from cllm.stress.engine_process import (
    core_kill_failures, group_sigterm_failures, run_core_kill, run_group_sigterm, run_unsendable, unsendable_failures,
)
from cllm.stress.held_connections import held_connections_failures, run_held_connections
from cllm.stress.stalled import run_stalled_readers, start_null_server


@dataclass(slots=True, frozen=True)
class Size:
    """How big each scenario runs."""

    load_requests: int  # load: requests from 64 clients through 8 slots
    fuzz_examples: int  # fuzz: generated cases per POST route and generation mode
    flood_requests: int  # flood: requests at once
    slow_reader_s: float  # slow readers: seconds 20 streams are read slowly
    stalled_streams: int  # stalled readers: long-prompt streams that stop reading (null server)


SIZES = {
    "ci": Size(200, 60, 300, 6.0, 4),
    "medium": Size(1_000, 100, 600, 20.0, 8),
    "full": Size(10_000, 250, 1_000, 60.0, 16),
}
SERVER_ARGS = ("--n-seq-max", "8", "--n-ctx", "8192", "--log-level", "warning")


def _with_server(args: tuple[str, ...], work: Callable[[ServerProcess], Any]) -> Any:
    server = start_server(*SERVER_ARGS, *args)
    try:
        return work(server)
    finally:
        finish_server(server)


def _sigterm(_: Size) -> tuple[Any, list[str]]:
    server = start_server(*SERVER_ARGS, "--set", "shutdown_grace_s=1")
    try:
        result = asyncio.run(run_sigterm(server, streams=16, plain=8))
    finally:
        server.stop()
        server._log_file.close()  # type: ignore[attr-defined]
    return result, verdicts.sigterm_failures(result)


PROCESS_MODE = ("--set", "engine_process=on")  # the engine core in its own process (issue 46 §1)


def _unsendable(_: Size) -> tuple[Any, list[str]]:  # schemas nested 300 deep, 3x max_waiting of them
    r = _with_server((*PROCESS_MODE, "--max-waiting", "8"), lambda server: asyncio.run(run_unsendable(server, count=24)))
    return r, unsendable_failures(r)


def _group_sigterm(_: Size) -> tuple[Any, list[str]]:  # SIGTERM to the process group: every stream completes
    server = start_server(*SERVER_ARGS, *PROCESS_MODE, "--set", "shutdown_grace_s=120", new_session=True)
    try:
        r = asyncio.run(run_group_sigterm(server, streams=8, max_tokens=150))
    finally:
        server.stop()
        server._log_file.close()  # type: ignore[attr-defined]
    return r, group_sigterm_failures(r)


def _core_kill(_: Size) -> tuple[Any, list[str]]:  # the core SIGKILLed mid-stream: restarted, serving again
    r = _with_server(PROCESS_MODE, lambda server: asyncio.run(run_core_kill(server, streams=4)))
    return r, core_kill_failures(r)


def _scenarios() -> dict[str, Callable[[Size], tuple[Any, list[str]]]]:
    def load(size: Size) -> tuple[Any, list[str]]:
        r = _with_server((), lambda s: asyncio.run(run_load(s, requests=size.load_requests, clients=64)))
        return r, verdicts.load_failures(r)

    def disconnects(_: Size) -> tuple[Any, list[str]]:
        r = _with_server((), lambda s: asyncio.run(run_disconnects(s, streams=100, cut=50)))
        return r, verdicts.disconnect_failures(r)

    def fuzz(size: Size) -> tuple[Any, list[str]]:
        r = _with_server(("--set", "max_tokens_limit=4", "--set", "max_n=2"),
                         lambda s: run_fuzz(s, examples_per_operation=size.fuzz_examples, derandomize=False))
        return r, verdicts.fuzz_failures(r)

    # The flood must meet the queue bound (429), not the connection cap (503, tested in tests/unit).
    flood_args = ("--n-ctx", "16384", "--max-waiting", "16", "--set", "max_sequences_per_client=null",
                  "--set", "max_connections=4096")

    def flood(size: Size) -> tuple[Any, list[str]]:
        r = _with_server(flood_args, lambda s: asyncio.run(run_flood(s, requests=size.flood_requests)))
        return r, verdicts.flood_failures(r)

    def slow_readers(size: Size) -> tuple[Any, list[str]]:
        r = _with_server(flood_args, lambda s: asyncio.run(run_slow_readers(s, readers=20, seconds=size.slow_reader_s)))
        return r, verdicts.slow_reader_failures(r)

    def stalled(size: Size) -> tuple[Any, list[str]]:
        server = start_null_server("stream_stall_timeout_s=3", "log_level=warning", sndbuf=16384)
        try:
            r = asyncio.run(run_stalled_readers(server, streams=size.stalled_streams, prompt_tokens=4000,
                                                max_tokens=16000))
        finally:
            finish_server(server)
        return r, verdicts.stalled_failures(r)

    def held_connections(_: Size) -> tuple[Any, list[str]]:  # stalled readers under a cap of 4 connections
        server = start_null_server("stream_stall_timeout_s=3", "log_level=warning", "max_connections=4", sndbuf=16384)
        try:
            r = asyncio.run(run_held_connections(server, cap=4))
        finally:
            finish_server(server)
        return r, held_connections_failures(r)

    def cpu_contention(_: Size) -> tuple[Any, list[str]]:  # the default thread count beside 2 busy processes
        server = start_server(*SERVER_ARGS, threads=None)
        try:
            r = run_cpu_contention(server, competitors=2)
        finally:
            finish_server(server)
        return r, cpu_contention_failures(r)

    def faults(_: Size) -> tuple[Any, list[str]]:
        r = run_decode_fault()
        return r, verdicts.fault_failures(r)

    return {"load": load, "disconnects": disconnects, "fuzz": fuzz, "flood": flood,
            "slow_readers": slow_readers, "stalled": stalled, "held_connections": held_connections,
            "cpu_contention": cpu_contention, "faults": faults, "sigterm": _sigterm, "unsendable": _unsendable,
            "group_sigterm": _group_sigterm, "core_kill": _core_kill}


def main(argv: list[str] | None = None) -> int:
    scenarios = _scenarios()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--only", default=",".join(scenarios), help=f"comma-separated subset of {','.join(scenarios)}")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    report: dict[str, Any] = {"size": args.size, **asdict(size), "scenarios": {}}
    for name in args.only.split(","):
        start = time.monotonic()
        result, failures = scenarios[name](size)
        entry = {"seconds": round(time.monotonic() - start, 1), "failures": failures, "figures": asdict(result)}
        report["scenarios"][name] = entry
        print(json.dumps({name: entry}, default=str), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    failed = [n for n, e in report["scenarios"].items() if e["failures"]]
    print(f"stress battery ({args.size}): {'FAILED ' + ', '.join(failed) if failed else 'all scenarios passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

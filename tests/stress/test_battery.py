"""Issue 9's stress battery at CI size against real `cllm serve` processes on the embedded model.
The same scenarios and verdicts at full size: `python benchmarks/stress.py`."""
from __future__ import annotations

import asyncio

from cllm.stress import verdicts
from cllm.stress.disconnects import run_disconnects
from cllm.stress.faults import run_decode_fault
from cllm.stress.flood import run_flood, run_slow_readers
from cllm.stress.fuzz import run_fuzz
from cllm.stress.load import run_load
from cllm.stress.server_process import ServerProcess, start_server
from cllm.stress.sigterm import run_sigterm
from cllm.stress.stalled import run_stalled_readers


def test_load_loses_nothing_and_frees_every_slot(battery_server: ServerProcess) -> None:
    result = asyncio.run(run_load(battery_server, requests=200, clients=64))
    assert verdicts.load_failures(result) == []


def test_disconnect_storm_leaves_the_engine_idle(battery_server: ServerProcess) -> None:
    result = asyncio.run(run_disconnects(battery_server, streams=100, cut=50))
    assert verdicts.disconnect_failures(result) == []


def test_fuzzing_gets_no_5xx_and_the_server_still_serves(fuzz_server: ServerProcess) -> None:
    result = run_fuzz(fuzz_server, examples_per_operation=60)
    assert sorted(result.operations) == ["/detokenize", "/tokenize", "/v1/chat/completions",
                                          "/v1/chat/completions/input_tokens", "/v1/completions", "/v1/embeddings",
                                          "/v1/messages", "/v1/messages/count_tokens",
                                          "/v1/models/{model_id}/load", "/v1/models/{model_id}/unload",
                                          "/v1/responses", "/v1/responses/input_tokens"]
    assert verdicts.fuzz_failures(result) == []


def test_flood_gets_429_with_retry_after_and_bounded_memory(flood_server: ServerProcess) -> None:
    result = asyncio.run(run_flood(flood_server, requests=300))
    assert verdicts.flood_failures(result) == []


def test_slow_readers_keep_memory_bounded(flood_server: ServerProcess) -> None:
    result = asyncio.run(run_slow_readers(flood_server, readers=20, seconds=6.0))
    assert verdicts.slow_reader_failures(result) == []


def test_decode_failure_fails_only_its_request() -> None:
    assert verdicts.fault_failures(run_decode_fault()) == []


def test_sigterm_under_load_ends_every_request_cleanly_and_exits_0() -> None:
    server = start_server("--n-seq-max", "8", "--n-ctx", "8192", "--log-level", "warning",
                          "--set", "shutdown_grace_s=1")
    try:
        result = asyncio.run(run_sigterm(server, streams=16, plain=8))
    finally:
        server.stop()
        server._log_file.close()  # type: ignore[attr-defined]
    assert verdicts.sigterm_failures(result) == [], server.log_text()[-3000:]
    assert result.clean_errors > 0  # the grace (1 s) is shorter than the requests: some were aborted
    server.log_path.unlink(missing_ok=True)


def test_stalled_readers_with_long_prompts_keep_memory_bounded_and_free_their_slots(null_server: ServerProcess) -> None:
    result = asyncio.run(run_stalled_readers(null_server, streams=4, prompt_tokens=4000, max_tokens=16000))
    assert verdicts.stalled_failures(result) == []

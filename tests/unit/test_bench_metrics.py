"""cllm bench metric math on synthetic timings, with exact expected values."""
from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import numpy as np
import pytest
import typer

from cllm.bench.cli import _url_spec, parse_concurrency, parse_rates, parse_sets
from cllm.bench.metrics import (
    RequestRecord, StreamTimer, latency_stats, meets_slo, parse_slo, percentile, summarize_run,
)
from cllm.bench.report import BenchConfig, BenchReport, EnvironmentInfo, RunResult, compare_table, plot_report, runs_table
from cllm.bench.serve import OpenAITarget, api_root
from cllm.bench import workload
from cllm.bench.workload import BenchPrompt, GenerationSettings, arrival_gaps, run_load


def rec(index: int, *, ttft: float, e2e: float, out: int, itl: list[float] | None = None, prompt: int = 10,
        success: bool = True, error: str | None = None) -> RequestRecord:
    return RequestRecord(index=index, prompt_tokens=prompt, max_tokens=out, start=0.0, success=success,
                         output_tokens=out, ttft=ttft, e2e=e2e, itl=itl or [], error=error)


# ----------------------------------------------------------------- percentiles
def test_percentile_interpolates_linearly() -> None:
    values = [float(v) for v in range(1, 11)]  # 1..10
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)  # rank 8.1 -> 9 + 0.1
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 10.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # order does not matter


def test_percentile_rejects_empty_and_out_of_range() -> None:
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match="q=101"):
        percentile([1.0], 101)


def test_latency_stats_in_milliseconds() -> None:
    stats = latency_stats([0.001 * v for v in range(1, 11)])  # 1..10 ms
    assert stats is not None
    assert stats.mean == pytest.approx(5.5)
    assert stats.median == pytest.approx(5.5)
    assert stats.p90 == pytest.approx(9.1)
    assert stats.p99 == pytest.approx(9.91)
    assert stats.std == pytest.approx(math.sqrt(8.25))
    assert stats.count == 10
    assert latency_stats([]) is None


# ----------------------------------------------------------------- per request
def test_tpot_excludes_first_token() -> None:
    assert rec(0, ttft=0.1, e2e=0.4, out=4).tpot == pytest.approx(0.1)  # (0.4 - 0.1) / 3
    assert rec(0, ttft=0.1, e2e=0.1, out=1).tpot is None
    assert rec(0, ttft=0.1, e2e=0.4, out=4, success=False).tpot is None


def test_stream_timer_ttft_itl_and_token_count() -> None:
    timer = StreamTimer.begin(3, prompt_tokens=5, max_tokens=8, run_start=100.0, now=100.5)
    for t in (100.7, 100.8, 101.0):
        timer.chunk(t)
    record = timer.finish(101.1)
    assert record.start == pytest.approx(0.5)
    assert record.ttft == pytest.approx(0.2)
    assert record.itl == pytest.approx([0.1, 0.2])
    assert record.e2e == pytest.approx(0.6)
    assert record.output_tokens == 3 and record.success
    # usage from the server wins over the chunk count
    timer2 = StreamTimer.begin(0, 5, 8, 0.0, 0.0)
    timer2.chunk(0.1)
    assert timer2.finish(0.2, output_tokens=8).output_tokens == 8


def test_stream_timer_failure_and_empty_stream() -> None:
    failed = StreamTimer.begin(0, 5, 8, 0.0, 1.0).fail(1.5, "HTTP 500: boom")
    assert not failed.success and failed.error == "HTTP 500: boom" and failed.e2e == pytest.approx(0.5)
    empty = StreamTimer.begin(0, 5, 8, 0.0, 1.0).finish(1.2)
    assert not empty.success and "empty response" in (empty.error or "")


# ----------------------------------------------------------------- SLO / goodput / throughput
def test_parse_slo() -> None:
    assert parse_slo("ttft:500,tpot:50") == {"ttft": 500.0, "tpot": 50.0}
    assert parse_slo("e2e:2000") == {"e2el": 2000.0}
    assert parse_slo(None) == {}
    for bad in ("ttft", "foo:1", "ttft:abc", "tpot:-1"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def _records() -> list[RequestRecord]:
    return [
        rec(0, ttft=0.1, e2e=0.25, out=4, itl=[0.05, 0.05, 0.05]),  # tpot 50 ms
        rec(1, ttft=0.2, e2e=0.5, out=4, itl=[0.1, 0.1, 0.1]),  # ttft 200 ms: misses ttft:150
        rec(2, ttft=0.0, e2e=0.05, out=0, success=False, error="HTTP 503: busy"),
        rec(3, ttft=0.1, e2e=0.1, out=1, prompt=20),  # one token: tpot counts as 0
        rec(4, ttft=0.0, e2e=0.05, out=0, success=False, error="HTTP 503: busy"),
    ]


def test_meets_slo() -> None:
    records = _records()
    slo = {"ttft": 150.0, "tpot": 60.0}
    assert [meets_slo(r, slo) for r in records] == [True, False, False, True, False]
    assert not meets_slo(records[0], {"tpot": 49.0})


def test_summarize_run_exact_values() -> None:
    s = summarize_run(_records(), duration_s=2.0, slo={"ttft": 150.0, "tpot": 60.0})
    assert (s.num_requests, s.completed, s.failed) == (5, 3, 2)
    assert s.failure_reasons == {"HTTP 503: busy": 2}
    assert s.total_input_tokens == 40 and s.total_output_tokens == 9
    assert s.request_throughput == pytest.approx(1.5)
    assert s.output_throughput == pytest.approx(4.5)
    assert s.total_token_throughput == pytest.approx(24.5)
    assert s.goodput == pytest.approx(1.0)
    assert s.ttft is not None and s.ttft.mean == pytest.approx(400 / 3) and s.ttft.median == pytest.approx(100.0)
    assert s.tpot is not None and s.tpot.count == 2 and s.tpot.mean == pytest.approx(75.0)
    assert s.itl is not None and s.itl.count == 6 and s.itl.mean == pytest.approx(75.0)
    assert s.e2el is not None and s.e2el.p90 == pytest.approx(450.0)  # 100, 250, 500 -> rank 1.8
    assert summarize_run(_records(), 2.0).goodput is None
    with pytest.raises(ValueError):
        summarize_run(_records(), 0.0)


# ----------------------------------------------------------------- load driver
class FakeTarget:
    """Sleeps per request; tracks how many requests are in flight at once."""

    name = "fake"

    def __init__(self, delay: float = 0.01, fail_index: int | None = None) -> None:
        self.delay, self.fail_index = delay, fail_index
        self.in_flight = self.max_in_flight = 0
        self.send_times: list[float] = []

    async def send(self, prompt: BenchPrompt, settings: GenerationSettings, run_start: float) -> RequestRecord:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        timer = StreamTimer.begin(prompt.index, len(prompt.token_ids), prompt.output_len, run_start, time.perf_counter())
        self.send_times.append(timer.record.start)
        await asyncio.sleep(self.delay)
        self.in_flight -= 1
        if prompt.index == self.fail_index:
            return timer.fail(time.perf_counter(), "RuntimeError: injected")
        timer.chunk(time.perf_counter())
        return timer.finish(time.perf_counter(), output_tokens=prompt.output_len)

    async def close(self) -> None:
        pass


def _prompts(n: int) -> list[BenchPrompt]:
    return [BenchPrompt(index=i, text=f"p{i}", token_ids=[1, 2, 3], output_len=4) for i in range(n)]


async def test_run_load_bounds_concurrency_and_keeps_failures() -> None:
    target = FakeTarget(fail_index=2)
    records, duration = await run_load(target, _prompts(10), GenerationSettings(), concurrency=3, progress=False)
    assert target.max_in_flight == 3
    assert [r.index for r in records] == list(range(10))
    assert duration >= 4 * 0.01  # ceil(10 / 3) waves
    summary = summarize_run(records, duration)
    assert summary.failed == 1 and summary.failure_reasons == {"RuntimeError: injected": 1}


async def test_run_load_poisson_arrivals_spread_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each send waits out its arrival gap. run_load's sleeps run on a clock of the test's own: on a
    busy machine real timers fire late, and the lateness adds up from one gap to the next."""
    clock = [0.0]

    class ClockedAsyncio:
        def __getattr__(self, name: str):
            return getattr(asyncio, name)

        @staticmethod
        async def sleep(seconds: float) -> None:
            await asyncio.sleep(0)  # the tasks already started run now, at the sleep's start...
            clock[0] += seconds  # ...and the sleep ends ``seconds`` later
    monkeypatch.setattr(workload, "asyncio", ClockedAsyncio())
    target = FakeTarget(delay=0.0)
    sent: list[float] = []
    send = target.send

    async def clocked_send(prompt: BenchPrompt, *args):
        sent.append(clock[0])
        return await send(prompt, *args)
    target.send = clocked_send
    gaps = arrival_gaps(5, 50.0, seed=7)
    assert all(g > 0 for g in gaps[1:])
    await run_load(target, _prompts(5), GenerationSettings(seed=7), concurrency=None, request_rate=50.0, progress=False)
    assert sent == pytest.approx(list(np.cumsum(gaps)), abs=1e-12)


def test_arrival_gaps() -> None:
    assert arrival_gaps(3, None, 0) == [0.0, 0.0, 0.0]
    assert arrival_gaps(3, 2.0, 0)[0] == 0.0 and all(g > 0 for g in arrival_gaps(3, 2.0, 0)[1:])
    assert arrival_gaps(5, 2.0, 1) == arrival_gaps(5, 2.0, 1)
    assert arrival_gaps(5, 2.0, 1) != arrival_gaps(5, 2.0, 2)
    assert np.mean(arrival_gaps(20000, 4.0, 0)) == pytest.approx(0.25, rel=0.03)
    with pytest.raises(ValueError):
        arrival_gaps(3, 0.0, 0)


# ----------------------------------------------------------------- CLI parsing
def test_parse_concurrency_forms() -> None:
    assert parse_concurrency(["1,4"], ["8", "16"]) == [1, 4, 8, 16]
    assert parse_concurrency(["2", "3"], []) == [2, 3]
    assert parse_concurrency(None, []) == [None]
    for values, extra in ((["0"], []), (["x"], []), (None, ["4"])):
        with pytest.raises(typer.BadParameter):
            parse_concurrency(values, extra)


def test_parse_rates_and_sets() -> None:
    assert parse_rates(["1.5,inf", "4"]) == [1.5, None, 4.0]
    assert parse_rates(None) == [None]
    with pytest.raises(typer.BadParameter):
        parse_rates(["-1"])
    assert parse_sets(["n_batch=1024", "flash_attn=true"]) == {"n_batch": 1024, "flash_attn": True}
    with pytest.raises(typer.BadParameter):
        parse_sets(["n_batch"])


# ----------------------------------------------------------------- report
def _report(runs: list[RunResult], targets: list[str]) -> BenchReport:
    config = BenchConfig(
        mode="compare", command="cllm bench compare", targets=targets, dataset="random", num_prompts=5, input_len=8,
        output_len=4, concurrency=[1, 4], request_rate=[None], seed=0, temperature=0.0, ignore_eos=True, warmup=0,
        slo={}, model=None, n_threads=2, n_ctx=None,
    )
    env = EnvironmentInfo(python="3", platform="x", cllm=None, llama_cpp_python=None, torch=None, cpu_model="cpu",
                          cpu_cores=2, threads=2, gpu=None, model_path=None)
    return BenchReport(created_at="2025-01-01T00:00:00+00:00", config=config, environment=env, runs=runs)


def _run(target: str, conc: int, duration: float) -> RunResult:
    records = _records()
    return RunResult(target=target, concurrency=conc, request_rate=None, summary=summarize_run(records, duration), requests=records)


def test_compare_table_ratios_to_first_target() -> None:
    runs = [_run("a", 1, 2.0), _run("a", 4, 1.0), _run("b", 1, 4.0), _run("b", 4, 1.0)]
    text = compare_table(runs, ["a", "b"])
    lines = text.splitlines()
    c1 = lines.index(next(line for line in lines if line.startswith("c=1")))
    throughput = lines[c1 + 1].split()
    assert throughput == ["output", "tok/s", "4.5", "2.2", "(0.50x)"]
    assert lines[0].split() == ["level", "/", "metric", "a", "b", "vs", "a"]
    assert "c=4" in text and "failed" in text
    assert "a" in runs_table(runs) and "3/2" in runs_table(runs)


def test_report_json_round_trip_and_plot(tmp_path) -> None:
    report = _report([_run("a", 1, 2.0), _run("b", 1, 4.0)], ["a", "b"])
    path = tmp_path / "r.json"
    report.write_json(path)
    loaded = BenchReport.model_validate_json(path.read_text())
    assert loaded.runs[1].summary.output_throughput == pytest.approx(2.25)
    assert loaded.runs[0].requests[0].itl == pytest.approx([0.05, 0.05, 0.05])
    assert json.loads(path.read_text())["runs"][0]["summary"]["failure_reasons"] == {"HTTP 503: busy": 2}
    png = tmp_path / "r.png"
    plot_report(report, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


# ----------------------------------------------------------------- HTTP target (mock transport)
def _sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def _target(handler) -> OpenAITarget:
    client = httpx.AsyncClient(base_url="http://mock/v1", transport=httpx.MockTransport(handler))
    return OpenAITarget(client, model="m", endpoint="completions", send_ignore_eos=True, name="mock")


async def test_http_target_counts_usage_and_skips_empty_chunks() -> None:
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        body = _sse({"choices": [{"text": ""}]}, {"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
                    {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}, "[DONE]")
        return httpx.Response(200, content=body)

    target = _target(handler)
    record = await target.send(_prompts(1)[0], GenerationSettings(seed=5), time.perf_counter())
    await target.close()
    assert record.success and record.output_tokens == 4 and record.prompt_tokens == 3
    assert len(record.itl) == 1  # two non-empty chunks -> one gap
    body = seen[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["seed"] == 5 and body["max_tokens"] == 4 and body["prompt"] == "p0"


async def test_http_target_without_usage_counts_chunks() -> None:
    target = _target(lambda r: httpx.Response(200, content=_sse({"choices": [{"text": "x"}]}, {"choices": [{"text": "y"}]}, "[DONE]")))
    record = await target.send(_prompts(1)[0], GenerationSettings(), time.perf_counter())
    assert record.success and record.output_tokens == 2


async def test_http_target_failures_keep_their_reason() -> None:
    bad_status = _target(lambda r: httpx.Response(429, json={"error": {"message": "queue full"}}))
    record = await bad_status.send(_prompts(1)[0], GenerationSettings(), time.perf_counter())
    assert not record.success and record.error is not None and record.error.startswith("HTTP 429:") and "queue full" in record.error
    in_stream = _target(lambda r: httpx.Response(200, content=_sse({"choices": [{"text": "x"}]}, {"error": {"message": "decode failed"}})))
    record = await in_stream.send(_prompts(1)[0], GenerationSettings(), time.perf_counter())
    assert not record.success and "decode failed" in (record.error or "")

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    record = await _target(refuse).send(_prompts(1)[0], GenerationSettings(), time.perf_counter())
    assert not record.success and record.error == "ConnectError: connection refused"


def test_api_root() -> None:
    assert api_root("http://127.0.0.1:8000") == "http://127.0.0.1:8000/v1"
    assert api_root("http://h:1/v1/") == "http://h:1/v1"
    with pytest.raises(ValueError):
        api_root("127.0.0.1:8000")


def test_url_spec_label() -> None:
    spec = _url_spec("cllm serve=http://127.0.0.1:8000")
    assert (spec.kind, spec.value, spec.label) == ("url", "http://127.0.0.1:8000", "cllm serve")
    plain = _url_spec("http://h:1/v1?x=1")
    assert (plain.value, plain.label) == ("http://h:1/v1?x=1", "http://h:1/v1?x=1")

"""`cllm bench` end to end on the embedded model: offline, serve (live `cllm serve`), compare."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cllm.bench.cli import app
from cllm.bench.report import BenchReport
from tests.integration.conftest_server import free_port, start_server

# Small runs; one thread because on a busy 2-core machine llama.cpp's spinning barrier makes 2 threads far slower.
WORKLOAD = ["--input-len", "16", "--output-len", "8", "--no-progress"]
IN_PROCESS = [*WORKLOAD, "--n-threads", "1"]


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def load(path: Path) -> BenchReport:
    return BenchReport.model_validate_json(path.read_text())


def check_complete_runs(report: BenchReport, *, output_len: int, prompt_len: int | None) -> None:
    """Every request succeeded with exactly output_len tokens and sane timings."""
    for run in report.runs:
        assert run.summary.failed == 0, run.summary.failure_reasons
        assert run.summary.completed == len(run.requests) > 0
        assert run.summary.total_output_tokens == output_len * len(run.requests)
        assert run.summary.output_throughput > 0 and run.summary.ttft is not None and run.summary.e2el is not None
        for r in run.requests:
            assert r.output_tokens == output_len
            if prompt_len is not None:
                assert r.prompt_tokens == prompt_len
            assert r.ttft is not None and r.e2e is not None and 0 < r.ttft <= r.e2e
            assert sum(r.itl) <= r.e2e - r.ttft + 1e-6


@pytest.fixture(scope="module")
def cllm_server() -> Iterator[str]:
    """A real `cllm serve` subprocess on a free port; yields its base URL."""
    server = start_server("--n-seq-max", "4")
    try:
        yield server.base_url
    finally:
        server.stop()


def test_offline_llama_cpp(tmp_path: Path) -> None:
    out, png = tmp_path / "offline.json", tmp_path / "offline.png"
    code, text = invoke("offline", "--backend", "llama_cpp", "--num-prompts", "4", *IN_PROCESS, "--concurrency", "1", "3", "--json", str(out), "--plot", str(png))
    assert code == 0, text
    report = load(out)
    assert report.config.mode == "offline" and report.config.targets == ["cllm[llama_cpp]"]
    assert [(r.concurrency, r.request_rate) for r in report.runs] == [(1, None), (3, None)]
    check_complete_runs(report, output_len=8, prompt_len=16)
    assert report.environment.cpu_cores and report.environment.model_path and report.environment.llama_cpp_python
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "cllm[llama_cpp]" in text and "c=3" in text


def test_serve_against_live_server(cllm_server: str, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    code, text = invoke("serve", "--base-url", cllm_server, "--num-prompts", "4", *WORKLOAD, "--concurrency", "2",
                        "--request-rate", "inf,20", "--slo", "ttft:60000,tpot:60000", "--json", str(out))
    assert code == 0, text
    report = load(out)
    assert [(r.concurrency, r.request_rate) for r in report.runs] == [(2, None), (2, 20.0)]
    # prompt and output token counts come from the server's usage: the prompts re-tokenise exactly
    check_complete_runs(report, output_len=8, prompt_len=16)
    assert all(run.summary.goodput == pytest.approx(run.summary.request_throughput) for run in report.runs)


def test_serve_chat_with_prompt_set(cllm_server: str, tmp_path: Path) -> None:
    out = tmp_path / "chat.json"
    code, text = invoke("serve", "--base-url", cllm_server, "--endpoint", "chat", "--dataset", "prompts",
                        "--num-prompts", "3", "--output-len", "4", "--concurrency", "3", "--no-progress", "--json", str(out))
    assert code == 0, text
    report = load(out)
    assert report.config.dataset == "prompts" and report.config.input_len is None
    check_complete_runs(report, output_len=4, prompt_len=None)


def test_serve_failures_are_counted_with_reasons(tmp_path: Path) -> None:
    out = tmp_path / "fail.json"
    dead = f"http://127.0.0.1:{free_port()}"
    code, text = invoke("serve", "--base-url", dead, "--model", "x", "--num-prompts", "3", "--input-len", "8",
                        "--output-len", "4", "--warmup", "0", "--no-progress", "--json", str(out))
    assert code == 1  # a level with no successful request fails the command
    run = load(out).runs[0]
    assert run.summary.failed == 3 and run.summary.completed == 0
    assert list(run.summary.failure_reasons.values()) == [3]
    assert next(iter(run.summary.failure_reasons)).startswith("ConnectError")
    assert "failures:" in text and "3 x ConnectError" in text


def test_compare_offline_and_baseline(tmp_path: Path) -> None:
    out, png = tmp_path / "compare.json", tmp_path / "compare.png"
    code, text = invoke("compare", "--backend", "llama_cpp", "--baseline", "llama-cpp-python", "--num-prompts", "3", *IN_PROCESS,
                        "-c", "1,3", "--json", str(out), "--plot", str(png))
    assert code == 0, text
    report = load(out)
    assert report.config.targets == ["cllm[llama_cpp]", "llama-cpp-python"]
    assert len(report.runs) == 4
    check_complete_runs(report, output_len=8, prompt_len=16)
    assert "vs cllm[llama_cpp]" in text and "output tok/s" in text
    # The baseline serves one request at a time: at c=3 the last request waited for the other two.
    serial = next(r for r in report.runs if r.target == "llama-cpp-python" and r.concurrency == 3)
    by_finish = sorted(serial.requests, key=lambda r: r.start + (r.e2e or 0))
    assert by_finish[2].ttft is not None and by_finish[0].e2e is not None
    assert by_finish[2].ttft > by_finish[0].e2e
    assert png.stat().st_size > 10_000

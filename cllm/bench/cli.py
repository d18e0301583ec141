"""`cllm bench`: offline, serve and compare benchmarks (a typer sub-app).

List options take several values as repeats (``-c 1 -c 4``), commas
(``-c 1,4,8``) or, for ``--concurrency`` only, values following it
(``--concurrency 1 4 8``).
"""
from __future__ import annotations

import asyncio
import shlex
import sys
from typing import Annotated, Any

import httpx
import typer
import yaml

from cllm.bench.compare import BenchOptions, TargetSpec, run_benchmark
from cllm.bench.metrics import parse_slo
from cllm.bench.report import BenchReport, compare_table, failures_text, plot_report, runs_table

app = typer.Typer(help="Benchmark cllm engines, OpenAI-compatible servers and llama-cpp-python.", no_args_is_help=True)

_EXTRA = {"allow_extra_args": True}

NumPrompts = Annotated[int, typer.Option("--num-prompts", "-n", min=1, help="requests per load level")]
InputLen = Annotated[int, typer.Option("--input-len", min=2, help="prompt tokens (random dataset)")]
OutputLen = Annotated[int, typer.Option("--output-len", min=1, help="output tokens per request")]
Concurrency = Annotated[list[str] | None, typer.Option("--concurrency", "-c", help="max requests in flight; several values sweep (default: all at once)")]
RequestRate = Annotated[list[str] | None, typer.Option("--request-rate", help="Poisson arrival rate in req/s ('inf' = all at once); several values sweep")]
Dataset = Annotated[str, typer.Option("--dataset", help="random (exact token lengths) | prompts (shipped prompt set)")]
Seed = Annotated[int, typer.Option("--seed", help="seed for prompts and sampling")]
Temperature = Annotated[float, typer.Option("--temperature", min=0.0, help="sampling temperature (0 = greedy)")]
IgnoreEos = Annotated[bool, typer.Option("--ignore-eos/--no-ignore-eos", help="generate exactly --output-len tokens")]
Warmup = Annotated[int, typer.Option("--warmup", min=0, help="unmeasured warm-up requests per target")]
Slo = Annotated[str | None, typer.Option("--slo", help="goodput limits, e.g. ttft:500,tpot:50 (ms; ttft, tpot, e2el)")]
Threads = Annotated[int | None, typer.Option("--n-threads", min=1, help="inference threads (in-process engines, baseline)")]
NCtx = Annotated[int | None, typer.Option("--n-ctx", min=64, help="KV cache size of in-process engines")]
Sets = Annotated[list[str] | None, typer.Option("--set", help="extra flat cllm config for in-process engines, KEY=VALUE")]
JsonOut = Annotated[str | None, typer.Option("--json", help="write the full report (config, environment, per-request records) here")]
PlotOut = Annotated[str | None, typer.Option("--plot", help="write a PNG of throughput and latency distributions here")]
NoProgress = Annotated[bool, typer.Option("--no-progress", help="hide progress bars")]


def _split(values: list[str] | None) -> list[str]:
    return [part.strip() for v in values or [] for part in str(v).split(",") if part.strip()]


def parse_concurrency(values: list[str] | None, extra: list[str]) -> list[int | None]:
    """``--concurrency`` values (plus bare values after it) -> bounds; none given = unbounded."""
    items = _split(values) + _split(extra)
    if extra and not values:
        raise typer.BadParameter(f"unexpected arguments {extra}", param_hint="'--concurrency'")
    bounds: list[int | None] = []
    for item in items:
        if not item.isdigit() or int(item) < 1:
            raise typer.BadParameter(f"{item!r} is not an integer >= 1", param_hint="'--concurrency'")
        bounds.append(int(item))
    return bounds or [None]


def parse_rates(values: list[str] | None) -> list[float | None]:
    """``--request-rate`` values -> req/s, ``inf`` -> None (all at once)."""
    rates: list[float | None] = []
    for item in _split(values):
        try:
            rate = float(item)
        except ValueError:
            raise typer.BadParameter(f"{item!r} is not a number", param_hint="'--request-rate'") from None
        if not rate > 0:
            raise typer.BadParameter(f"{item!r} must be > 0", param_hint="'--request-rate'")
        rates.append(None if rate == float("inf") else rate)
    return rates or [None]


def parse_sets(values: list[str] | None) -> dict[str, Any]:
    """``KEY=VALUE`` pairs, values parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for item in values or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="'--set'")
        out[key.strip()] = yaml.safe_load(raw)
    return out


def _url_spec(text: str) -> TargetSpec:
    """``URL`` or ``LABEL=URL`` (the label names the column)."""
    label, sep, url = text.partition("=")
    if sep and not label.startswith(("http://", "https://")):
        return TargetSpec("url", url.strip(), label.strip())
    return TargetSpec("url", text)


def _slo(text: str | None) -> dict[str, float]:
    try:
        return parse_slo(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--slo'") from None


def _finish(report: BenchReport, json_out: str | None, plot_out: str | None, side_by_side: bool) -> None:
    """Print the tables, write the JSON / PNG, and fail the command if a level had no success."""
    typer.echo(runs_table(report.runs))
    if side_by_side:
        typer.echo("\n" + compare_table(report.runs, report.config.targets))
    failures = failures_text(report.runs)
    if failures:
        typer.echo("\n" + failures)
    if json_out:
        report.write_json(json_out)
        typer.echo(f"wrote {json_out}")
    if plot_out:
        plot_report(report, plot_out)
        typer.echo(f"wrote {plot_out}")
    if any(run.summary.completed == 0 for run in report.runs):
        raise typer.Exit(code=1)


def _run(specs: list[TargetSpec], opts: BenchOptions, mode: str) -> BenchReport:
    command = shlex.join(["cllm", *sys.argv[1:]])
    try:
        return asyncio.run(run_benchmark(specs, opts, mode=mode, command=command))
    except (ValueError, KeyError, OSError, httpx.HTTPError) as exc:  # bad input / unreachable target: no traceback
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        typer.echo(f"error: {type(exc).__name__}: {message}", err=True)
        raise typer.Exit(code=2) from None


@app.command(context_settings=_EXTRA)
def offline(
    ctx: typer.Context,
    backend: Annotated[str, typer.Option("--backend", "-b", help="registered cllm backend")] = "llama_cpp",
    model: Annotated[str | None, typer.Option("--model", "-m", help="GGUF file or HF directory (default: embedded SmolLM2-135M)")] = None,
    num_prompts: NumPrompts = 32, input_len: InputLen = 128, output_len: OutputLen = 64,
    concurrency: Concurrency = None, dataset: Dataset = "random", seed: Seed = 0, temperature: Temperature = 0.0,
    ignore_eos: IgnoreEos = True, warmup: Warmup = 1, slo: Slo = None, n_threads: Threads = None, n_ctx: NCtx = None,
    sets: Sets = None, json_out: JsonOut = None, plot_out: PlotOut = None, no_progress: NoProgress = False,
) -> None:
    """Drive a cllm engine in this process (AsyncLLM), at most C requests in flight per level."""
    opts = BenchOptions(
        model=model, dataset=dataset, num_prompts=num_prompts, input_len=input_len, output_len=output_len,
        concurrency=parse_concurrency(concurrency, ctx.args), seed=seed, temperature=temperature, ignore_eos=ignore_eos,
        warmup=warmup, slo=_slo(slo), n_threads=n_threads, n_ctx=n_ctx, engine_overrides=parse_sets(sets),
        progress=not no_progress,
    )
    _finish(_run([TargetSpec("backend", backend)], opts, "offline"), json_out, plot_out, side_by_side=False)


@app.command(context_settings=_EXTRA)
def serve(
    ctx: typer.Context,
    base_url: Annotated[str, typer.Option("--base-url", help="server root, e.g. http://127.0.0.1:8000")],
    model: Annotated[str | None, typer.Option("--model", "-m", help="model id to request (default: first of GET /v1/models)")] = None,
    tokenizer: Annotated[str | None, typer.Option("--tokenizer", help="local GGUF / HF dir whose tokenizer builds the prompts (default: embedded SmolLM2)")] = None,
    endpoint: Annotated[str, typer.Option("--endpoint", help="completions | chat")] = "completions",
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="OPENAI_API_KEY", help="bearer token")] = None,
    send_ignore_eos: Annotated[bool, typer.Option("--send-ignore-eos/--no-send-ignore-eos", help="send the ignore_eos extension field")] = True,
    timeout: Annotated[float, typer.Option("--timeout", min=1.0, help="per-request timeout (s)")] = 600.0,
    num_prompts: NumPrompts = 32, input_len: InputLen = 128, output_len: OutputLen = 64,
    concurrency: Concurrency = None, request_rate: RequestRate = None, dataset: Dataset = "random", seed: Seed = 0,
    temperature: Temperature = 0.0, ignore_eos: IgnoreEos = True, warmup: Warmup = 1, slo: Slo = None,
    json_out: JsonOut = None, plot_out: PlotOut = None, no_progress: NoProgress = False,
) -> None:
    """Load-test any OpenAI-compatible endpoint with streamed requests."""
    opts = BenchOptions(
        model=tokenizer, dataset=dataset, num_prompts=num_prompts, input_len=input_len, output_len=output_len,
        concurrency=parse_concurrency(concurrency, ctx.args), request_rate=parse_rates(request_rate), seed=seed,
        temperature=temperature, ignore_eos=ignore_eos, warmup=warmup, slo=_slo(slo), served_model=model,
        endpoint=endpoint, api_key=api_key, send_ignore_eos=send_ignore_eos, timeout_s=timeout, progress=not no_progress,
    )
    _finish(_run([TargetSpec("url", base_url)], opts, "serve"), json_out, plot_out, side_by_side=False)


@app.command(context_settings=_EXTRA)
def compare(
    ctx: typer.Context,
    backend: Annotated[list[str] | None, typer.Option("--backend", "-b", help="in-process cllm backend (repeatable)")] = None,
    url: Annotated[list[str] | None, typer.Option("--url", help="OpenAI-compatible server root, or LABEL=URL (repeatable)")] = None,
    baseline: Annotated[list[str] | None, typer.Option("--baseline", help="llama-cpp-python: serial llama_cpp.Llama on the same prompts")] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="GGUF file or HF directory for in-process targets, baseline and prompts")] = None,
    served_model: Annotated[str | None, typer.Option("--served-model", help="model id for --url targets (default: first of GET /v1/models)")] = None,
    endpoint: Annotated[str, typer.Option("--endpoint", help="completions | chat (URL targets)")] = "completions",
    num_prompts: NumPrompts = 32, input_len: InputLen = 128, output_len: OutputLen = 64,
    concurrency: Concurrency = None, request_rate: RequestRate = None, dataset: Dataset = "random", seed: Seed = 0,
    temperature: Temperature = 0.0, ignore_eos: IgnoreEos = True, warmup: Warmup = 1, slo: Slo = None,
    n_threads: Threads = None, n_ctx: NCtx = None, sets: Sets = None,
    json_out: JsonOut = None, plot_out: PlotOut = None, no_progress: NoProgress = False,
) -> None:
    """One workload over several targets, side by side with ratios to the first.

    Column order: --backend targets, then --url targets, then --baseline.
    """
    specs = [TargetSpec("backend", b) for b in backend or []] + [_url_spec(u) for u in url or []]
    try:
        specs += [TargetSpec("baseline", b) for b in baseline or []]
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--baseline'") from None
    opts = BenchOptions(
        model=model, dataset=dataset, num_prompts=num_prompts, input_len=input_len, output_len=output_len,
        concurrency=parse_concurrency(concurrency, ctx.args), request_rate=parse_rates(request_rate), seed=seed,
        temperature=temperature, ignore_eos=ignore_eos, warmup=warmup, slo=_slo(slo), n_threads=n_threads, n_ctx=n_ctx,
        engine_overrides=parse_sets(sets), served_model=served_model, endpoint=endpoint, progress=not no_progress,
    )
    _finish(_run(specs, opts, "compare"), json_out, plot_out, side_by_side=True)

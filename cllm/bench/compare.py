"""Run one workload over one or more targets and collect a BenchReport.

``cllm bench offline`` is this with one in-process backend, ``cllm bench serve``
with one URL, ``cllm bench compare`` with several of any kind. Targets run one
after another (never at the same time, so they do not share the CPU), each
over every load level with the same prompts. Every level gets its own prompts
(seeded from ``--seed`` and the level's position) so a prefix cache cannot
serve a level from the previous one's prompts; warm-up requests use prompts of
their own too.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from cllm.bench.baseline import BASELINES, LlamaCppPythonTarget
from cllm.bench.metrics import summarize_run
from cllm.bench.offline import EngineTarget, engine_overrides
from cllm.bench.report import BenchConfig, BenchReport, EnvironmentInfo, RunResult, collect_environment, now_iso
from cllm.bench.serve import OpenAITarget
from cllm.bench.workload import BenchPrompt, GenerationSettings, PromptTokenizer, Target, load_tokenizer, make_prompts, run_load
from cllm.model_path import resolve_model_path

TARGET_KINDS = ("backend", "url", "baseline")
WARMUP_SEED_OFFSET = 1_000_003  # warm-up prompts never coincide with measured ones


@dataclass(slots=True)
class TargetSpec:
    """One column of a comparison."""

    kind: str  # "backend" (in-process engine) | "url" (OpenAI-compatible server) | "baseline"
    value: str  # backend name, base URL, or baseline name
    label: str = ""  # column label; default: value

    def __post_init__(self) -> None:
        if self.kind not in TARGET_KINDS:
            raise ValueError(f"unknown target kind {self.kind!r}; valid: {', '.join(TARGET_KINDS)}")
        if self.kind == "baseline" and self.value not in BASELINES:
            raise ValueError(f"unknown baseline {self.value!r}; valid: {', '.join(BASELINES)}")
        self.label = self.label or (self.value if self.kind != "backend" else f"cllm[{self.value}]")


@dataclass(slots=True)
class BenchOptions:
    """Workload, load levels and target settings shared by all targets."""

    model: str | None = None  # model file/dir for in-process targets, the baseline and the tokenizer
    dataset: str = "random"  # random | prompts
    num_prompts: int = 32  # requests per load level
    input_len: int = 128  # prompt tokens (random dataset)
    output_len: int = 64  # output tokens per request
    concurrency: list[int | None] = field(default_factory=lambda: [None])  # in-flight bounds to sweep
    request_rate: list[float | None] = field(default_factory=lambda: [None])  # Poisson rates to sweep
    seed: int = 0  # prompts and sampling
    temperature: float = 0.0  # sampling temperature
    ignore_eos: bool = True  # exactly output_len tokens per request
    warmup: int = 1  # unmeasured requests per target before the sweep
    slo: dict[str, float] = field(default_factory=dict)  # goodput limits (ms)
    n_threads: int | None = None  # threads for in-process engines and the baseline
    n_ctx: int | None = None  # KV cache size for in-process engines (None = engine default)
    engine_overrides: dict[str, Any] = field(default_factory=dict)  # extra flat cllm config for engines
    served_model: str | None = None  # model id for URL targets (None = first in /v1/models)
    endpoint: str = "completions"  # completions | chat
    api_key: str | None = None  # bearer token for URL targets
    send_ignore_eos: bool = True  # send the ignore_eos extension to URL targets
    timeout_s: float = 600.0  # per-request HTTP timeout
    progress: bool = True  # tqdm bars

    def levels(self) -> list[tuple[int | None, float | None]]:
        """(concurrency, request_rate) pairs in sweep order."""
        return [(c, r) for c in self.concurrency for r in self.request_rate]

    def max_in_flight(self) -> int:
        bounds = [c if c is not None else self.num_prompts for c in self.concurrency]
        return max(bounds)


async def _open_target(spec: TargetSpec, opts: BenchOptions, max_prompt_tokens: int) -> Target:
    """Load / connect the target ``spec`` names."""
    if spec.kind == "backend":
        overrides = engine_overrides(max_concurrency=opts.max_in_flight(), n_threads=opts.n_threads, n_ctx=opts.n_ctx, extra=opts.engine_overrides)
        return EngineTarget.open(backend=spec.value, model=opts.model, overrides=overrides, name=spec.label)
    if spec.kind == "url":
        return await OpenAITarget.open(
            spec.value, model=opts.served_model, endpoint=opts.endpoint, api_key=opts.api_key,
            send_ignore_eos=opts.send_ignore_eos, timeout_s=opts.timeout_s, name=spec.label,
        )
    n_ctx = max(2048, max_prompt_tokens + opts.output_len + 64)
    return LlamaCppPythonTarget.open(resolve_model_path(opts.model), n_ctx=n_ctx, n_threads=opts.n_threads)


def _workloads(tokenizer: PromptTokenizer, opts: BenchOptions) -> tuple[list[BenchPrompt], list[list[BenchPrompt]]]:
    """Warm-up prompts and one prompt list per load level."""
    def make(num: int, seed: int) -> list[BenchPrompt]:
        return make_prompts(tokenizer, opts.dataset, num, opts.input_len, opts.output_len, seed)

    warmup = make(opts.warmup, opts.seed + WARMUP_SEED_OFFSET) if opts.warmup else []
    per_level = [make(opts.num_prompts, opts.seed + i) for i in range(len(opts.levels()))]
    return warmup, per_level


async def _sweep(target: Target, opts: BenchOptions, warmup: list[BenchPrompt], per_level: list[list[BenchPrompt]]) -> list[RunResult]:
    """Warm the target up, then run every load level."""
    settings = GenerationSettings(temperature=opts.temperature, seed=opts.seed, ignore_eos=opts.ignore_eos)
    if warmup:
        await run_load(target, warmup, settings, concurrency=1, desc=f"{target.name} warm-up", progress=opts.progress)
    results = []
    for (concurrency, rate), prompts in zip(opts.levels(), per_level):
        desc = f"{target.name} c={concurrency or 'inf'}" + (f" rate={rate:g}" if rate else "")
        records, duration = await run_load(target, prompts, settings, concurrency=concurrency, request_rate=rate, desc=desc, progress=opts.progress)
        summary = summarize_run(records, duration, opts.slo)
        results.append(RunResult(target=target.name, concurrency=concurrency, request_rate=rate, summary=summary, requests=records))
    return results


async def run_benchmark(specs: list[TargetSpec], opts: BenchOptions, *, mode: str, command: str | None = None) -> BenchReport:
    """Run the workload on each target in turn; the report lists targets in ``specs`` order."""
    if not specs:
        raise ValueError("no target: give at least one --backend, --url or --baseline")
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"duplicate target labels {labels}; each target may appear once")
    environment = _environment(opts)  # before the run, so the load average shows other work only
    tokenizer = load_tokenizer(opts.model)
    warmup, per_level = _workloads(tokenizer, opts)
    max_prompt = max(len(p.token_ids) for prompts in per_level for p in prompts)
    runs: list[RunResult] = []
    for spec in specs:
        target = await _open_target(spec, opts, max_prompt)
        try:
            runs += await _sweep(target, opts, warmup, per_level)
        finally:
            await target.close()
    return BenchReport(created_at=now_iso(), config=_config(opts, mode, labels, command), environment=environment, runs=runs)


def _config(opts: BenchOptions, mode: str, labels: list[str], command: str | None) -> BenchConfig:
    return BenchConfig(
        mode=mode, command=command or " ".join(sys.argv), targets=labels, dataset=opts.dataset, num_prompts=opts.num_prompts,
        input_len=opts.input_len if opts.dataset == "random" else None, output_len=opts.output_len,
        concurrency=list(opts.concurrency), request_rate=list(opts.request_rate), seed=opts.seed,
        temperature=opts.temperature, ignore_eos=opts.ignore_eos, warmup=opts.warmup, slo=dict(opts.slo),
        model=opts.model, n_threads=opts.n_threads, n_ctx=opts.n_ctx,
    )


def _environment(opts: BenchOptions) -> EnvironmentInfo:
    try:
        model_path = str(resolve_model_path(opts.model))
    except FileNotFoundError:
        model_path = opts.model
    return collect_environment(threads=opts.n_threads, model_path=model_path)

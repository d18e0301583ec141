"""Benchmark results: the JSON model, the environment, text tables and plots."""
from __future__ import annotations

import datetime as dt
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from cllm.bench.metrics import LatencyStats, RequestRecord, RunSummary
from cllm.machine import cpu_model


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class EnvironmentInfo(_Model):
    """Where the benchmark ran."""

    python: str = Field(description="Python version")
    platform: str = Field(description="OS / kernel / architecture")
    cllm: str | None = Field(description="cllm version")
    llama_cpp_python: str | None = Field(description="llama-cpp-python version, if installed")
    torch: str | None = Field(description="torch version, if installed")
    cpu_model: str | None = Field(description="CPU model name")
    cpu_cores: int | None = Field(description="logical CPUs visible to this process")
    threads: int | None = Field(description="inference threads asked for (None = backend default)")
    gpu: str | None = Field(description="GPU name(s), if any")
    model_path: str | None = Field(description="model file or directory")
    llama_cpp_system_info: str | None = Field(None, description="llama.cpp's compile-time CPU features")
    load_average: list[float] | None = Field(None, description="1/5/15-minute load average when the report was made (other work on the machine skews results)")


class BenchConfig(_Model):
    """What was run."""

    mode: str = Field(description="offline | serve | compare")
    command: str = Field(description="the command line")
    targets: list[str] = Field(description="target labels, in table order")
    dataset: str = Field(description="random | prompts")
    num_prompts: int = Field(description="requests per load level")
    input_len: int | None = Field(description="prompt tokens (random dataset)")
    output_len: int = Field(description="output tokens asked per request")
    concurrency: list[int | None] = Field(description="in-flight bounds swept; None = unbounded")
    request_rate: list[float | None] = Field(description="Poisson rates swept (req/s); None = all at once")
    seed: int = Field(description="prompt and sampling seed")
    temperature: float = Field(description="sampling temperature")
    ignore_eos: bool = Field(description="generate exactly output_len tokens")
    warmup: int = Field(description="unmeasured requests sent to each target first")
    slo: dict[str, float] = Field(description="goodput limits in ms (ttft / tpot / e2el)")
    model: str | None = Field(description="model argument (None = embedded default)")
    n_threads: int | None = Field(description="inference threads for in-process targets")
    n_ctx: int | None = Field(description="KV cache size for in-process targets (None = default)")


class RunResult(_Model):
    """One target at one load level."""

    target: str = Field(description="target label")
    concurrency: int | None = Field(description="in-flight bound; None = unbounded")
    request_rate: float | None = Field(description="Poisson arrival rate (req/s); None = all at once")
    summary: RunSummary = Field(description="aggregate metrics")
    requests: list[RequestRecord] = Field(description="per-request records")


class BenchReport(_Model):
    """Everything `--json` writes."""

    created_at: str = Field(description="ISO 8601 UTC time the report was made")
    config: BenchConfig
    environment: EnvironmentInfo
    runs: list[RunResult]

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=2) + "\n", encoding="utf-8")


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _gpu() -> str | None:
    """GPU names from torch if it is already loaded, else nvidia-smi if present."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
            names = [n.strip() for n in out.stdout.splitlines() if n.strip()]
            return ", ".join(names) or None
        except (OSError, subprocess.SubprocessError):
            return None
    return None


def _llama_system_info() -> str | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()


def collect_environment(*, threads: int | None, model_path: str | None) -> EnvironmentInfo:
    """Versions, CPU/GPU and model of this machine."""
    return EnvironmentInfo(
        python=platform.python_version(), platform=platform.platform(), cllm=_version("cllm"),
        llama_cpp_python=_version("llama_cpp_python"), torch=_version("torch"), cpu_model=cpu_model(),
        cpu_cores=os.cpu_count(), threads=threads, gpu=_gpu(), model_path=model_path,
        llama_cpp_system_info=_llama_system_info(), load_average=_load_average(),
    )


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain aligned text table: first column left-aligned, the rest right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _stat(stats: LatencyStats | None, name: str) -> float | None:
    return None if stats is None else getattr(stats, name)


def level_label(run: RunResult) -> str:
    """``c=8``, ``rate=2.0``, or both."""
    parts = []
    if run.concurrency is not None:
        parts.append(f"c={run.concurrency}")
    if run.request_rate is not None:
        parts.append(f"rate={run.request_rate:g}")
    return " ".join(parts) or "unbounded"


# (row label, value getter, decimals) for the side-by-side comparison.
COMPARE_METRICS: list[tuple[str, Callable[[RunSummary], float | None], int]] = [
    ("output tok/s", lambda s: s.output_throughput, 1),
    ("requests/s", lambda s: s.request_throughput, 2),
    ("TTFT mean ms", lambda s: _stat(s.ttft, "mean"), 1),
    ("TTFT p99 ms", lambda s: _stat(s.ttft, "p99"), 1),
    ("TPOT mean ms", lambda s: _stat(s.tpot, "mean"), 2),
    ("ITL p99 ms", lambda s: _stat(s.itl, "p99"), 2),
    ("E2E mean ms", lambda s: _stat(s.e2el, "mean"), 1),
    ("E2E p99 ms", lambda s: _stat(s.e2el, "p99"), 1),
    ("goodput req/s", lambda s: s.goodput, 2),
    ("failed", lambda s: float(s.failed), 0),
]


def runs_table(runs: Sequence[RunResult]) -> str:
    """One row per target and load level."""
    headers = ["target", "level", "ok/fail", "req/s", "out tok/s", "TTFT mean", "TTFT p50", "TTFT p99",
               "TPOT mean", "TPOT p99", "ITL mean", "ITL p99", "E2E mean", "E2E p99", "goodput"]
    rows = []
    for run in runs:
        s = run.summary
        rows.append([
            run.target, level_label(run), f"{s.completed}/{s.failed}", _num(s.request_throughput, 2),
            _num(s.output_throughput), _num(_stat(s.ttft, "mean")), _num(_stat(s.ttft, "median")),
            _num(_stat(s.ttft, "p99")), _num(_stat(s.tpot, "mean"), 2), _num(_stat(s.tpot, "p99"), 2),
            _num(_stat(s.itl, "mean"), 2), _num(_stat(s.itl, "p99"), 2), _num(_stat(s.e2el, "mean")),
            _num(_stat(s.e2el, "p99")), _num(s.goodput, 2),
        ])
    return format_table(headers, rows) + "\n(latencies in ms; goodput in req/s meeting --slo)"


def _ratio(value: float | None, first: float | None) -> str:
    if value is None or first is None or first == 0:
        return ""
    return f"({value / first:.2f}x)"


def compare_table(runs: Sequence[RunResult], targets: Sequence[str]) -> str:
    """Per load level, one row per metric and one column per target, with ratios to the first target."""
    by_key = {(r.target, level_label(r)): r for r in runs}
    levels = list(dict.fromkeys(level_label(r) for r in runs))
    headers = ["level / metric", targets[0], *(h for t in targets[1:] for h in (t, f"vs {targets[0]}"))]
    rows: list[list[str]] = []
    for level in levels:
        rows.append([level, *([""] * (len(headers) - 1))])
        for label, get, digits in COMPARE_METRICS:
            values = [get(by_key[(t, level)].summary) if (t, level) in by_key else None for t in targets]
            cells = [f"  {label}", _num(values[0], digits)]
            for v in values[1:]:
                cells += [_num(v, digits), _ratio(v, values[0])]
            rows.append(cells)
    return format_table(headers, rows)


def failures_text(runs: Sequence[RunResult]) -> str:
    """Failure reasons per run, empty when nothing failed."""
    lines = []
    for run in runs:
        for reason, count in run.summary.failure_reasons.items():
            lines.append(f"{run.target} {level_label(run)}: {count} x {reason}")
    return ("failures:\n  " + "\n  ".join(lines)) if lines else ""


def _x_axis(runs: Sequence[RunResult]) -> tuple[list[str], str]:
    """Level labels in sweep order and the x-axis title."""
    levels = list(dict.fromkeys(level_label(r) for r in runs))
    if all(r.request_rate is None for r in runs):
        return levels, "concurrency (requests in flight)"
    return levels, "load level"


def _grouped_boxes(ax: Any, runs: Sequence[RunResult], targets: Sequence[str], levels: list[str],
                   values: Callable[[RunResult], list[float]], title: str) -> None:
    width = 0.8 / max(1, len(targets))
    for t_idx, target in enumerate(targets):
        data, positions = [], []
        for l_idx, level in enumerate(levels):
            match = [r for r in runs if r.target == target and level_label(r) == level]
            if match and values(match[0]):
                data.append(values(match[0]))
                positions.append(l_idx + (t_idx - (len(targets) - 1) / 2) * width)
        if data:
            box = ax.boxplot(data, positions=positions, widths=width * 0.9, patch_artist=True, showfliers=False)
            for patch in box["boxes"]:
                patch.set_facecolor(f"C{t_idx}")
                patch.set_alpha(0.6)
            ax.plot([], [], color=f"C{t_idx}", linewidth=6, alpha=0.6, label=target)
    ax.set_xticks(range(len(levels)), levels)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)


def plot_report(report: BenchReport, path: str | Path) -> None:
    """Throughput vs load level and latency distributions, as a PNG (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, targets = report.runs, report.config.targets
    levels, xlabel = _x_axis(runs)
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax = axes[0][0]
    for t_idx, target in enumerate(targets):
        points = [(levels.index(level_label(r)), r.summary.output_throughput) for r in runs if r.target == target]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=f"C{t_idx}", label=target)
    ax.set_xticks(range(len(levels)), levels)
    ax.set_ylim(bottom=0)
    ax.set_title("output throughput (tokens/s)")
    ax.set_xlabel(xlabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ms = 1000.0
    _grouped_boxes(axes[0][1], runs, targets, levels, lambda r: [x.ttft * ms for x in r.requests if x.success and x.ttft is not None], "TTFT (ms)")
    _grouped_boxes(axes[1][0], runs, targets, levels, lambda r: [t * ms for x in r.requests if (t := x.tpot) is not None], "TPOT (ms)")
    _grouped_boxes(axes[1][1], runs, targets, levels, lambda r: [x.e2e * ms for x in r.requests if x.success and x.e2e is not None], "end-to-end latency (ms)")
    axes[1][1].legend(fontsize=8)
    c = report.config
    fig.suptitle(f"cllm bench {c.mode}: {c.num_prompts} requests x {c.output_len} output tokens, "
                 f"input {c.input_len if c.dataset == 'random' else 'prompt set'}; {report.environment.cpu_model}, "
                 f"threads={report.environment.threads}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""`cllm serve` vs llama.cpp's own `llama-server`, same model, same machine, same prompts.

What it does:

1. Builds ``llama-server`` once per machine from the llama.cpp sources vendored in
   the sdist of the pinned llama-cpp-python (``pip download --no-binary :all:``),
   with the CMake options pip used for llama-cpp-python itself (llama.cpp's
   defaults: Release, GGML_NATIVE=ON, GGML_OPENMP=ON, shared libs), so the two
   servers run the same kernels. Cached under ``~/.cache/cllm/llama-server-<ver>/``;
   the flags are recorded in ``build-flags.json`` there and in the JSON report.
2. For each workload, round and server (alternating which goes first), starts
   the server alone on the machine, drives it with ``cllm bench serve`` (same
   random prompts for both servers, ``ignore_eos``), stops it. Every level of a
   workload gets its own prompts (``level_seed``): with one seed for all levels,
   the first half of each level repeated the prompts of the level before, so
   half the requests were prompt-cache hits and TTFT p50 fell on the boundary
   between cached and new prompts instead of measuring either.
3. Prints tok/s, TTFT p50/p99 and ITL p99 side by side with cllm/llama-server
   ratios (medians over rounds), and writes JSON + markdown (+ PNG).

Workloads: (a) ~32-token distinct prompts, 64 tokens out, 1/8/16/32/64 clients;
(b) 128-token prompts, 64 out; (c) churn: 16 tokens out, 64 clients, 8 slots; (d) long prompts:
~1,000 tokens, 64 out, 1/8/16 clients, 2,048 cells per slot (a RAG or long-document chat).

    .venv/bin/python benchmarks/vs_llama_server.py            # full (~15 min on 2 cores)
    .venv/bin/python benchmarks/vs_llama_server.py --quick    # iteration (~4 min)

Both servers get the same model file, threads, slots and context per slot
(``--cllm-defaults`` starts cllm with no thread/slot/context flags instead). It is a
benchmark, not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

import httpx

from cllm.bench.server_process import BenchServer, free_port
from cllm.model_path import cache_root
from cllm.progress import Phase, phase

LLAMA_CPP_PYTHON = "0.3.36"  # the pinned llama-cpp-python (pyproject.toml); its sdist vendors llama.cpp
CACHE = cache_root() / f"llama-server-{LLAMA_CPP_PYTHON}"
# llama-cpp-python's pip build (scikit-build-core, no CMAKE_ARGS) configures llama.cpp with its defaults:
# Release, GGML_NATIVE=ON, GGML_OPENMP=ON, BUILD_SHARED_LIBS=ON. The other flags only drop what a
# headless benchmark build cannot or need not fetch (curl/openssl, the web UI, tests, examples).
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=ON", "-DGGML_OPENMP=ON",
    "-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
]
REPO = Path(__file__).resolve().parent.parent
BUILD_ESTIMATE_S = 15 * 60  # the llama-server target with 2 jobs on the 2-core machines: 10-20 min
_PERCENT = re.compile(r"^\[\s*(\d{1,3})%\]")


@dataclass(slots=True)
class Workload:
    """One traffic shape."""

    name: str  # a | b | c
    title: str  # what it is, for the table
    input_len: int  # prompt tokens
    output_len: int  # generated tokens per request
    clients: list[int]  # concurrency levels
    slots: int  # server sequence slots
    prompts_per_client: float  # requests per level = max(min_prompts, clients * this)
    min_prompts: int = 8  # floor on requests per level
    ctx_per_slot: int | None = None  # KV cells per slot for this workload (None: --ctx-per-slot)


@dataclass(slots=True)
class Point:
    """One server at one workload level in one round."""

    workload: str  # workload name
    clients: int  # concurrency
    server: str  # cllm | llama-server
    round: int  # 0-based round
    tok_s: float  # output tokens per second
    ttft_p50_ms: float | None  # time to first token, median
    ttft_p99_ms: float | None  # time to first token, 99th percentile
    itl_p99_ms: float | None  # inter-token latency, 99th percentile
    failed: int  # failed requests
    loadavg: float  # 1-minute load average after the run (other work on the machine)


@dataclass(slots=True)
class Settings:
    """How both servers are configured."""

    model: str  # GGUF file
    llama_model: str  # the file llama-server loads (--llama-server-model; default: model)
    threads: int  # inference threads for both servers
    ctx_per_slot: int  # KV cells per slot
    cllm_defaults: bool  # start cllm serve without thread / slot flags
    rounds: int  # alternating rounds
    build_flags: list[str] = field(default_factory=list)  # llama-server CMake options
    cllm_weights: str | None = None  # the file cllm serve's llama.cpp ran (GET /v1/engine: llama_cpp.weights)


def workloads(quick: bool) -> list[Workload]:
    if quick:
        return [
            Workload("a", "64 out from ~32-token prompts", 32, 64, [1, 16, 64], 64, 1.0, 4),
            Workload("b", "128-token prompts, 64 out", 128, 64, [16], 16, 1.0, 4),
            Workload("c", "churn: 16 out, 64 clients, 8 slots", 32, 16, [64], 8, 2.0),
            Workload("d", "long prompts: ~1,000 tokens, 64 out", 1000, 64, [1, 8], 16, 1.0, 4, 2048),
        ]
    return [
        Workload("a", "64 out from ~32-token prompts", 32, 64, [1, 8, 16, 32, 64], 64, 2.0),
        Workload("b", "128-token prompts, 64 out", 128, 64, [1, 16], 16, 2.0),
        Workload("c", "churn: 16 out, 64 clients, 8 slots", 32, 16, [64], 8, 3.0),
        Workload("d", "long prompts: ~1,000 tokens, 64 out", 1000, 64, [1, 8, 16], 16, 2.0, 8, 2048),
    ]


# ---- building llama-server ------------------------------------------------------------------


def build_llama_server() -> Path:
    """The cached llama-server binary, building it first if needed (once per machine)."""
    binary = CACHE / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    CACHE.mkdir(parents=True, exist_ok=True)
    sdist = CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.is_file():
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(CACHE)])
    src = CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if not src.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(CACHE, filter="data")
    jobs = str(os.cpu_count() or 2)
    log_path = CACHE / "build.log"
    print(f"building llama-server from {src} (once per machine); compiler output: {log_path}", file=sys.stderr)
    with log_path.open("w") as log_file:
        _run(["cmake", "-S", str(src), "-B", str(CACHE / "build"), *CMAKE_FLAGS], log=log_file)
        # 10-20 min on 2 cores; make's "[ NN%]" lines drive the bar.
        with phase("compiling llama-server", estimate_s=BUILD_ESTIMATE_S / max(1, int(jobs) / 2)) as progress:
            _run(["nice", "-n", "10", "cmake", "--build", str(CACHE / "build"), "--target", "llama-server", "-j", jobs],
                 log=log_file, on_line=lambda line: _build_progress(line, progress))
    (CACHE / "build-flags.json").write_text(json.dumps({"cmake": CMAKE_FLAGS, "source": str(src)}, indent=2))
    return binary


def _run(cmd: list[str], *, log: TextIO | None = None, on_line: Callable[[str], None] | None = None) -> None:
    """Run ``cmd``; with ``log`` its output goes there (each line also to ``on_line``), else to the terminal."""
    print("+ " + " ".join(cmd), file=sys.stderr)
    if log is None:
        subprocess.run(cmd, check=True)
        return
    log.write("+ " + " ".join(cmd) + "\n")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None  # PIPE above
    for line in proc.stdout:
        log.write(line)
        if on_line is not None:
            on_line(line)
    if proc.wait():
        log.flush()
        raise subprocess.CalledProcessError(proc.returncode, cmd, output=f"see {log.name}")


def _build_progress(line: str, progress: Phase) -> None:
    """make's "[ 42%] Building ..." lines: how far the build is."""
    match = _PERCENT.match(line)
    if match:
        progress.update(int(match.group(1)) / 100)


def pip_build_flags() -> dict[str, str]:
    """How pip compiled the installed llama-cpp-python: its CPU features, as llama.cpp reports them."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    return {"llama_cpp_python": llama_cpp.__version__, "system_info": info.strip()}


# ---- servers ----------------------------------------------------------------------------------


def _amx_build() -> bool:
    from cllm.backends.llama_cpp.native import _amx_build as amx

    return amx()


def start_server(name: str, settings: Settings, w: Workload, binary: Path) -> BenchServer:
    port = free_port()
    slots = w.slots
    n_ctx = str(slots * (w.ctx_per_slot or settings.ctx_per_slot))
    if name == "llama-server":
        cmd = [str(binary), "-m", settings.llama_model, "--host", "127.0.0.1", "--port", str(port), "-t", str(settings.threads),
               "-np", str(slots), "-c", n_ctx, "--no-webui", "--log-disable"]
        if _amx_build():
            # As cllm does there (cllm/backends/llama_cpp/native.py): without the extra buffer types
            # (weight repacking into AMX tiles) a multi-token decode crashes llama.cpp on an AMX CPU;
            # both servers then run the same kernels.
            cmd.append("--no-repack")
    else:
        cmd = [sys.executable, "-m", "cllm", "serve", "--model", settings.model, "--port", str(port),
               "--log-level", "warning"]
        if not settings.cllm_defaults:  # defaults: threads, slots and context chosen from the machine
            cmd += ["--n-threads", str(settings.threads), "--n-seq-max", str(slots), "--n-ctx", n_ctx]
    return BenchServer(name, cmd, port)


# ---- driving them ---------------------------------------------------------------------------


def level_seed(w: Workload, clients: int) -> int:
    """The prompt seed of one level: distinct prompts at every level of every workload, the same
    for both servers and in every round (each round starts fresh servers)."""
    return 1000 * (ord(w.name) - ord("a")) + clients


def bench_level(server: BenchServer, w: Workload, clients: int, round_no: int) -> Point:
    """One `cllm bench serve` run against a live server."""
    num = max(w.min_prompts, int(clients * w.prompts_per_client))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "cllm", "bench", "serve", "--base-url", server.url, "--dataset", "random",
               "--input-len", str(w.input_len), "--output-len", str(w.output_len), "--num-prompts", str(num),
               "--concurrency", str(clients), "--seed", str(level_seed(w, clients)), "--warmup", "1", "--no-progress", "--json", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=1800)
        run = json.loads(out.read_text())["runs"][0]["summary"]
    stat = lambda key, q: None if run[key] is None else round(run[key][q], 1)  # noqa: E731
    return Point(w.name, clients, server.name, round_no, round(run["output_throughput"], 1), stat("ttft", "median"),
                 stat("ttft", "p99"), stat("itl", "p99"), run["failed"], round(os.getloadavg()[0], 2))


def run_all(settings: Settings, loads: list[Workload], binary: Path) -> list[Point]:
    points: list[Point] = []
    for w in loads:
        for round_no in range(settings.rounds):
            order = ["llama-server", "cllm"] if round_no % 2 == 0 else ["cllm", "llama-server"]
            for name in order:
                server = start_server(name, settings, w, binary)
                try:
                    if name == "cllm":
                        settings.cllm_weights = httpx.get(server.url + "/v1/engine", timeout=30).json().get("weights")
                    for clients in w.clients:
                        p = bench_level(server, w, clients, round_no)
                        print(f"  ({w.name}) c={clients:<3d} round {round_no} {name:12s} {p.tok_s:7.1f} tok/s  "
                              f"TTFT p50 {p.ttft_p50_ms} ms  ITL p99 {p.itl_p99_ms} ms  load {p.loadavg}", file=sys.stderr)
                        points.append(p)
                finally:
                    server.stop()
    return points


# ---- reporting ------------------------------------------------------------------------------


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 1) if present else None


def summarize(points: list[Point], loads: list[Workload]) -> list[dict[str, object]]:
    """Per workload level: both servers' medians over rounds and the cllm / llama-server ratios."""
    rows = []
    for w in loads:
        for clients in w.clients:
            row: dict[str, object] = {"workload": w.name, "clients": clients, "slots": w.slots}
            for server in ("llama-server", "cllm"):
                mine = [p for p in points if p.workload == w.name and p.clients == clients and p.server == server]
                for metric in ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms"):
                    row[f"{server}:{metric}"] = _median([getattr(p, metric) for p in mine])
                row[f"{server}:failed"] = sum(p.failed for p in mine)
            for metric in ("tok_s", "ttft_p50_ms", "itl_p99_ms"):
                a, b = row[f"cllm:{metric}"], row[f"llama-server:{metric}"]
                row[f"ratio:{metric}"] = round(a / b, 2) if a and b else None
            rows.append(row)
    return rows


def markdown(rows: list[dict[str, object]], loads: list[Workload], header: str) -> str:
    fmt = lambda v: "-" if v is None else f"{v:g}"  # noqa: E731
    out = [header, ""]
    for w in loads:
        out += [f"**({w.name}) {w.title}** — {w.input_len}-token prompts, {w.output_len} out, {w.slots} slots", "",
                "| clients | tok/s llama-server | tok/s cllm | ratio | TTFT p50 ms (llama / cllm) | TTFT p99 ms (llama / cllm) "
                "| ITL p99 ms (llama / cllm) | ITL ratio |",
                "|---|---|---|---|---|---|---|---|"]
        for r in (r for r in rows if r["workload"] == w.name):
            g = lambda k: fmt(r[k])  # noqa: E731
            out.append(f"| {r['clients']} | {g('llama-server:tok_s')} | {g('cllm:tok_s')} | **{g('ratio:tok_s')}** "
                       f"| {g('llama-server:ttft_p50_ms')} / {g('cllm:ttft_p50_ms')} "
                       f"| {g('llama-server:ttft_p99_ms')} / {g('cllm:ttft_p99_ms')} "
                       f"| {g('llama-server:itl_p99_ms')} / {g('cllm:itl_p99_ms')} | {g('ratio:itl_p99_ms')} |")
        out.append("")
    return "\n".join(out)


def plot(rows: list[dict[str, object]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"({r['workload']}) c={r['clients']}" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    x = range(len(rows))
    for i, server in enumerate(("llama-server", "cllm")):
        axes[0].bar([k + (i - 0.5) * 0.4 for k in x], [r[f"{server}:tok_s"] or 0 for r in rows], 0.4,
                    label=server, color=f"C{i}")
        axes[1].bar([k + (i - 0.5) * 0.4 for k in x], [r[f"{server}:itl_p99_ms"] or 0 for r in rows], 0.4,
                    label=server, color=f"C{i}")
    for ax, name in zip(axes, ("output tokens/s (higher is better)", "ITL p99 ms (lower is better)")):
        ax.set_xticks(list(x), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(name)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def default_threads() -> int:
    from cllm.backends.llama_cpp.threads import default_n_threads

    return default_n_threads()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2-135M Q4_1)")
    parser.add_argument("--threads", type=int, default=None, help="threads for both servers (default: cllm's machine default)")
    parser.add_argument("--ctx-per-slot", type=int, default=512, help="KV cells per slot, both servers")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (the order flips each round)")
    parser.add_argument("--quick", action="store_true", help="fewer levels and requests, for iteration")
    parser.add_argument("--workloads", default="abcd", help="which of a, b, c, d to run")
    parser.add_argument("--llama-server-model", default=None,
                        help="the file llama-server loads instead of --model: e.g. the converted copy cllm runs (GET /v1/engine "
                             "'weights'), to compare the servers on equal weights")
    parser.add_argument("--cllm-defaults", action="store_true", help="start cllm serve without thread/slot/context flags")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="where the JSON and markdown go")
    parser.add_argument("--tag", default=None, help="file name tag (default: quick | full)")
    parser.add_argument("--png", type=Path, default=None, help="also write a PNG here (e.g. docs/vs_llama_server.png)")
    args = parser.parse_args()

    from cllm.model_path import resolve_model_path

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the `finally`s stop any live server
    binary = build_llama_server()
    loads = [w for w in workloads(args.quick) if w.name in args.workloads]
    model = str(resolve_model_path(args.model))
    settings = Settings(model=model, llama_model=args.llama_server_model or model, threads=args.threads or default_threads(),
                        ctx_per_slot=args.ctx_per_slot, cllm_defaults=args.cllm_defaults, rounds=args.rounds,
                        build_flags=CMAKE_FLAGS)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    points = run_all(settings, loads, binary)
    rows = summarize(points, loads)
    tag = args.tag or ("quick" if args.quick else "full")
    command = " ".join(["python", "benchmarks/vs_llama_server.py", *sys.argv[1:]])
    header = (f"`{command}` — {started}, {os.cpu_count()} CPUs, threads={settings.threads}, "
              f"ctx/slot={settings.ctx_per_slot}, medians of {settings.rounds} alternating rounds, "
              f"load average at end {os.getloadavg()[0]:.1f} (shared machine); weights run: llama-server "
              f"{Path(settings.llama_model).name}, cllm {Path(settings.cllm_weights or model).name}")
    text = markdown(rows, loads, header)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"vs_llama_server_{tag}.md").write_text(text + "\n")
    meta = {"command": command, "started": started, "settings": asdict(settings), "pip_build": pip_build_flags(),
            "llama_server": str(binary), "loadavg_end": os.getloadavg()}
    (args.out / f"vs_llama_server_{tag}.json").write_text(
        json.dumps({"meta": meta, "summary": rows, "points": [asdict(p) for p in points]}, indent=2) + "\n")
    if args.png:
        plot(rows, args.png, header)


if __name__ == "__main__":
    main()

"""`cllm serve` on a CPU that other processes keep busy: the default thread count against fixed ones and llama-server.

ggml's worker threads spin-wait for each other, so a thread whose core the OS gives
to another process stalls every step: on the 2-core machine beside two busy
processes, one 64-token request took 11.8-25.9 s with 2 threads and 0.88 s with 1
(issue 46). cllm's default adapts the thread count at run time
(cllm/backends/llama_cpp/thread_governor.py); this measures whether that holds.

For each round, each system in turn (the order alternating between rounds) is
started alone, then goes through the conditions in order on the same server —
``alone``, ``busy1``, ``busy2`` (1 and 2 competing ``while True: pass`` processes,
started after the server is ready and killed after the workload), ``alone-again``
(does the default come back up?) — and runs one fixed workload in each: a
warm-up request, ``--sequential`` single requests one after another, then
``--concurrent`` requests at once, each ``--max-tokens`` tokens (ignore_eos).

Systems: ``cllm-default`` (no thread flag), ``cllm-t1`` / ``cllm-t2`` (``--n-threads``),
``llama-server-t2`` (``-t 2``; the binary vs_llama_server.py builds), and with
``--baseline-src DIR`` or ``--baseline-commit REV``, ``cllm-baseline``: the default
of another source tree (PYTHONPATH), e.g. the commit before the change, in the same run.

    # the measurement (machine otherwise quiet; ~30-40 min on 2 cores: 2 spinning threads beside busy processes are slow):
    .venv/bin/python benchmarks/cpu_contention.py --rounds 3 --baseline-commit e33bc7f
    # a smoke run (~3 min):
    .venv/bin/python benchmarks/cpu_contention.py --smoke

Writes ``benchmarks/results/cpu_contention_<tag>.json`` and ``.md``: median workload
seconds per system and condition, cllm-default's ratio to the best fixed thread
count and to llama-server, and the thread count cllm-default ended each condition
with (GET /v1/engine). It is a benchmark, not a test.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from cllm.bench.server_process import BenchServer, free_port
from cllm.stress.cpu_contention import busy_processes

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from vs_llama_server import build_llama_server  # noqa: E402  (the same llama-server build)

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
CONDITIONS = {"alone": 0, "busy1": 1, "busy2": 2, "alone-again": 0}
SYSTEMS = ("cllm-default", "cllm-t1", "cllm-t2", "llama-server-t2")
FIXED = ("cllm-t1", "cllm-t2")


@dataclass(slots=True)
class Sample:
    """One system's workload in one condition of one round."""

    system: str  # cllm-default | cllm-t1 | cllm-t2 | llama-server-t2 | cllm-baseline
    condition: str  # alone | busy1 | busy2 | alone-again
    round: int  # 0-based
    total_s: float  # the whole workload (sequential + concurrent), warm-up excluded
    sequential_s: list[float]  # each single request's seconds
    concurrent_s: float  # the concurrent requests, first sent to last done
    tokens: int  # completion tokens received (should be requests x max_tokens)
    compute_threads: int | None  # cllm: threads at the end of the condition (/v1/engine), else None
    threads_lowered: int | None  # cllm: times its governor took a thread away so far
    loadavg: float  # 1-minute load average after the workload


@dataclass(slots=True)
class Workload:
    sequential: int  # single requests one after another
    concurrent: int  # requests at once
    max_tokens: int  # tokens per request


def server_command(system: str, model: str, port: int, threads_high: int, binary: Path) -> list[str]:
    if system == "llama-server-t2":
        return [str(binary), "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads_high),
                "-np", "4", "-c", "4096", "--no-webui", "--log-disable"]
    cmd = [sys.executable, "-m", "cllm", "serve", "--model", model, "--port", str(port), "--log-level", "warning"]
    if system == "cllm-t1":
        cmd += ["--n-threads", "1"]
    elif system == "cllm-t2":
        cmd += ["--n-threads", str(threads_high)]
    return cmd


@contextmanager
def pythonpath(src: Path | None) -> Iterator[None]:
    """Children started inside import cllm from ``src``: BenchServer's Popen inherits os.environ and the working
    directory, and ``python -m`` puts the working directory first on sys.path, before PYTHONPATH."""
    if src is None:
        yield
        return
    before, cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    os.environ["PYTHONPATH"] = str(src) + (os.pathsep + before if before else "")
    os.chdir(src)
    try:
        yield
    finally:
        os.chdir(cwd)
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def check_baseline(src: Path) -> None:
    """The baseline's children really import cllm from ``src`` (not the installed tree)."""
    with pythonpath(src):
        found = subprocess.run([sys.executable, "-c", "import cllm; print(cllm.__file__)"], check=True,
                               capture_output=True, text=True).stdout.strip()
    if not Path(found).resolve().is_relative_to(src.resolve()):
        raise SystemExit(f"--baseline-src {src}: children import cllm from {found}, not from there")


def export_commit(rev: str, into: Path) -> Path:
    """The source tree of ``rev`` (git archive, no worktree)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev], check=True,
                             capture_output=True).stdout
    into.mkdir(parents=True, exist_ok=True)
    tar_path = into / "src.tar"
    tar_path.write_bytes(archive)
    with tarfile.open(tar_path) as tar:
        tar.extractall(into, filter="data")
    tar_path.unlink()
    return into


async def _one(client: httpx.AsyncClient, model: str, max_tokens: int) -> tuple[float, int]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    resp = await client.post("/v1/completions", json=body)
    if resp.status_code != 200:
        raise RuntimeError(f"{resp.request.url} answered {resp.status_code}: {resp.text[:500]}")
    return time.perf_counter() - start, int(resp.json()["usage"]["completion_tokens"])


async def run_workload(url: str, w: Workload) -> tuple[list[float], float, int]:
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(1800.0)) as client:
        await _one(client, model, w.max_tokens)  # warm-up: the first request of a condition pays no start-up cost
        sequential, tokens = [], 0
        for _ in range(w.sequential):
            seconds, n = await _one(client, model, w.max_tokens)
            sequential.append(seconds)
            tokens += n
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(client, model, w.max_tokens) for _ in range(w.concurrent)))
        concurrent = time.perf_counter() - start
    return sequential, concurrent, tokens + sum(n for _, n in results)


def engine_threads(url: str) -> tuple[int | None, int | None]:
    try:
        stats = httpx.get(url + "/v1/engine", timeout=30).json().get("stats") or {}
    except (httpx.HTTPError, ValueError):
        return None, None
    return stats.get("compute_threads"), stats.get("compute_threads_lowered")


def run_system(system: str, round_no: int, args: argparse.Namespace, binary: Path, baseline: Path | None) -> list[Sample]:
    port = free_port()
    cmd = server_command("cllm-default" if system == "cllm-baseline" else system, args.model, port, args.threads_high, binary)
    with pythonpath(baseline if system == "cllm-baseline" else None):
        server = BenchServer(system, cmd, port)
    samples = []
    try:
        for condition in args.conditions:
            with busy_processes(CONDITIONS[condition], settle_s=0.5):
                sequential, concurrent, tokens = asyncio.run(run_workload(server.url, args.workload))
                threads, lowered = engine_threads(server.url) if system.startswith("cllm") else (None, None)
            s = Sample(system, condition, round_no, round(sum(sequential) + concurrent, 3),
                       [round(x, 3) for x in sequential], round(concurrent, 3), tokens, threads, lowered,
                       round(os.getloadavg()[0], 2))
            print(f"  round {round_no} {system:16s} {condition:12s} {s.total_s:8.2f} s  threads {threads}  "
                  f"load {s.loadavg}", file=sys.stderr)
            samples.append(s)
    finally:
        server.stop()
    return samples


def summarize(samples: list[Sample], systems: list[str], conditions: list[str]) -> list[dict[str, object]]:
    rows = []
    for condition in conditions:
        row: dict[str, object] = {"condition": condition}
        for system in systems:
            totals = [s.total_s for s in samples if s.system == system and s.condition == condition]
            row[system] = round(statistics.median(totals), 3) if totals else None
        default = row.get("cllm-default")
        fixed = [row[f] for f in FIXED if isinstance(row.get(f), float)]
        if isinstance(default, float):
            row["default_vs_best_fixed"] = round(default / min(fixed), 2) if fixed else None
            server = row.get("llama-server-t2")
            row["default_vs_llama_server"] = round(default / server, 2) if isinstance(server, float) else None
            base = row.get("cllm-baseline")
            row["default_vs_baseline"] = round(default / base, 2) if isinstance(base, float) else None
        ends = [s.compute_threads for s in samples if s.system == "cllm-default" and s.condition == condition]
        row["default_threads_at_end"] = ends
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, object]], systems: list[str], header: str) -> str:
    cols = [*systems, "default_vs_best_fixed", "default_vs_llama_server", "default_vs_baseline", "default_threads_at_end"]
    lines = [header, "", "Median workload seconds (lower is better); ratios < 1 favour cllm-default.", "",
             "| condition | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for row in rows:
        cells = ["" if row.get(c) is None else str(row[c]) for c in cols]
        lines.append(f"| {row['condition']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    from cllm.backends.llama_cpp.threads import default_n_threads

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the system order alternates between them")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    p.add_argument("--conditions", default=",".join(CONDITIONS), help=f"in order, of {', '.join(CONDITIONS)}")
    p.add_argument("--sequential", type=int, default=4, help="single requests one after another")
    p.add_argument("--concurrent", type=int, default=4, help="requests at once, after the single ones")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--threads-high", type=int, default=max(2, default_n_threads()),
                   help="the higher fixed count (cllm-t2, llama-server -t); default: the machine's, at least 2")
    p.add_argument("--baseline-src", type=Path, default=None, help="also run cllm's default from this source tree")
    p.add_argument("--baseline-commit", default=None, help="also run cllm's default from this commit (git archive)")
    p.add_argument("--smoke", action="store_true", help="1 round, 1+2 requests of 8 tokens, alone and busy1")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="where JSON and markdown go")
    p.add_argument("--tag", default=None, help="file name tag (default: smoke | full)")
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.sequential, args.concurrent, args.max_tokens = 1, 1, 2, 8
        args.conditions = "alone,busy1"
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    bad = [s for s in args.systems if s not in SYSTEMS] + [c for c in args.conditions if c not in CONDITIONS]
    if bad:
        p.error(f"unknown systems/conditions {bad}: systems are {SYSTEMS}, conditions {tuple(CONDITIONS)}")
    args.workload = Workload(args.sequential, args.concurrent, args.max_tokens)
    args.baseline_src = args.baseline_src.resolve() if args.baseline_src else None
    return args


def main() -> None:
    from cllm.model_path import resolve_model_path

    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the `finally`s stop servers and busy processes
    args.model = str(resolve_model_path(args.model))
    binary = build_llama_server() if "llama-server-t2" in args.systems else Path("llama-server")
    scratch = Path(tempfile.mkdtemp(prefix="cllm-baseline-"))
    try:
        baseline = args.baseline_src or (export_commit(args.baseline_commit, scratch) if args.baseline_commit else None)
        systems = list(args.systems)
        if baseline is not None:
            check_baseline(baseline)
            systems.append("cllm-baseline")
        started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        samples: list[Sample] = []
        for round_no in range(args.rounds):
            for system in (systems if round_no % 2 == 0 else systems[::-1]):
                samples += run_system(system, round_no, args, binary, baseline)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = summarize(samples, systems, args.conditions)
    tag = args.tag or ("smoke" if args.smoke else "full")
    command = " ".join(["python", "benchmarks/cpu_contention.py", *sys.argv[1:]])
    w = args.workload
    header = (f"`{command}` — {started}, {os.cpu_count()} CPUs, workload: {w.sequential} single + {w.concurrent} "
              f"concurrent requests of {w.max_tokens} tokens, medians of {args.rounds} rounds"
              + (f", baseline {args.baseline_commit or args.baseline_src}" if baseline is not None else ""))
    text = markdown(rows, systems, header)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"cpu_contention_{tag}.md").write_text(text + "\n")
    meta = {"command": command, "started": started, "model": args.model, "threads_high": args.threads_high,
            "workload": asdict(w), "llama_server": str(binary), "baseline": str(args.baseline_commit or args.baseline_src)}
    (args.out / f"cpu_contention_{tag}.json").write_text(
        json.dumps({"meta": meta, "summary": rows, "samples": [asdict(s) for s in samples]}, indent=2) + "\n")


if __name__ == "__main__":
    main()

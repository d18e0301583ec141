"""Everything but the forward pass: the engine's CPU time per step and the server's CPU time per
streamed token, over a backend whose forward costs nothing (cllm.bench.null_backend).

On a GPU a decode step of a 1B model takes 2-5 ms, so whatever the engine and the server spend per
step and per token is what keeps a server from its forward pass's speed. This measures that on any
machine, without a GPU:

- engine: an ``LLMEngine`` over a ``NullBackend`` with B = 1, 64, 256 running sequences (prompts of
  ``--prompt-len`` tokens, prefilled first), then ``--repeats`` runs of ``--steps`` decode steps timed
  with the engine thread's CPU clock: the median ms per step (schedule, sample, update, outputs).
- server: ``python -m cllm.bench.null_server`` (the real server: HTTP, SSE, engine thread) with B
  concurrent streamed ``/v1/completions`` from client processes (raw asyncio sockets, so they cost
  little); the server process's CPU time (from /proc, per thread) divided by the tokens streamed:
  µs per token, split by thread (engine thread, event loop, the rest).

Both with greedy and with temperature/top-p sampling. The null backend's vocabulary is ``--vocab``
(1,024 by default): the sampler's own kernels over a real vocabulary run on the device on a GPU, and
what is measured here is the Python around them.

    .venv/bin/python benchmarks/engine_overhead.py [--json FILE] [--levels 1 64 256]

Targets (issue 28, 2-core machine): engine <= 1.5 ms per step at 256 sequences, server <= 40 µs of
CPU per streamed token.

With ``--step-ms MS`` it is instead a CPU proxy of a GPU server: every forward waits MS (plus
``--token-us`` per token) with the GIL released, as a CUDA step does, and at each level it reports
the served output tok/s (closed-loop streams, greedy) against the engine's own (``LLMEngine.step``
over the same prompts, no server) at the same simulated step: the served/engine ratio is what a GPU
server keeps of its engine. Pick MS so that the engine-bound rate leaves the 2 cores room for the
clients (5-10 ms), e.g.

    .venv/bin/python benchmarks/engine_overhead.py --step-ms 8 --tokens 128 --rounds 3

With ``--device-ms D`` the device is *asynchronous* (issue 41): a forward is launched and completes D ms
later on its own (NullBackend's simulated device), and the host waits only when it reads the sampled ids,
as it does for CUDA. At each level and sampling mode it reports the engine's wall ms per decode step
against D, against the host's own time per step (the engine thread's CPU time) and against their sum,
with the one-step lookahead off (today's order: the calibration, step = host + D) and on (step =
max(host, D) when the overlap works); then the served output tok/s (the null server with the same device,
closed-loop streams, each sampling mode; ``served`` keys ``B/lookahead_X`` for greedy, ``top_p/B/...``)
against ``1000 x B / max(host, D)``, lookahead off and on. E.g.

    .venv/bin/python benchmarks/engine_overhead.py --device-ms 5 --json results.json

A closed-loop run of a few rounds pays for its start and end: every stream's first request arrives at
once (at 256 streams the API process admits them over ~0.3 s, during which few slots run) and the last
round drains unevenly. ``--steady`` adds, per level, a second run of 4x the rounds and reports the
difference of the two (extra tokens over extra wall time): the rate once the streams run, which a
long-lived server sees.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

try:
    import uvloop
except ImportError:
    uvloop = None

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import cllm  # noqa: E402
from cllm.bench.null_backend import NullBackend  # noqa: E402
from cllm.config import load_config  # noqa: E402
from cllm.engine.llm_engine import LLMEngine  # noqa: E402

MODES = {"greedy": dict(temperature=0.0), "top_p": dict(temperature=0.8, top_p=0.95, seed=1)}
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------------------ engine
def engine_ms_per_step(batch: int, mode: str, args: argparse.Namespace) -> float:
    """The engine thread's CPU ms per decode step with ``batch`` sequences running."""
    backend = NullBackend(slots=batch, vocab_size=args.vocab, device=args.device)
    return timed_decode_steps(backend, batch, mode, args)["host_ms"]


def timed_decode_steps(backend: NullBackend, batch: int, mode: str, args: argparse.Namespace,
                       **settings: object) -> dict[str, float]:
    """Wall ms and the engine thread's CPU ms per decode step with ``batch`` sequences running, after
    their prompts: the medians over ``--repeats`` runs of ``--steps`` steps (this VM's neighbours move
    single runs by 10 %)."""
    config = load_config(None, environ={}, n_seq_max=batch, max_waiting=4096, **settings)
    engine = LLMEngine(config, backend=backend)
    params = cllm.SamplingParams(max_tokens=args.repeats * args.steps + 64, ignore_eos=True, **MODES[mode])
    for i in range(batch):
        engine.add_request([300 + (i + j) % 500 for j in range(args.prompt_len)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()) \
            or engine.scheduler.num_waiting:
        engine.step()
    for _ in range(8):  # warm
        engine.step()
    walls, hosts = [], []
    for _ in range(args.repeats):
        w0, h0 = time.perf_counter(), time.thread_time()
        for _ in range(args.steps):
            engine.step()
        walls.append(1000 * (time.perf_counter() - w0) / args.steps)
        hosts.append(1000 * (time.thread_time() - h0) / args.steps)
    engine.close()
    return {"step_ms": statistics.median(walls), "host_ms": statistics.median(hosts)}


# ------------------------------------------------------------------------------------------ server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of ``pid``'s threads by role: the engine thread (it names itself cllm-engine), the
    event loop (the main thread) and the rest (tokeniser threads, uvicorn's); and of its child
    processes (the engine core's process, server.engine_process=on) as ``engine_core``."""
    out = _process_cpu(pid)
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        for seconds in _process_cpu(int(child)).values():
            out["engine_core"] = out.get("engine_core", 0.0) + seconds
    return out


def _process_cpu(pid: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        seconds = (int(fields[11]) + int(fields[12])) / CLK_TCK
        role = "engine" if name.startswith("cllm-engine") else "event_loop" if int(task.name) == pid else "other"
        out[role] = out.get(role, 0.0) + seconds
    return out


STEADY_ROUNDS = 4  # --steady: the second run's rounds, as a multiple of the first's
_END = b"\r\n0\r\n\r\n"  # the last chunk of a chunked response (SSE bytes never hold a bare CR)


async def _stream(port: int, body: bytes, conn: list | None = None) -> tuple[int, float]:
    """One streamed completion over a raw socket; its completion tokens (from the usage chunk) and its
    time to the first SSE event, from before connecting. With ``conn`` (a holder for a kept-alive
    connection, as an HTTP client's pool keeps one), the connection is reused from one request to the next."""
    started = time.perf_counter()
    first = None
    if conn:
        reader, writer = conn
    else:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        if conn is not None:
            conn[:] = [reader, writer]
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: "
                 + (b"keep-alive" if conn is not None else b"close") + b"\r\n\r\n" + body)
    await writer.drain()
    tail = b""
    while chunk := await reader.read(1 << 16):
        tail = (tail + chunk)[-4096:]
        if first is None and b"data: " in tail:
            first = time.perf_counter() - started
        if conn is not None and tail.endswith(_END):
            break
    if conn is None or not tail.endswith(_END):
        writer.close()
        if conn is not None:
            conn.clear()
    marker = tail.rfind(b'"completion_tokens":')
    if marker < 0:
        raise RuntimeError(f"no usage in the stream's end: {tail[-300:]!r}")
    digits = tail[marker + 20:].split(b",")[0].split(b"}")[0]
    return int(digits), first if first is not None else time.perf_counter() - started


def _client(port: int, streams: int, repeats: int, body: bytes, results: "mp.Queue[tuple[int, list[float]]]",
            keep_alive: bool = False) -> None:
    async def closed_loop() -> list[tuple[int, float]]:
        conn: list | None = [] if keep_alive else None
        done = [await _stream(port, body, conn) for _ in range(repeats)]
        if conn:
            conn[1].close()
        return done

    async def run() -> tuple[int, list[float]]:
        done = [r for loop in await asyncio.gather(*(closed_loop() for _ in range(streams))) for r in loop]
        return sum(tokens for tokens, _ in done), [ttft for _, ttft in done]
    # uvloop where installed: about half the client CPU of asyncio's loop (the 2 cores are shared with the server)
    results.put(uvloop.run(run()) if uvloop is not None else asyncio.run(run()))


def server_us_per_token(port: int, pid: int, batch: int, mode: str, args: argparse.Namespace) -> dict[str, float]:
    """Server CPU µs per streamed token with ``batch`` concurrent streams, in total and by thread;
    and the streamed tokens and output tok/s (wall)."""
    body = json.dumps({"prompt": [300 + j % 500 for j in range(args.prompt_len)], "max_tokens": args.tokens,
                       "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True},
                       **MODES[mode]}).encode()
    procs_n = min(args.client_procs, batch)
    per = [batch // procs_n + (1 if i < batch % procs_n else 0) for i in range(procs_n)]
    results: mp.Queue[tuple[int, list[float]]] = mp.Queue()
    before = _thread_cpu(pid)
    clients_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    procs = [mp.Process(target=_client, args=(port, n, _rounds(batch, args), body, results, args.keep_alive))
             for n in per]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    answers = [results.get(timeout=600) for _ in procs]
    wall = time.perf_counter() - t0
    tokens = sum(n for n, _ in answers)
    ttfts = sorted(t for _, times in answers for t in times)
    for p in procs:
        p.join()
    after = _thread_cpu(pid)
    split: dict[str, float] = {}
    for role, sec in after.items():
        used = sec - before.get(role, 0.0)
        if used > 0:
            split[role] = used * 1e6 / tokens
    split["total"] = sum(split.values())
    clients_after = resource.getrusage(resource.RUSAGE_CHILDREN)  # (the client processes, joined above)
    split["clients"] = 1e6 * (clients_after.ru_utime + clients_after.ru_stime - clients_before.ru_utime
                              - clients_before.ru_stime) / tokens
    split["tokens"] = tokens
    split["tok_s"] = tokens / wall
    split["ttft_p50_ms"] = 1000 * ttfts[len(ttfts) // 2]  # each request's, from before it connected
    split["ttft_p90_ms"] = 1000 * ttfts[len(ttfts) * 9 // 10]
    return split


def _cpu_text(served: dict[str, float]) -> str:
    """The server's CPU per streamed token, by thread, as the reports print it."""
    return (f"server CPU {served['total']:.1f} µs/token: engine thread {served.get('engine', 0):.1f}, event loop "
            f"{served.get('event_loop', 0):.1f}, engine process {served.get('engine_core', 0):.1f}")


def _rounds(batch: int, args: argparse.Namespace) -> int:
    """Requests each closed-loop stream sends: ``--rounds``, else enough tokens for the CPU clock's 10 ms ticks."""
    return args.rounds or max(1, -(-args.min_tokens // (batch * args.tokens)))


# -------------------------------------------------------------- asynchronous device proxy (--device-ms)
def proxy_engine_step(batch: int, mode: str, lookahead: str, args: argparse.Namespace) -> dict[str, float]:
    """:func:`timed_decode_steps` on the asynchronous simulated device."""
    backend = NullBackend(slots=batch, vocab_size=args.vocab, device="torch", device_ms=args.device_ms,
                          token_us=args.token_us)
    return timed_decode_steps(backend, batch, mode, args, lookahead=lookahead)


def device_proxy(args: argparse.Namespace) -> dict[str, dict]:
    """The asynchronous-device proxy's tables (see the module docstring)."""
    import torch

    torch.set_num_threads(1)  # the sampler's math stands for device work (as in the null server)
    d = args.device_ms
    out: dict[str, dict] = {"step_ms": {}, "host_ms": {}, "device_ms": d, "served": {}}
    for mode in args.modes:
        for b in args.levels:
            for lookahead in ("off", "on"):
                r = proxy_engine_step(b, mode, lookahead, args)
                key = f"{mode}/{b}/lookahead_{lookahead}"
                out["step_ms"][key], out["host_ms"][key] = round(r["step_ms"], 3), round(r["host_ms"], 3)
                step, host = r["step_ms"], r["host_ms"]
                print(f"engine {mode:6s} B={b:<4d} lookahead {lookahead:3s}  step {step:6.2f} ms  host {host:5.2f} ms  "
                      f"device {d:g} ms   step/max {step / max(host, d):.3f}  step/sum {step / (host + d):.3f}", flush=True)
    if args.skip_server:
        return out
    for lookahead in ("off", "on"):
        proc, port = start_null_server(args, max(args.levels), ["--device-ms", str(d), f"--set=lookahead={lookahead}"])
        try:
            out["core_realtime"] = _core_realtime(proc.pid)
            for mode, b in ((mode, b) for mode in args.modes for b in args.levels):
                served = server_us_per_token(port, proc.pid, b, mode, args)
                host = out["host_ms"][f"{mode}/{b}/lookahead_{lookahead}"]
                bound = 1000 * b / max(host, d)
                key = f"{b}/lookahead_{lookahead}" if mode == "greedy" else f"{mode}/{b}/lookahead_{lookahead}"
                out["served"][key] = {
                    "tok_s": round(served["tok_s"], 1), "bound_tok_s": round(bound, 1),
                    "ratio": round(served["tok_s"] / bound, 3), "server_us_per_token": round(served["total"], 1),
                    "engine_thread_us": round(served.get("engine", 0), 1), "event_loop_us": round(served.get("event_loop", 0), 1),
                    "other_us": round(served.get("other", 0), 1), "engine_core_us": round(served.get("engine_core", 0), 1),
                    "clients_us": round(served["clients"], 1),
                    "ttft_p50_ms": round(served["ttft_p50_ms"], 1), "ttft_p90_ms": round(served["ttft_p90_ms"], 1),
                    "machine_cores_busy": round((served["total"] + served["clients"]) * served["tok_s"] / 1e6, 2)}
                print(f"served {mode:6s} B={b:<4d} lookahead {lookahead:3s}  {served['tok_s']:9,.0f} tok/s  = "
                      f"{served['tok_s'] / bound:.3f} x 1000 x B / max(host, device)  ({_cpu_text(served)}; clients "
                      f"{served['clients']:.1f} µs/token; {out['served'][key]['machine_cores_busy']:.2f} "
                      f"cores busy; TTFT p50 {served['ttft_p50_ms']:.0f} ms, p90 {served['ttft_p90_ms']:.0f})", flush=True)
                if args.steady:
                    steady = steady_tok_s(served, port, proc.pid, b, mode, args)
                    out["served"][key].update(steady_tok_s=round(steady, 1), steady_ratio=round(steady / bound, 3))
                    print(f"served {mode:6s} B={b:<4d} lookahead {lookahead:3s}  {steady:9,.0f} tok/s steady (without the opening "
                          f"burst and the last round's drain) = {steady / bound:.3f} x 1000 x B / max(host, device)", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return out


def _core_realtime(pid: int) -> bool | None:
    """Whether the engine core (``pid``'s child process) runs its loop at real-time priority
    (server.core_realtime); None without a core process."""
    cores = [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
             if Path(f"/proc/{k}/comm").read_text().strip() == "cllm-core"]  # (not the resource tracker)
    if not cores:
        return None
    policy = os.sched_getscheduler(cores[0]) & ~os.SCHED_RESET_ON_FORK
    print(f"engine core loop: {'real-time (SCHED_FIFO)' if policy == os.SCHED_FIFO else 'ordinary'} priority", flush=True)
    return policy == os.SCHED_FIFO


def steady_tok_s(served: dict[str, float], port: int, pid: int, batch: int, mode: str, args: argparse.Namespace) -> float:
    """The closed loops' steady output tok/s: a second run of ``STEADY_ROUNDS`` times the rounds of ``served``'s,
    and the difference of the two in tokens over the difference in wall time. Both runs pay once for what is
    not steady (the clients' start, every stream's first request arriving at once, the last round draining
    unevenly), so the difference is what the extra rounds cost."""
    longer = argparse.Namespace(**{**vars(args), "rounds": STEADY_ROUNDS * _rounds(batch, args)})
    long = server_us_per_token(port, pid, batch, mode, longer)
    extra_wall = long["tokens"] / long["tok_s"] - served["tokens"] / served["tok_s"]
    return (long["tokens"] - served["tokens"]) / extra_wall


# ------------------------------------------------------------------------------ GPU proxy (--step-ms)
def engine_tok_s(batch: int, args: argparse.Namespace) -> float:
    """Output tok/s of the engine alone at the simulated step: the same rounds of ``batch`` greedy
    prompts as the served streams, each round added at once and stepped to the end (LLM.generate's loop)."""
    backend = NullBackend(slots=batch, vocab_size=args.vocab, device=args.device, step_ms=args.step_ms,
                          token_us=args.token_us)
    engine = LLMEngine(load_config(None, environ={}, n_seq_max=batch, max_waiting=4096), backend=backend)
    params = cllm.SamplingParams(max_tokens=args.tokens, ignore_eos=True, **MODES["greedy"])
    rounds = _rounds(batch, args)
    t0 = time.perf_counter()
    for _ in range(rounds):
        for _ in range(batch):
            engine.add_request([300 + j % 500 for j in range(args.prompt_len)], params)
        while engine.has_unfinished():
            engine.step()
    wall = time.perf_counter() - t0
    engine.close()
    return rounds * batch * args.tokens / wall  # ignore_eos: every request runs to max_tokens


def gpu_proxy(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """{level: engine tok/s, served tok/s, ratio, server µs/token} at the simulated step time."""
    out: dict[str, dict[str, float]] = {}
    proc, port = start_null_server(args, max(args.levels))
    try:
        for b in args.levels:
            served = server_us_per_token(port, proc.pid, b, "greedy", args)
            engine = engine_tok_s(b, args)
            out[str(b)] = {"engine_tok_s": round(engine, 1), "served_tok_s": round(served["tok_s"], 1),
                           "ratio": round(served["tok_s"] / engine, 3), "server_us_per_token": round(served["total"], 1),
                           "engine_thread_us": round(served.get("engine", 0), 1),
                           "event_loop_us": round(served.get("event_loop", 0), 1),
                           "engine_core_us": round(served.get("engine_core", 0), 1)}
            r = out[str(b)]
            print(f"proxy step {args.step_ms:g} ms  B={b:<4d} engine {r['engine_tok_s']:9,.0f} tok/s  served "
                  f"{r['served_tok_s']:9,.0f} tok/s  = {100 * r['ratio']:.0f} %   ({_cpu_text(served)})", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return out


def start_null_server(args: argparse.Namespace, slots: int, extra: Sequence[str] = ()) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    device = "torch" if args.device_ms else args.device
    proc = subprocess.Popen([sys.executable, "-m", "cllm.bench.null_server", "--port", str(port), "--slots", str(slots),
                             "--vocab", str(args.vocab), "--device", device, "--step-ms", str(args.step_ms),
                             "--token-us", str(args.token_us), *(f"--set={kv}" for kv in args.set), *extra], cwd=ROOT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                if b" 200 " in s.recv(1024):
                    return proc, port
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the null server did not become ready in 60 s")


def main() -> None:
    parser = argparse.ArgumentParser(description="engine and server overhead over a zero-cost backend")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--device", choices=("numpy", "torch"), default="numpy",
                        help="logits as numpy (numpy sampler) or torch CPU tensors (the torch sampler)")
    parser.add_argument("--prompt-len", type=int, default=150)
    parser.add_argument("--steps", type=int, default=300, help="timed engine steps per level and run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per level (their median is reported)")
    parser.add_argument("--tokens", type=int, default=256, help="max_tokens of each streamed request")
    parser.add_argument("--client-procs", type=int, default=2)
    parser.add_argument("--min-tokens", type=int, default=32768, help="tokens streamed per level at least (closed loops)")
    parser.add_argument("--rounds", type=int, default=0, help="requests per closed-loop stream (0: from --min-tokens)")
    parser.add_argument("--keep-alive", action="store_true",
                        help="each closed-loop stream keeps its connection for its next request (as an HTTP client's "
                             "pool does) instead of a connection per request")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="GPU proxy: simulated device ms per forward (GIL released); reports served vs engine tok/s")
    parser.add_argument("--token-us", type=float, default=0.0, help="GPU proxy: simulated device µs per token of a forward")
    parser.add_argument("--device-ms", type=float, default=0.0,
                        help="asynchronous device proxy: each forward completes this many ms after its launch; "
                             "reports step vs host vs device, lookahead off and on")
    parser.add_argument("--steady", action="store_true",
                        help="--device-ms: also the served steady rate (a second run of 4x the rounds; the difference)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="the null server's config override")
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    result: dict[str, dict] = {"engine_ms_per_step": {}, "server_us_per_token": {}, "by_mode": {},
                               "settings": {k: str(v) for k, v in vars(args).items()}}
    if args.device_ms > 0:
        result.update(device_proxy(args))
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        return
    if args.step_ms > 0:
        result["gpu_proxy"] = gpu_proxy(args)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        return
    for mode in args.modes:
        eng = {str(b): round(engine_ms_per_step(b, mode, args), 4) for b in args.levels}
        result["by_mode"].setdefault(mode, {})["engine_ms_per_step"] = eng
        print(f"engine  {mode:6s} ms/step   " + "  ".join(f"B={b}: {v:.3f}" for b, v in eng.items()), flush=True)
    if not args.skip_server:
        proc, port = start_null_server(args, max(args.levels))
        try:
            for mode in args.modes:
                srv = {}
                for b in args.levels:
                    srv[str(b)] = {k: round(v, 2) for k, v in server_us_per_token(port, proc.pid, b, mode, args).items()}
                    s = srv[str(b)]
                    print(f"server  {mode:6s} B={b:<4d} µs/token total {s['total']:.1f}  engine {s.get('engine', 0):.1f}  "
                          f"event loop {s.get('event_loop', 0):.1f}  other {s.get('other', 0):.1f}  ({int(s['tokens'])} tokens)",
                          flush=True)
                result["by_mode"][mode]["server_us_per_token"] = srv
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    greedy = result["by_mode"].get("greedy", {})
    result["engine_ms_per_step"] = greedy.get("engine_ms_per_step", {})
    result["server_us_per_token"] = {b: v["total"] for b, v in greedy.get("server_us_per_token", {}).items()}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("engine_ms_per_step", "server_us_per_token")}))


if __name__ == "__main__":
    main()

"""Serving at the speed of the forward pass, on a GPU: one table, in one device call (< 6 minutes).

Builds a random-weight model of the Llama-3.2-1B architecture (bfloat16, vocabulary 49,152 so the
embedded model's tokenizer, given with ``--tokenizer``, decodes every id), then measures output
tokens/s at 1, 64 and 256 concurrent sequences three ways:

1. raw forward: a ``TorchBackend`` alone, greedy decode steps with the pick on the device
   (``benchmarks/gpu_decode.py``'s loop);
2. engine: ``cllm.LLM(backend="torch").generate`` of 64 / 256 prompts, after one warm call: the median of
   ENGINE_REPEATS timed calls (one call swung +-8 points of the raw forward between device calls);
3. server: ``cllm serve --backend torch`` on its defaults (on CUDA: the engine core in a process of its
   own, server.engine_process auto; ``--smoke`` on the CPU forces it on, so the same path runs), streamed ``/v1/completions`` (``ignore_eos``,
   ~150-token prompts, greedy) from ``--client-procs`` client processes (raw asyncio sockets), closed
   loops of 1 / 64 / 256 streams; tokens counted from ``usage``.

And: one stream's inter-token latency against the raw step, TTFT of the first 256-stream burst after
``/health`` said ready against a later (warmed) burst's, failed requests (non-200, in-band errors,
a missing usage chunk) over every request sent (> 2,000).

Targets (issue 28): server >= 70 % of the raw forward at 64 and 256, engine >= 85 %; ITL p50 <= 1.15 x
the raw step; first-burst TTFT <= 2 x warmed; zero failures.

    PYTHONPATH=.site:. python benchmarks/gpu_serve.py --tokenizer .tok --json gpu_serve.json

(``../shared/GPU-MACHINE.md``: the wheels a bare GPU image lacks, and how the tokenizer was saved.)
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing as mp
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gpu_decode import SHAPES, build_model, cllm_backend, cllm_decode  # noqa: E402

LEVELS = (1, 64, 256)
ENGINE_REPEATS = 3  # timed LLM.generate calls per level (their median is reported)
VOCAB = 49152
# --smoke: the same plumbing on the CPU with a 2-layer model and small loads (a check of the script itself)
SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=True, rope_theta=10000.0)


# ----------------------------------------------------------------------------------- raw forward
def raw_forward(model_dir: Path, args: argparse.Namespace) -> dict[int, tuple[float, float]]:
    """{batch: (tok/s, ms per step)} of pure decode steps on the backend alone."""
    ns = argparse.Namespace(prompt_len=args.prompt_len, steps=args.raw_steps, warmup=4, device=args.device,
                            dtype="bfloat16" if args.device == "cuda" else "float32", threads=None)
    backend = cllm_backend(model_dir, max(LEVELS), args.prompt_len + args.raw_steps + 16, ns)
    try:
        return {b: cllm_decode(backend, b, ns) for b in LEVELS}
    finally:
        backend.close()
        _free_device_memory()


def _free_device_memory() -> None:
    """After a backend closed: what it held back to the device, before the next one sizes its KV pool."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------- engine
def engine_offline(model_dir: Path, args: argparse.Namespace) -> dict[int, float]:
    """{batch: output tok/s} of LLM.generate over ``batch`` prompts (after a warm call of the same shape)."""
    import cllm

    llm = cllm.LLM(model=str(model_dir), backend="torch")
    out: dict[int, float] = {}
    try:
        for b in LEVELS[1:]:
            prompts = [_prompt_ids(i, args.prompt_len) for i in range(b)]
            params = cllm.SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
            llm.generate(prompts, cllm.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
            rates = []
            for _ in range(ENGINE_REPEATS):
                t0 = time.perf_counter()
                results = llm.generate(prompts, params)
                wall = time.perf_counter() - t0
                bad = [r for r in results if r.outputs[0].finish_reason != "length"]
                if bad:
                    raise RuntimeError(f"engine run: {len(bad)} requests ended {bad[0].outputs[0].finish_reason}: {bad[0].error}")
                rates.append(sum(len(r.outputs[0].token_ids) for r in results) / wall)
            out[b] = statistics.median(rates)
            if args.py_spy and b == LEVELS[-1]:  # a profiled run after the measured ones
                profile = _Profile(args.py_spy, f"engine_{b}", os.getpid(), 4)
                llm.generate(prompts, params)
                profile.wait()
    finally:
        llm.close()
        _free_device_memory()
    return out


class _Profile:
    """``py-spy record`` of a process for a while, in the background (``--py-spy DIR``): raw stacks."""

    def __init__(self, directory: Path | None, name: str, pid: int, seconds: float) -> None:
        self.proc = None
        if directory is not None and shutil.which("py-spy"):
            directory.mkdir(parents=True, exist_ok=True)
            self.proc = subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--subprocesses", "--threads", "--duration", str(int(seconds)),
                                          "--rate", "200", "--format", "raw", "--output", str(directory / f"{name}.txt")],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)  # attached before the work starts

    def wait(self) -> None:
        if self.proc is not None:
            self.proc.wait(timeout=120)


def _prompt_ids(i: int, n: int) -> list[int]:
    return [1000 + (i * 7919 + j * 31) % 40000 for j in range(n)]


# ----------------------------------------------------------------------------------- client
async def _stream(port: int, body: bytes) -> dict:
    """One streamed request; its timings, tokens and status."""
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    await writer.drain()
    arrivals: list[float] = []
    head = b""
    tail = b""
    while chunk := await reader.read(1 << 16):
        now = time.perf_counter()
        if not head:
            head = chunk[:64]
        if b'"text":"' in chunk:  # an event with text (several, when they came together)
            arrivals.append(now)
        tail = (tail + chunk)[-8192:]
    writer.close()
    ok = head.startswith(b"HTTP/1.1 200") and b'"finish_reason":"error"' not in tail and b'"error"' not in tail
    marker = tail.rfind(b'"completion_tokens":')
    tokens = int(tail[marker + 20:].split(b",")[0].split(b"}")[0]) if marker >= 0 else 0
    ok = ok and marker >= 0
    return {"ok": ok, "start": t0, "arrivals": arrivals, "end": time.perf_counter(), "tokens": tokens,
            "error": None if ok else (head + b" ... " + tail[-300:]).decode(errors="replace")}


def _client(port: int, streams: int, per_stream: int, body: bytes, results: "mp.Queue[list[dict]]") -> None:
    async def worker() -> list[dict]:
        return [await _stream(port, body) for _ in range(per_stream)]

    async def run() -> list[dict]:
        done = await asyncio.gather(*(worker() for _ in range(streams)))
        return [r for rs in done for r in rs]
    results.put(asyncio.run(run()))


def drive(port: int, streams: int, per_stream: int, tokens: int, args: argparse.Namespace) -> dict:
    """``streams`` closed-loop streams of ``per_stream`` requests each, from several processes."""
    body = json.dumps({"model": "m", "prompt": _prompt_ids(streams, args.prompt_len), "max_tokens": tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    procs_n = min(args.client_procs, streams)
    share = [streams // procs_n + (1 if i < streams % procs_n else 0) for i in range(procs_n)]
    queue: mp.Queue = mp.Queue()
    t0 = time.perf_counter()
    procs = [mp.Process(target=_client, args=(port, n, per_stream, body, queue)) for n in share]
    for p in procs:
        p.start()
    rows = [r for _ in procs for r in queue.get(timeout=600)]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    good = [r for r in rows if r["ok"]]
    ttft = [r["arrivals"][0] - r["start"] for r in good if r["arrivals"]]
    gaps = [b - a for r in good for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    per_req_itl = [(r["arrivals"][-1] - r["arrivals"][0]) / (r["tokens"] - 1) for r in good
                   if len(r["arrivals"]) > 1 and r["tokens"] > 1]
    return {"requests": len(rows), "failed": len(rows) - len(good), "errors": [r["error"] for r in rows if not r["ok"]][:3],
            "tok_s": sum(r["tokens"] for r in good) / wall, "wall_s": wall,
            "ttft_p50_ms": 1000 * statistics.median(ttft) if ttft else None,
            "itl_p50_ms": 1000 * statistics.median(per_req_itl) if per_req_itl else None,
            "gap_p50_ms": 1000 * statistics.median(gaps) if gaps else None,
            "gap_p99_ms": 1000 * sorted(gaps)[int(0.99 * (len(gaps) - 1))] if gaps else None}


def serve(model_dir: Path, args: argparse.Namespace) -> dict:
    port = _free_port()
    log = open(args.workdir / "server.log", "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "cllm", "serve", "--backend", "torch", "--model", str(model_dir),
                             "--port", str(port), "--served-model-name", "m", *args.serve_args],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(port, proc, 300)
        ready_s = time.perf_counter() - t0
        out = {"ready_s": ready_s, "engine": _ready_line(args.workdir / "server.log", "engine    :")}
        print(f"server ready: engine in {out['engine']}", flush=True)
        top = LEVELS[-1]
        out["first_burst"] = drive(port, top, 1, 64, args)
        out[LEVELS[0]] = drive(port, LEVELS[0], 3, args.itl_tokens, args)
        out[LEVELS[1]] = drive(port, LEVELS[1], 4, args.tokens, args)
        out[top] = drive(port, top, 5, args.tokens, args)
        out["warm_burst"] = drive(port, top, 1, 64, args)
        if args.py_spy:  # profiled runs after the measured ones: the API process and the engine core's
            for level, per_stream, seconds in ((LEVELS[1], 8, 4), (top, 5, 7)):
                profile = _Profile(args.py_spy, f"server_{level}", proc.pid, seconds)
                out[f"profiled_{level}"] = drive(port, level, per_stream, args.tokens, args)
                profile.wait()
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _ready_line(log: Path, label: str) -> str:
    """What the server's ready block says after ``label`` (e.g. where its engine runs)."""
    for line in log.read_text(errors="replace").splitlines():
        if line.strip().startswith(label.strip()):
            return line.split(":", 1)[1].strip()
    return "?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                if b" 200 " in s.recv(1024):
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"the server was not ready in {timeout} s")


# ----------------------------------------------------------------------------------- report
def report(raw: dict, engine: dict, server: dict) -> str:
    def pct(a: float | None, b: float) -> str:
        return "-" if a is None else f"{a:,.0f} ({100 * a / b:.0f} %)"
    lines = [f"{'':34s}" + "".join(f"{b:>22d}" for b in LEVELS),
             f"{'raw forward tok/s (ms/step)':34s}" + "".join(f"{f'{raw[b][0]:,.0f} ({raw[b][1]:.2f})':>22s}" for b in LEVELS),
             f"{'engine LLM.generate tok/s (%)':34s}" + "".join(f"{pct(engine.get(b), raw[b][0]):>22s}" for b in LEVELS),
             f"{'cllm serve tok/s (%)':34s}" + "".join(f"{pct(server[b]['tok_s'], raw[b][0]):>22s}" for b in LEVELS)]
    one = server[1]
    lines.append(f"one stream: ITL p50 {one['itl_p50_ms']:.2f} ms = {one['itl_p50_ms'] / raw[1][1]:.2f} x the raw step "
                 f"({raw[1][1]:.2f} ms); chunk gap p50 {one['gap_p50_ms']:.2f} / p99 {one['gap_p99_ms']:.2f} ms")
    for b in LEVELS[1:]:
        s = server[b]
        lines.append(f"{b} streams: TTFT p50 {s['ttft_p50_ms']:.0f} ms, chunk gap p50 {s['gap_p50_ms']:.2f} / p99 {s['gap_p99_ms']:.2f} ms")
    first, warm = server["first_burst"], server["warm_burst"]
    lines.append(f"{LEVELS[-1]}-stream burst TTFT p50: first {first['ttft_p50_ms']:.0f} ms, warmed {warm['ttft_p50_ms']:.0f} ms "
                 f"(ratio {first['ttft_p50_ms'] / warm['ttft_p50_ms']:.2f}); server ready in {server['ready_s']:.0f} s, engine in "
                 f"{server['engine']}")
    runs = [first, *(server[b] for b in LEVELS), warm]
    lines.append(f"requests: {sum(r['requests'] for r in runs)}, failed: {sum(r['failed'] for r in runs)}")
    for r in runs:
        for e in r["errors"]:
            lines.append(f"  failure: {e[:300]}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description="server vs engine vs raw forward on a GPU")
    p.add_argument("--tokenizer", type=Path, required=True, help="a saved tokenizer directory (vocab 49,152)")
    p.add_argument("--prompt-len", type=int, default=150)
    p.add_argument("--tokens", type=int, default=128, help="max_tokens of the 64/256-stream requests")
    p.add_argument("--itl-tokens", type=int, default=256, help="max_tokens of the one-stream requests")
    p.add_argument("--raw-steps", type=int, default=64)
    p.add_argument("--client-procs", type=int, default=8)
    p.add_argument("--serve-args", nargs="*", default=[], help="extra `cllm serve` flags (default: none, its defaults)")
    p.add_argument("--also-serve-args", default=None, metavar="'FLAGS'",
                   help="then a second server with these `cllm serve` flags added (one quoted string), reported after "
                        "the first: e.g. --also-serve-args '--set max_decode_stall_ms=off' against the default auto bound")
    p.add_argument("--skip", nargs="*", default=[], choices=["engine"], help="parts to leave out")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="CPU, a 2-layer model, 1/4/8 streams: checks the script")
    p.add_argument("--py-spy", type=Path, default=None, metavar="DIR",
                   help="after the measured runs, record py-spy profiles (raw stacks, with subprocesses and threads) of the "
                        "engine's largest level and the server's two largest here")
    args = p.parse_args()
    global LEVELS
    args.device = "cuda"
    if args.smoke:
        LEVELS = (1, 4, 8)
        args.device, args.tokens, args.itl_tokens, args.raw_steps, args.client_procs = "cpu", 16, 16, 8, 2
        args.serve_args = ["--set", "engine_process=on", *args.serve_args]  # auto is off on the CPU
        SHAPES["llama-3.2-1b"] = SMOKE_SHAPE
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        args.workdir = Path(tmp)
        model_dir = args.workdir / "model"
        shape = dict(SHAPES["llama-3.2-1b"], vocab_size=VOCAB)
        SHAPES["llama-3.2-1b-49k"] = shape
        build_model("llama-3.2-1b-49k", torch.bfloat16 if args.device == "cuda" else torch.float32, model_dir,
                    torch.device(args.device))
        for f in args.tokenizer.iterdir():
            shutil.copy(f, model_dir / f.name)
        print(f"model built ({time.perf_counter() - started:.0f} s)", flush=True)
        raw = raw_forward(model_dir, args)
        print(f"raw forward done ({time.perf_counter() - started:.0f} s): {raw}", flush=True)
        engine = {} if "engine" in args.skip else engine_offline(model_dir, args)
        print(f"engine done ({time.perf_counter() - started:.0f} s): {engine}", flush=True)
        try:
            server = serve(model_dir, args)
        finally:
            log = args.workdir / "server.log"
            if log.exists() and os.environ.get("OUT"):  # the device machine's result folder
                shutil.copy(log, Path(os.environ["OUT"]) / "gpu_serve_server.log")
        print(f"server done ({time.perf_counter() - started:.0f} s)", flush=True)
        print(report(raw, engine, server))
        also = None
        if args.also_serve_args is not None:
            args.serve_args = [*args.serve_args, *shlex.split(args.also_serve_args)]
            also = serve(model_dir, args)
            print(f"second server ({args.also_serve_args}) done ({time.perf_counter() - started:.0f} s)")
            print(report(raw, engine, also))
        if args.json:
            args.json.write_text(json.dumps({"raw": {str(k): v for k, v in raw.items()},
                                             "engine": {str(k): v for k, v in engine.items()},
                                             "server": {str(k): v for k, v in server.items()},
                                             "also_serve_args": args.also_serve_args,
                                             "also_server": {str(k): v for k, v in also.items()} if also else None},
                                            indent=1))
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()

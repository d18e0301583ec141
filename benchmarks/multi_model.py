"""Several models behind one `cllm serve` (issue 44): what a cold model costs, and whether two busy models
share the CPU as well as one.

1. Time to first token of a streamed chat request on a cold model (its load included) and warm, per backend
   (the embedded GGUF on llama.cpp, the same GGUF dequantised on torch), ``--rounds`` times each (the model
   unloaded through POST /v1/models/{name}/unload between cold runs).
2. Aggregate generation tokens/s, all clients streaming ``--max-tokens`` tokens with ignore_eos, in closed
   loops for ``--requests`` requests each:
   - one model, 2 x ``--clients`` clients (n_seq_max 2 x clients);
   - two models (the same GGUF under two names), ``--clients`` clients on each (n_seq_max clients each),
     their threads divided (router.share_cpu_threads: true, the default);
   - the same without the division (share_cpu_threads: false): each engine on every core.
   The systems alternate within each round; medians over ``--rounds``.

    python benchmarks/multi_model.py --out benchmarks/results/multi_model_<date>/result.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from cllm.model_path import default_model_path
from cllm.stress.server_process import ServerProcess, finish_server, start_server

GGUF = str(default_model_path())
CHAT = [{"role": "user", "content": "Name three colours."}]


def _server(*args: str) -> ServerProcess:
    return start_server(*args, "--log-level", "warning", threads=None)


async def _ttft(client: httpx.AsyncClient, model: str) -> float:
    body = {"model": model, "messages": CHAT, "max_tokens": 4, "temperature": 0, "stream": True}
    start = time.perf_counter()
    first = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"] if '"choices"' in line else {}
                if delta.get("content"):  # (the first chunk carries only the role)
                    first = time.perf_counter() - start
    if first is None:
        raise RuntimeError(f"{model}: no token")
    return first


async def cold_and_warm(srv: ServerProcess, models: list[str], rounds: int) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {m: {"cold_s": [], "warm_s": []} for m in models}
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=600) as client:
        for _ in range(rounds):
            for model in models:
                out[model]["cold_s"].append(await _ttft(client, model))
                for _ in range(3):
                    out[model]["warm_s"].append(await _ttft(client, model))
                (await client.post(f"/v1/models/{model}/unload")).raise_for_status()
    return out


async def _loop(client: httpx.AsyncClient, model: str, requests: int, max_tokens: int) -> int:
    tokens = 0
    for i in range(requests):
        body = {"model": model, "prompt": f"Story {i}: once upon a time", "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0.7, "seed": i}
        resp = await client.post("/v1/completions", json=body)
        resp.raise_for_status()
        tokens += resp.json()["usage"]["completion_tokens"]
    return tokens


async def throughput(srv: ServerProcess, loads: dict[str, int], requests: int, max_tokens: int) -> float:
    """Aggregate generated tokens/s of ``loads[model]`` closed-loop clients per model."""
    limits = httpx.Limits(max_connections=sum(loads.values()) + 4)
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=600, limits=limits) as client:
        for model in loads:  # warm: loaded and its first steps done
            await _loop(client, model, 1, 4)
        start = time.perf_counter()
        counts = await asyncio.gather(*(_loop(client, m, requests, max_tokens)
                                        for m, n in loads.items() for _ in range(n)))
        return sum(counts) / (time.perf_counter() - start)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"machine": _cpu_model(), "args": vars(args)}
    srv = _server("--model", f"llama={GGUF}", "--model", f"torch={GGUF}@torch", "--keep-alive", "-1",
                  "--set", "n_seq_max=2", "--set", "n_ctx=2048")
    try:
        ttft = asyncio.run(cold_and_warm(srv, ["llama", "torch"], args.rounds))
    finally:
        finish_server(srv, allow_tracebacks=True)
    report["ttft"] = {m: {k: {"runs": v, "median": statistics.median(v)} for k, v in d.items()} for m, d in ttft.items()}
    c = args.clients
    systems = {
        "one_model": (["--model", GGUF, "--n-seq-max", str(2 * c), "--n-ctx", str(2 * c * 512)], {None: 2 * c}),
        "two_models_shared": (["--model", f"a={GGUF}", "--model", f"b={GGUF}", "--keep-alive", "-1",
                               "--set", f"n_seq_max={c}", "--set", f"n_ctx={c * 512}"], {"a": c, "b": c}),
        "two_models_unshared": (["--model", f"a={GGUF}", "--model", f"b={GGUF}", "--keep-alive", "-1",
                                 "--set", f"n_seq_max={c}", "--set", f"n_ctx={c * 512}",
                                 "--set", "share_cpu_threads=false"], {"a": c, "b": c}),
    }
    rates: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(args.rounds):
        for name, (flags, loads) in systems.items():
            srv = _server(*flags)
            try:
                rate = asyncio.run(throughput(srv, {m or "": n for m, n in loads.items()}, args.requests, args.max_tokens))
            finally:
                finish_server(srv, allow_tracebacks=True)
            rates[name].append(round(rate, 1))
            print(f"{name}: {rate:.1f} tok/s", flush=True)
    medians = {name: statistics.median(v) for name, v in rates.items()}
    report["throughput_tok_s"] = {name: {"runs": rates[name], "median": medians[name]} for name in systems}
    report["ratio_two_shared_vs_one"] = round(medians["two_models_shared"] / medians["one_model"], 3)
    report["ratio_two_unshared_vs_one"] = round(medians["two_models_unshared"] / medians["one_model"], 3)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8, help="clients per model (the one-model run has twice)")
    parser.add_argument("--requests", type=int, default=2, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    report = run(args)
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

"""Streaming throughput / TTFT / TPOT: `cllm serve` vs in-process `cllm.LLM` vs llama-cpp-python's server.

Each concurrency level runs C closed-loop streaming clients (each sends its next
request when the previous one ends) against one server at a time, on the same
model file and thread count. Every request asks for exactly ``--max-tokens``
tokens (EOS banned through ``logit_bias``, which both servers support), so the
three systems generate identical token counts.

* aggregate tok/s = all generated tokens / wall time of the level
* TTFT = request sent -> first streamed token (client side)
* TPOT = (last token - first token) / (tokens - 1), per request

In-process `cllm.LLM` gets the same prompts with ``max_num_seqs=C`` (C
sequences at a time, like C closed-loop clients); its TTFT is measured from
when the scheduler first ran the request, so queueing behind the C running
requests is not counted — as for the closed-loop HTTP clients.

    .venv/bin/python benchmarks/server_vs_llama_cpp_python.py --levels 1 8 16 --json out.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from cllm.bench.server_process import BenchServer, free_port


@dataclass(slots=True)
class RequestSample:
    """Client-side timings of one streamed request."""

    ttft_s: float  # send -> first token
    tpot_s: float | None  # mean gap between tokens after the first
    tokens: int  # tokens received


@dataclass(slots=True)
class LevelResult:
    """One system at one concurrency level."""

    system: str  # cllm-server | cllm-LLM | llama-cpp-python-server
    concurrency: int  # clients / sequences at once
    requests: int  # requests completed
    tokens: int  # tokens generated
    wall_s: float  # level wall time
    samples: list[RequestSample] = field(default_factory=list, repr=False)

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def pct(self, attr: str, q: float) -> float | None:
        values = sorted(v for v in (getattr(s, attr) for s in self.samples) if v is not None)
        if not values:
            return None
        return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]

    def summary(self) -> dict[str, object]:
        ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
        return {
            "system": self.system, "concurrency": self.concurrency, "requests": self.requests,
            "tokens": self.tokens, "wall_s": round(self.wall_s, 2), "tok_per_s": round(self.tok_per_s, 1),
            "ttft_p50_ms": ms(self.pct("ttft_s", 0.5)), "ttft_p90_ms": ms(self.pct("ttft_s", 0.9)),
            "tpot_p50_ms": ms(self.pct("tpot_s", 0.5)), "tpot_p90_ms": ms(self.pct("tpot_s", 0.9)),
        }


def prompts_for(n: int) -> list[str]:
    """Distinct prompts (no shared prefix beyond a few tokens, so prefix caching does not skew)."""
    topics = ["rivers", "comets", "bees", "glaciers", "violins", "deserts", "owls", "bridges",
              "volcanoes", "lighthouses", "coral reefs", "trains", "mushrooms", "satellites", "tea", "chess"]
    return [f"Request {i}. Write a short essay about {topics[i % len(topics)]} number {i}:" for i in range(n)]


# ---- HTTP clients ----------------------------------------------------------------------


async def _stream_one(client: httpx.AsyncClient, body: dict[str, object], tokens: int) -> RequestSample:
    """Stream one request; ``tokens`` is how many it generates (EOS is banned, so exactly max_tokens).

    Both servers send one chunk per token; chunks without text (llama-cpp-python's
    closing finish_reason chunk) are not tokens.
    """
    sent = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices and choices[0].get("text"):
                stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError(f"no tokens streamed for {body}")
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return RequestSample(ttft_s=stamps[0] - sent, tpot_s=tpot, tokens=tokens)


async def run_http_level(system: str, base_url: str, concurrency: int, per_client: int,
                         max_tokens: int, bias: dict[str, float], model: str) -> LevelResult:
    prompts = prompts_for(concurrency * per_client)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600.0, limits=limits) as client:
        async def client_loop(k: int) -> list[RequestSample]:
            out = []
            for j in range(per_client):
                body = {"model": model, "prompt": prompts[k * per_client + j], "max_tokens": max_tokens,
                        "temperature": 0.0, "stream": True, "logit_bias": bias}
                out.append(await _stream_one(client, body, max_tokens))
            return out

        await _stream_one(client, {"model": model, "prompt": "warm up", "max_tokens": 4, "stream": True, "logit_bias": bias}, 4)
        start = time.perf_counter()
        per = await asyncio.gather(*(client_loop(k) for k in range(concurrency)))
        wall = time.perf_counter() - start
    samples = [s for group in per for s in group]
    return LevelResult(system, concurrency, len(samples), sum(s.tokens for s in samples), wall, samples)


# ---- in-process cllm.LLM -------------------------------------------------------------------


def run_llm_level(model_path: str | None, n_threads: int, concurrency: int, per_client: int,
                  max_tokens: int, eos_ids: list[int]) -> LevelResult:
    import cllm

    llm = cllm.LLM(model=model_path, n_threads=n_threads, max_num_seqs=concurrency,
                   n_seq_max=max(concurrency, 1))
    try:
        params = cllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, logit_bias={t: -100.0 for t in eos_ids})
        llm.generate(["warm up"], cllm.SamplingParams(max_tokens=4))
        prompts = prompts_for(concurrency * per_client)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
    finally:
        llm.close()
    samples = []
    for out in outs:
        m = out.metrics
        n = out.usage.completion_tokens
        ttft = (m.first_token_time or 0) - (m.first_scheduled_time or m.arrival_time)
        tpot = ((m.last_token_time or 0) - (m.first_token_time or 0)) / (n - 1) if n > 1 else None
        samples.append(RequestSample(ttft_s=ttft, tpot_s=tpot, tokens=n))
    return LevelResult("cllm-LLM (in-process)", concurrency, len(samples), sum(s.tokens for s in samples), wall, samples)


# ---- server processes -------------------------------------------------------------------


def start_cllm(model: str, n_threads: int, n_seq_max: int) -> BenchServer:
    port = free_port()
    cmd = [sys.executable, "-m", "cllm", "serve", "--model", model, "--port", str(port), "--n-threads", str(n_threads),
           "--n-seq-max", str(n_seq_max), "--log-level", "warning"]
    return BenchServer("cllm-serve", cmd, port)


def start_llama_cpp_python(model: str, n_threads: int) -> BenchServer:
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", model, "--n_threads", str(n_threads),
           "--interrupt_requests", "False", "--host", "127.0.0.1", "--port", str(port)]
    return BenchServer("llama-cpp-python-server", cmd, port, ready_path="/v1/models")


# ---- main --------------------------------------------------------------------------------


def eos_token_ids(model: str) -> list[int]:
    import cllm

    llm = cllm.LLM(model=model, n_seq_max=1)
    try:
        return sorted(llm.tokenizer.eos_token_ids)
    finally:
        llm.close()


def print_table(results: list[LevelResult]) -> None:
    head = f"{'system':28s} {'conc':>4s} {'reqs':>5s} {'tokens':>6s} {'tok/s':>7s} {'TTFT p50':>9s} {'TTFT p90':>9s} {'TPOT p50':>9s} {'TPOT p90':>9s}"
    print(head)
    print("-" * len(head))
    fmt = lambda v: "-" if v is None else f"{v:.0f}ms" if v >= 10 else f"{v:.1f}ms"  # noqa: E731
    for r in results:
        s = r.summary()
        print(f"{r.system:28s} {r.concurrency:4d} {r.requests:5d} {r.tokens:6d} {r.tok_per_s:7.1f} "
              f"{fmt(s['ttft_p50_ms']):>9s} {fmt(s['ttft_p90_ms']):>9s} {fmt(s['tpot_p50_ms']):>9s} {fmt(s['tpot_p90_ms']):>9s}")


def _median_run(runs: list[LevelResult]) -> LevelResult:
    """The repeat with the median throughput (a busy shared machine makes single runs noisy)."""
    return sorted(runs, key=lambda r: r.tok_per_s)[len(runs) // 2]


def run_level(system: str, level: int, args: argparse.Namespace, model: str, eos: list[int],
              servers: dict[str, BenchServer]) -> LevelResult:
    bias = {str(t): -100.0 for t in eos}
    if system == "cllm-server":
        coro = run_http_level("cllm-server", servers[system].url, level, args.per_client, args.max_tokens, bias, "")
        return asyncio.run(coro)
    if system == "llama-cpp-python":
        coro = run_http_level("llama-cpp-python-server", servers[system].url, level, args.per_client,
                              args.max_tokens, bias, Path(model).name)
        return asyncio.run(coro)
    return run_llm_level(model, args.n_threads, level, args.per_client, args.max_tokens, eos)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2-135M Q4_1)")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--per-client", type=int, default=2, help="requests each client sends, one after another")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--n-threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="runs per system and level; the median is reported")
    parser.add_argument("--systems", nargs="+", default=["cllm-server", "cllm-LLM", "llama-cpp-python"],
                        choices=["cllm-server", "cllm-LLM", "llama-cpp-python"])
    parser.add_argument("--json", type=Path, default=None, help="write the summaries here")
    args = parser.parse_args()

    from cllm.model_path import resolve_model_path

    model = str(resolve_model_path(args.model))
    eos = eos_token_ids(model)
    # SIGTERM ends the run through the `finally` below, so no server subprocess is left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    servers: dict[str, BenchServer] = {}
    try:
        # Both servers stay up (idle ones cost nothing); the systems take turns at each level so
        # that background load on a shared machine hits them alike.
        if "cllm-server" in args.systems:
            servers["cllm-server"] = start_cllm(model, args.n_threads, max(args.levels))
        if "llama-cpp-python" in args.systems:
            servers["llama-cpp-python"] = start_llama_cpp_python(model, args.n_threads)
        results: list[LevelResult] = []
        for level in args.levels:
            runs: dict[str, list[LevelResult]] = {s: [] for s in args.systems}
            for _ in range(args.repeats):
                for system in args.systems:
                    r = run_level(system, level, args, model, eos, servers)
                    print(f"  {r.system} c={level}: {r.tok_per_s:.1f} tok/s (load {os.getloadavg()[0]:.1f})", file=sys.stderr)
                    runs[system].append(r)
            results += [_median_run(runs[s]) for s in args.systems]
    finally:
        for server in servers.values():
            server.stop()
    print_table(results)
    if args.json:
        meta = {"model": model, "max_tokens": args.max_tokens, "per_client": args.per_client, "repeats": args.repeats,
                "n_threads": args.n_threads, "cpus": os.cpu_count(), "loadavg_end": os.getloadavg()}
        args.json.write_text(json.dumps({"meta": meta, "results": [r.summary() for r in results]}, indent=2))


if __name__ == "__main__":
    main()

"""Image requests served beside text streams (issue 43), `cllm serve` against llama.cpp's `llama-server`, the
same GGUF and projector (the tiny Gemma 3 VLM in tests/assets/models/: no real VLM weights can be fetched here,
so this measures serving, not a real encoder's cost), servers one after another within each round.

1. Images encoded per second: ``--images`` chat requests, each with its own image (no cache hit), 1 output
   token, ``--image-clients`` at a time.
2. Text streams' inter-token latency: ``--clients`` clients streaming ``--max-tokens`` tokens each (ignore_eos),
   alone, then with ``--image-clients`` clients sending image requests in a loop (a new image each time) beside
   them; ITL p99 with images / without, per server.

    python benchmarks/vision.py --out benchmarks/results/vision_<date>/result.json
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from cllm import tiny_vlms as tv
from cllm.bench.server_process import BenchServer, free_port

ASSETS = Path(__file__).resolve().parent.parent / "tests" / "assets" / "models"
MODEL, PROJECTOR = ASSETS / "tiny-gemma3-f32.gguf", ASSETS / "mmproj-tiny-gemma3-f32.gguf"
LLAMA_SERVER = Path.home() / ".cache" / "cllm" / "llama-server-0.3.36" / "build" / "bin" / "llama-server"


_PARTS: dict[int, dict[str, Any]] = {}


def image_part(seed: int) -> dict[str, Any]:
    """A distinct PNG per seed, made once (the client's own encoding is not what is measured)."""
    if seed not in _PARTS:
        buffer = io.BytesIO()
        tv.sample_image("gemma3", seed=seed).save(buffer, format="PNG")
        _PARTS[seed] = {"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()}}
    return _PARTS[seed]


def make_parts(seeds: range) -> None:
    for seed in seeds:
        image_part(seed)


def start(name: str, slots: int, threads: int) -> BenchServer:
    port = free_port()
    n_ctx = str(slots * 1024)
    if name == "llama-server":
        cmd = [str(LLAMA_SERVER), "-m", str(MODEL), "--mmproj", str(PROJECTOR), "--host", "127.0.0.1", "--port",
               str(port), "-t", str(threads), "-np", str(slots), "-c", n_ctx, "--no-webui", "--log-disable"]
    else:
        cmd = [sys.executable, "-m", "cllm", "serve", "--model", str(MODEL), "--port", str(port), "--log-level",
               "warning", "--n-threads", str(threads), "--n-seq-max", str(slots), "--n-ctx", n_ctx]
    return BenchServer(name, cmd, port)


async def image_request(client: httpx.AsyncClient, seed: int) -> None:
    body = {"model": MODEL.stem, "max_tokens": 1, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image_part(seed)]}]}
    resp = await client.post("/v1/chat/completions", json=body)
    resp.raise_for_status()


async def images_per_second(url: str, count: int, concurrency: int, seed0: int) -> float:
    queue = list(range(seed0, seed0 + count))
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for seed in range(seed0 + count, seed0 + count + 4):  # warm up (first-use costs are not a rate)
            await image_request(client, seed)

        async def worker() -> None:
            while queue:
                await image_request(client, queue.pop())
        start_t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return count / (time.perf_counter() - start_t)


async def stream_gaps(client: httpx.AsyncClient, i: int, max_tokens: int) -> list[float]:
    body = {"model": MODEL.stem, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.7, "seed": i,
            "stream": True, "messages": [{"role": "user", "content": f"Tell story number {i}."}]}
    gaps, last = [], None
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    return gaps


async def text_itl(url: str, clients: int, max_tokens: int, image_clients: int, seed0: int) -> dict[str, float]:
    done = asyncio.Event()
    sent = 0
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=clients + 8)) as client:
        async def images() -> None:
            nonlocal sent
            while not done.is_set():
                await image_request(client, seed0 + sent)
                sent += 1
        side = [asyncio.create_task(images()) for _ in range(image_clients)]
        results = await asyncio.gather(*(stream_gaps(client, i, max_tokens) for i in range(clients)))
        done.set()
        await asyncio.gather(*side)
    gaps = sorted(g for r in results for g in r)
    return {"itl_p50_ms": 1000 * gaps[len(gaps) // 2], "itl_p99_ms": 1000 * gaps[int(len(gaps) * 0.99)],
            "images_sent": sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--image-clients", type=int, default=2)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    systems = ["cllm", "llama-server"] if LLAMA_SERVER.is_file() else ["cllm"]
    runs: dict[str, dict[str, list[float]]] = {s: {} for s in systems}
    for r in range(args.rounds):  # every image made before any server starts
        make_parts(range(1000 * r, 1000 * r + args.images + 4))
        make_parts(range(100_000 + 1000 * r, 100_000 + 1000 * r + 400))
    for r in range(args.rounds):
        for name in systems:
            server = start(name, args.clients + args.image_clients, args.threads)
            try:
                got = {"images_per_s": asyncio.run(images_per_second(server.url, args.images, args.image_clients, 1000 * r))}
                alone = asyncio.run(text_itl(server.url, args.clients, args.max_tokens, 0, 0))
                beside = asyncio.run(text_itl(server.url, args.clients, args.max_tokens, args.image_clients, 100_000 + 1000 * r))
                got.update({"itl_p99_ms_alone": alone["itl_p99_ms"], "itl_p99_ms_with_images": beside["itl_p99_ms"],
                            "itl_p50_ms_alone": alone["itl_p50_ms"], "itl_p50_ms_with_images": beside["itl_p50_ms"],
                            "images_beside_text": beside["images_sent"]})
            finally:
                server.stop()
            for key, value in got.items():
                runs[name].setdefault(key, []).append(value)
            print(f"round {r} {name}: {json.dumps({k: round(v, 2) for k, v in got.items()})}", flush=True)
    medians = {s: {k: statistics.median(v) for k, v in m.items()} for s, m in runs.items()}
    for s, m in medians.items():
        m["itl_p99_ratio_with_images"] = m["itl_p99_ms_with_images"] / m["itl_p99_ms_alone"]
    if "llama-server" in medians:
        medians["images_per_s_ratio_cllm_over_llama_server"] = (
            medians["cllm"]["images_per_s"] / medians["llama-server"]["images_per_s"])
    result = {"machine": platform.processor() or platform.machine(), "args": vars(args) | {"out": str(args.out)},
              "runs": runs, "medians": medians}
    print(json.dumps(medians, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

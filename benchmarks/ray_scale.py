"""Issue 12 figures: Ray Serve scale-out, PD disaggregation and KV hand-off time.

1. Hand-off time per 1,000 tokens of KV (llama.cpp, embedded model): a prompt of ``--handoff-tokens``
   tokens is prefilled on engine A and moved to engine B (export + chunked transfer + import, and the
   restore at B's next admission), in-process (plain bytes) and through Ray's object store.
2. Aggregate output tok/s of 2 replicas vs 1 (1 thread each), streamed over HTTP.
3. PD (prefill=1,decode=1) vs colocated (2 replicas): TTFT and ITL on a prefill-heavy workload
   (512-token prompts, 64 out, 16 clients).

    .venv/bin/python benchmarks/ray_scale.py --json ray_scale.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import ray
from ray import serve

import cllm
from cllm.bench.metrics import summarize_run
from cllm.bench.serve import OpenAITarget
from cllm.bench.workload import GenerationSettings, load_tokenizer, random_prompts, run_load
from cllm.cluster import app as cluster_app
from cllm.cluster.transport import chunk_holder, publish, receive
from cllm.handoff.local import hand_off
from cllm.handoff.transfer import KVReceiver
from cllm.stress.server_process import free_port


def handoff_times(tokens: int, repeats: int, chunk_bytes: int) -> dict[str, Any]:
    """Median seconds to move ``tokens`` tokens of KV between two engines, in-process and via Ray."""
    settings = dict(n_threads=1, n_seq_max=2, n_ctx=4096, prefix_cache=False)
    tokenizer = load_tokenizer(None)
    prompt = random_prompts(tokenizer, 1, tokens, 8, seed=1)[0].token_ids
    local, via_ray, restore, size = [], [], [], 0
    with cllm.LLM(**settings) as a, cllm.LLM(**settings) as b:
        for i in range(repeats):
            for route in ("local", "ray"):
                rid = f"{route}-{i}"
                a.engine.add_request(prompt, cllm.SamplingParams(max_tokens=8, temperature=0), request_id=rid)
                while not a.engine.scheduler.requests[rid].output_token_ids:
                    a.engine.step()
                start = time.perf_counter()
                if route == "local":
                    size = hand_off(a.engine, b.engine, rid, chunk_bytes=chunk_bytes).kv_bytes
                else:
                    snapshot, segments = a.engine.export_request(rid)
                    ticket = asyncio.run(publish(snapshot, segments, chunk_bytes, chunk_holder()))
                    b.engine.import_request(snapshot, asyncio.run(receive(ticket, KVReceiver(ticket.header))))
                moved = time.perf_counter() - start
                b.engine.step()  # admission restores the KV (llama_state_seq_set_data) and decodes one token
                (local if route == "local" else via_ray).append(moved)
                restore.append(time.perf_counter() - start - moved)
                while b.engine.has_unfinished():
                    b.engine.step()
    per_k = 1000 / (tokens - 1)  # the last prompt token's KV is computed by the receiver
    return {"kv_tokens": tokens - 1, "kv_bytes": size, "chunk_bytes": chunk_bytes,
            "in_process_ms_per_1k_tokens": 1000 * statistics.median(local) * per_k,
            "object_store_ms_per_1k_tokens": 1000 * statistics.median(via_ray) * per_k,
            "restore_and_first_decode_ms": 1000 * statistics.median(restore)}


async def load(url: str, prompts: list, clients: int) -> dict[str, Any]:
    target = await OpenAITarget.open(url, name=url)
    try:
        records, duration = await run_load(target, prompts, GenerationSettings(), concurrency=clients, progress=False)
    finally:
        await target.close()
    s = summarize_run(records, duration)
    pick = lambda stats, q: None if stats is None else getattr(stats, q)  # noqa: E731
    return {"completed": s.completed, "failed": s.failed, "output_tok_s": s.output_throughput,
            "ttft_mean_ms": pick(s.ttft, "mean"), "ttft_p99_ms": pick(s.ttft, "p99"),
            "itl_mean_ms": pick(s.itl, "mean"), "itl_p99_ms": pick(s.itl, "p99"), "duration_s": duration}


def serve_and_load(port: int, prompts: list, clients: int, **deployment: Any) -> dict[str, Any]:
    url = cluster_app.serve_ray(port=port, blocking=False, n_threads=1, n_seq_max=16, n_ctx=16384, **deployment)
    asyncio.run(load(url, prompts[:2], 2))  # warm-up: first requests load lazily
    try:
        return asyncio.run(load(url, prompts, clients))
    finally:
        cluster_app.stop()
        time.sleep(3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--handoff-tokens", type=int, default=1001)
    ap.add_argument("--handoff-repeats", type=int, default=3)
    ap.add_argument("--chunk-bytes", type=int, default=1 << 20)
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per throughput / PD run")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens of the throughput runs")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients of the throughput runs")
    ap.add_argument("--pd-input-len", type=int, default=512)
    ap.add_argument("--pd-clients", type=int, default=16)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()

    results: dict[str, Any] = {"args": vars(args)}
    ray.init(num_cpus=2, object_store_memory=200 * 1024 * 1024, namespace=cluster_app.NAMESPACE,
             include_dashboard=False, log_to_driver=False)
    try:
        results["handoff"] = handoff_times(args.handoff_tokens, args.handoff_repeats, args.chunk_bytes)
        print("hand-off:", json.dumps(results["handoff"]), flush=True)
        tokenizer = load_tokenizer(None)
        port = free_port()
        short = random_prompts(tokenizer, args.num_prompts, args.input_len, args.output_len, seed=2)
        for n in (1, 2):
            results[f"replicas_{n}"] = serve_and_load(port, short, args.clients, replicas=n)
            print(f"{n} replica(s):", json.dumps(results[f"replicas_{n}"]), flush=True)
        long = random_prompts(tokenizer, args.num_prompts, args.pd_input_len, args.output_len, seed=3)
        results["colocated_2"] = serve_and_load(port, long, args.pd_clients, replicas=2)
        print("colocated:", json.dumps(results["colocated_2"]), flush=True)
        results["pd_1_1"] = serve_and_load(port, long, args.pd_clients, pd="prefill=1,decode=1")
        print("PD:", json.dumps(results["pd_1_1"]), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

"""Constrained-decoding benchmark: throughput of 16 concurrent json_schema requests vs the same 16
requests unconstrained, and grammar compile time (cold and cached).

Fairness: the unconstrained run generates exactly as many tokens per request as the constrained
run did (``max_tokens`` = that count, EOS ignored), same prompts, same seeds and temperature, so
both runs have the same batch sizes step by step and the difference is the cost of constraining
(bitmask fill, overlapped with the forward pass, plus masking and matcher updates). On a shared
machine whole-run throughput is noisy, so the engine thread's time inside the constraining calls is
timed too (``engine_thread_share``: their share of the constrained run's wall time). The prefix
cache is off so neither run reuses the other's prompt KV. Runs alternate; the best of
``--repeats`` of each is compared (other work on a shared machine only adds time), all are in the JSON.

    .venv/bin/python benchmarks/structured_output.py --threads 2 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import cllm
from cllm.bench.report import collect_environment
from cllm.model_path import resolve_model_path
from cllm.sampling.params import SamplingParams
from cllm.structured.cache import GrammarCache

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 60},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "email", "skills", "address"],
}
# Further schemas for the compile-time figures (different sizes and features).
EXTRA_SCHEMAS: dict[str, Any] = {
    "small_enum": {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}}, "required": ["answer"]},
    "nested_list": {"type": "object", "properties": {"items": {"type": "array", "items": PERSON, "maxItems": 3}},
                    "required": ["items"]},
}


def compile_times(llm: cllm.LLM) -> dict[str, Any]:
    """Compiler setup (vocabulary scan), cold compile of each schema, and a cached lookup."""
    cache = GrammarCache(llm.tokenizer, capacity=16)
    t0 = time.perf_counter()
    cache.compiler()
    out: dict[str, Any] = {"compiler_setup_s": time.perf_counter() - t0, "schemas": {}}
    for name, schema in {"person": PERSON, **EXTRA_SCHEMAS}.items():
        params = SamplingParams(json_schema=schema)
        t0 = time.perf_counter()
        cache.get(params)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(100):
            cache.get(params)
        cached = (time.perf_counter() - t0) / 100
        out["schemas"][name] = {"cold_s": cold, "cached_s": cached}
    return out


class EngineThreadTimer:
    """Seconds the engine thread spends in the constrained-decoding calls (mask wait + apply, matcher
    sync, accept), and the worker's fill time: the cost of constraining without the machine's noise."""

    def __init__(self, llm: cllm.LLM) -> None:
        self.spent = {"start_fill": 0.0, "apply": 0.0, "accept": 0.0, "_fill": 0.0}
        structured = llm.engine.structured
        for name in self.spent:
            setattr(structured, name, self._timed(name, getattr(structured, name)))

    def _timed(self, name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - t0
        return call

    def reset(self) -> None:
        self.spent = dict.fromkeys(self.spent, 0.0)

    def engine_thread_s(self) -> float:
        return self.spent["start_fill"] + self.spent["apply"] + self.spent["accept"]


def run(llm: cllm.LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, list[Any]]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="llama_cpp")
    ap.add_argument("--json", help="write the full results here")
    args = ap.parse_args()
    c = args.concurrency
    llm = cllm.LLM(backend=args.backend, n_threads=args.threads, n_seq_max=c, n_ctx=1024 * c, prefix_cache=False)
    compile_info = compile_times(llm)
    print(json.dumps({"compile": compile_info}), file=sys.stderr, flush=True)
    prompts = [llm.engine.tokenize_chat([{"role": "user", "content": f"Invent person number {i} and describe them as JSON "
                                          "with name, age, email, skills and address."}]) for i in range(c)]
    constrained = [SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens, json_schema=PERSON) for i in range(c)]
    run(llm, prompts[:2], constrained[:2])  # warm-up (the grammar is compiled here)
    timer = EngineThreadTimer(llm)
    records: list[dict[str, Any]] = []
    for _ in range(args.repeats):
        timer.reset()
        t_c, outs = run(llm, prompts, constrained)
        constraining_s, fill_s = timer.engine_thread_s(), timer.spent["_fill"]
        counts = [len(o.outputs[0].token_ids) for o in outs]
        valid = sum(1 for o in outs if _valid(o.outputs[0].text))
        free = [SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(counts)]
        t_u, outs_u = run(llm, prompts, free)
        tokens = sum(counts)
        assert tokens == sum(len(o.outputs[0].token_ids) for o in outs_u)
        records.append({"tokens": tokens, "constrained_s": t_c, "unconstrained_s": t_u, "valid_json": valid,
                        "constrained_tok_s": tokens / t_c, "unconstrained_tok_s": tokens / t_u,
                        "engine_thread_constraining_s": constraining_s, "worker_fill_s": fill_s,
                        "engine_thread_share": constraining_s / t_c})
        print(json.dumps(records[-1]), file=sys.stderr, flush=True)
    best_c = max(r["constrained_tok_s"] for r in records)
    best_u = max(r["unconstrained_tok_s"] for r in records)
    result = {
        "concurrency": c, "threads": args.threads, "backend": args.backend, "max_tokens": args.max_tokens,
        "best_constrained_tok_s": best_c, "best_unconstrained_tok_s": best_u,
        "throughput_loss": 1 - best_c / best_u,
        "median_loss": statistics.median(1 - r["constrained_tok_s"] / r["unconstrained_tok_s"] for r in records),
        "median_engine_thread_share": statistics.median(r["engine_thread_share"] for r in records),
        "runs": records, "compile": compile_info,
        "environment": collect_environment(threads=args.threads, model_path=str(resolve_model_path(None))).model_dump(),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    llm.close()


def _valid(text: str) -> bool:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(obj, dict) and set(PERSON["required"]) <= set(obj)


if __name__ == "__main__":
    main()

"""N-gram speculation on or off, one engine, in-process, alternating per request: speed-up and acceptance.

For a backend benchmarks/speculative.py does not serve side by side with llama-server (the torch
backend on a CPU: issue 29 item 5), or to check a change without servers. One ``cllm.LLM`` with
``speculative: ngram`` runs each prompt of benchmarks/speculative.py's sets twice per round, once with
``SamplingParams(speculative=False)`` and once with it on, in alternating order; greedy. Reports per set
the median decode tok/s (output tokens after the first over the time from the first token to the last,
from the request's metrics) of both, their ratio, the share of outputs identical token for token (and where the others first differ), and
the speculator's draft tokens proposed and accepted with speculation on.

    .venv/bin/python benchmarks/speculative_inprocess.py --backend torch --rounds 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from speculative import prompt_sets  # noqa: E402

import cllm  # noqa: E402


def decode_rate(out: cllm.RequestOutput) -> float:
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    if n < 2 or m.first_token_time is None or m.last_token_time is None:
        return 0.0
    return (n - 1) / max(m.last_token_time - m.first_token_time, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="torch", choices=["torch", "llama_cpp"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--sets", nargs="*", default=["copy", "extract", "list", "chat"])
    ap.add_argument("--dtype", default="auto", help="torch: auto (bfloat16 on a CPU with native bf16) or float32")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    extra = {"dtype": args.dtype} if args.backend == "torch" else {}
    llm = cllm.LLM(backend=args.backend, speculative="ngram", **extra)
    sets = {name: prompt_sets()[name] for name in args.sets}
    rates: dict[str, dict[bool, list[float]]] = {name: {False: [], True: []} for name in sets}
    same: dict[str, list[bool]] = {name: [] for name in sets}
    diverged: dict[str, list[int]] = {name: [] for name in sets}  # where a pair's outputs first differ
    counts: dict[str, list[int]] = {name: [0, 0] for name in sets}  # draft tokens proposed, accepted
    for round_no in range(args.rounds):
        for name, prompts in sets.items():
            for prompt in prompts:
                outputs = {}
                for on in (False, True) if round_no % 2 == 0 else (True, False):
                    before = llm.stats()
                    params = cllm.SamplingParams(max_tokens=args.max_tokens, temperature=0, speculative=on)
                    out = llm.chat([[{"role": "user", "content": prompt}]], params)[0]
                    after = llm.stats()
                    outputs[on] = out.outputs[0].token_ids
                    rates[name][on].append(decode_rate(out))
                    if on:
                        counts[name][0] += after.spec_proposed_tokens - before.spec_proposed_tokens
                        counts[name][1] += after.spec_accepted_tokens - before.spec_accepted_tokens
                a, b = list(outputs[False]), list(outputs[True])
                same[name].append(a == b)
                if a != b:
                    diverged[name].append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
        print(f"round {round_no + 1} done", file=sys.stderr)
    llm.close()
    report = {}
    print(f"{args.backend} ({args.dtype}): decode tok/s, medians over prompts and rounds")
    print(f"{'set':10s}{'off':>10s}{'ngram':>10s}{'ratio':>8s}{'proposed':>10s}{'accepted':>10s}{'rate':>7s}{'identical':>11s}  first difference at")
    for name in sets:
        off, on = statistics.median(rates[name][False]), statistics.median(rates[name][True])
        proposed, accepted = counts[name]
        report[name] = {"off": off, "ngram": on, "ratio": on / off if off else 0.0, "proposed": proposed,
                        "accepted": accepted, "identical": sum(same[name]) / len(same[name]),
                        "first_difference": diverged[name],
                        "raw": {"off": rates[name][False], "ngram": rates[name][True]}}
        print(f"{name:10s}{off:10.1f}{on:10.1f}{on / off if off else 0.0:8.2f}{proposed:10d}{accepted:10d}"
              f"{accepted / proposed if proposed else 0.0:7.2f}{f'{sum(same[name])}/{len(same[name])}':>11s}  {diverged[name]}")
    if args.json:
        args.json.write_text(json.dumps({"backend": args.backend, "dtype": args.dtype, "max_tokens": args.max_tokens, "sets": report}, indent=1))


if __name__ == "__main__":
    main()

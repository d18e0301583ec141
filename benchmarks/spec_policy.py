"""Replay speculation policies on the real model, each step priced by a measured cost curve: no timing noise.

One-stream speed under n-gram speculation depends on the policy's constants (cllm/speculative/speculator.py:
the first draft depth, decay rates, the acceptance cap; planner.py's and step_cost.py's, e.g. ``MIN_GAIN``, ``WINDOW``;
``num_speculative_tokens``). Measured end to end
(benchmarks/speculative.py) a few percent between two policies is within the VM's drift. Here every
policy runs the real engine on the embedded model (greedy, so the tokens and the n-gram proposals are
exactly what a server would produce), and each decode step is priced by its token count on a step-cost
curve measured once at the start (``llama_decode`` of n tokens on the weights the engine loads, or
``--curve``). The planner learns its step costs from those priced steps instead of wall times, as a live
server learns them (an unknown curve at first, one bucket at a time), so a policy's plans, and the figure,
are deterministic. (Handing the planner the whole curve up front instead, as this script did before
2026-11-28, models no server: with the neutral prior and a known, steep 1 -> 2 token step, a new sequence
never drafts, and a copy set showed 0.97x where served it is 1.7x.) Each policy runs every prompt twice and reports the second pass (the
first warms the engine's acceptance prior, as a server's earlier requests would); ``--cold`` reports the
first pass instead: a fresh server's first requests, which is what each round of benchmarks/speculative.py
measures (it starts a new server per round, and copy is its first set).

Figures are modeled decode tokens/s (output tokens after the first, over the priced decode steps),
per prompt set: median and mean over its prompts, and the mean against no speculation.

    .venv/bin/python benchmarks/spec_policy.py                                  # the defaults against off
    .venv/bin/python benchmarks/spec_policy.py --policy FIRST_DEPTH=4 --policy FIRST_DEPTH=12
    .venv/bin/python benchmarks/spec_policy.py --policy num_speculative_tokens=32 --sets list chat
    .venv/bin/python benchmarks/spec_policy.py --deterministic --policy MIN_GAIN=0.05   # same text for all
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from speculative import prompt_sets  # noqa: E402

import cllm  # noqa: E402
from cllm.speculative import planner as plan_module  # noqa: E402
from cllm.speculative import speculator as spec_module  # noqa: E402
from cllm.speculative import step_cost as cost_module  # noqa: E402

CURVE_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40)


def measure_curve(model_path: str, n_threads: int, reps: int = 5, counts: tuple[int, ...] = CURVE_TOKENS,
                  context: int = 60) -> dict[int, float]:
    """Median milliseconds of one ``llama_decode`` of n tokens (all with logits) after ``context`` tokens."""
    import llama_cpp

    from cllm.backends.llama_cpp.native import avoid_amx_extra_buffers
    avoid_amx_extra_buffers()
    llm = llama_cpp.Llama(model_path=model_path, n_ctx=512, n_threads=n_threads, n_batch=512, n_ubatch=512,
                          logits_all=True, verbose=False)
    tokens = llm.tokenize(" ".join(f"item {i}, apples, bread, milk." for i in range(40)).encode())[:context + max(counts)]
    times: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(reps):
        for n in counts:
            llm.reset()
            llm.eval(tokens[:context])
            start = time.perf_counter()
            llm.eval(tokens[context:context + n])
            times[n].append((time.perf_counter() - start) * 1000)
    llm.close()
    return {n: statistics.median(t) for n, t in times.items()}


def pricer(curve: dict[int, float]):
    xs = sorted(curve)
    ys = [curve[x] for x in xs]
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return lambda n: float(np.interp(n, xs, ys)) if n <= xs[-1] else ys[-1] + (n - xs[-1]) * slope


def run_policy(settings: dict[str, float], sets: dict[str, list[str]], price, max_tokens: int,
               report_pass: int = 1, deterministic: bool = False,
               texts: list[int] | None = None) -> dict[str, list[float]]:
    """Modeled decode tok/s of every prompt under ``settings`` (speculator or planner constants and
    ``num_speculative_tokens``; ``speculative=off`` for the baseline), in pass ``report_pass`` (0: a
    fresh engine's first requests, as each round of benchmarks/speculative.py serves them; 1: warm).
    ``texts`` gets a hash of each reported output's tokens."""
    settings = dict(settings)
    method = str(settings.pop("speculative", "ngram"))
    kwargs: dict[str, object] = {"speculative": method, "deterministic": deterministic}
    module = {name: next((m for m in (spec_module, cost_module) if hasattr(m, name)), plan_module) for name in settings}
    for name in [n for n in settings if not hasattr(module[n], n)]:  # settings (num_speculative_tokens, ...)
        kwargs[name] = int(settings.pop(name))
    saved = {name: getattr(module[name], name) for name in settings}
    steps: list[int] = []
    observe = spec_module.Speculator.observe_step

    def observe_step(self, chunks, secs):  # every decode step's size (drafts included), timed by the curve
        steps.append(sum(c.num_tokens for c in chunks))
        return observe(self, chunks, price(steps[-1]) / 1000)

    try:
        for name, value in settings.items():
            setattr(module[name], name, type(saved[name])(value))
        spec_module.Speculator.observe_step = observe_step
        llm = cllm.LLM(backend="llama_cpp", **kwargs)
        params = cllm.SamplingParams(max_tokens=max_tokens, temperature=0)
        result: dict[str, list[float]] = {}
        for pass_no in range(2):
            for name, prompts in sets.items():
                for prompt in prompts:
                    steps.clear()
                    out = llm.chat([[{"role": "user", "content": prompt}]], params)[0]
                    n = len(out.outputs[0].token_ids)
                    priced = steps if method != "off" else [1] * (n - 1)
                    if pass_no == report_pass and n > 1:
                        result.setdefault(name, []).append((n - 1) / (sum(price(s) for s in priced) / 1000))
                        if texts is not None:
                            texts.append(hash(tuple(out.outputs[0].token_ids)))
        llm.close()
        return result
    finally:
        for name, value in saved.items():
            setattr(module[name], name, value)
        spec_module.Speculator.observe_step = observe


def parse_policy(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        out[key.strip()] = value.strip() if key.strip() == "speculative" else float(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", action="append", default=[],
                    help="NAME=VALUE[,NAME=VALUE]: speculator constants / num_speculative_tokens (repeatable; "
                         "none: the defaults)")
    ap.add_argument("--sets", nargs="*", default=["copy", "extract", "list", "chat"])
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--curve", help="JSON {tokens: ms} instead of measuring")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--deterministic", action="store_true",
                    help="run the engine with deterministic: true, so that every policy produces the same text "
                         "(without it a verified row can round differently from a one-token step and change the "
                         "greedy text, and one prompt's figure then moves with the path it took)")
    ap.add_argument("--cold", action="store_true",
                    help="report the first pass (a fresh server's first requests, as each round of "
                         "benchmarks/speculative.py starts one) instead of the second")
    args = ap.parse_args()
    from cllm.backends.llama_cpp.weights import prepare_weights
    from cllm.model_path import resolve_model_path
    model = str(prepare_weights(Path(resolve_model_path(None)), "auto", gpu_layers=0, n_threads=args.threads))
    curve = ({int(k): float(v) for k, v in json.loads(args.curve).items()} if args.curve
             else measure_curve(model, args.threads))
    print("step cost (ms by tokens):", json.dumps({k: round(v, 1) for k, v in curve.items()}))
    price = pricer(curve)
    all_sets = prompt_sets()
    sets = {name: all_sets[name] for name in args.sets}
    policies = ["speculative=off"] + (args.policy or [""])
    figures: dict[str, dict[str, list[float]]] = {}
    texts: list[list[int]] = []
    for policy in policies:
        texts.append([])
        figures[policy or "defaults"] = run_policy(parse_policy(policy), sets, price, args.max_tokens, 0 if args.cold else 1,
                                                   args.deterministic, texts[-1])
    base = figures["speculative=off"]
    print(f"{'policy':40s}" + "".join(f"{name:>26s}" for name in sets))
    for policy, result in figures.items():
        cells = []
        for name in sets:
            v = result.get(name, [])
            ratio = statistics.fmean(v) / statistics.fmean(base[name]) if v and base.get(name) else 0.0
            cells.append(f"{statistics.median(v):7.1f} {statistics.fmean(v):7.1f} {ratio:5.2f}x" if v else "-")
        print(f"{policy:40s}" + "".join(f"{c:>26s}" for c in cells))
        print(f"{'':40s}" + "".join(f"{' '.join(f'{x:.0f}' for x in result.get(name, [])):>26s}" for name in sets))
    print("(per set: median and mean modeled decode tok/s over its prompts, mean against speculative=off; then each prompt's)")
    same = sum(len(set(outputs)) == 1 for outputs in zip(*texts))
    print(f"outputs identical under every policy: {same} of {len(texts[0])} prompts")
    if args.json:
        Path(args.json).write_text(json.dumps({"curve": curve, "figures": figures}, indent=1))


if __name__ == "__main__":
    main()

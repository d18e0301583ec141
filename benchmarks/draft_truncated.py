"""Draft-model speculation on real weights: drafts cut from the target itself (cllm.bench.layer_draft).

No smaller model with the embedded model's vocabulary is available here, so the draft models are the
target's first K blocks. For each K this reports how often the draft's greedy token is the target's
(teacher-forced over README.md: the acceptance a greedy draft can expect), its size against the
target's (what a draft token costs, for a bandwidth-bound decode), and then one stream with
``speculative: draft`` against ``speculative: off`` (in-process ``LLM.chat``, greedy, alternating,
medians of decode tok/s, the engine's own planning from measured step times) with the draft
speculator's proposed/accepted counters.

    .venv/bin/python benchmarks/draft_truncated.py                 # K = 8, 16, 24 on the embedded model
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import llama_cpp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import prompt_sets  # noqa: E402
from weights_accuracy import REPO, log_probs  # noqa: E402

import cllm  # noqa: E402
from cllm.bench.layer_draft import write_layer_draft  # noqa: E402
from cllm.model_path import resolve_model_path  # noqa: E402


def one_stream(llms: dict[str, cllm.LLM], prompts: list[str], rounds: int, max_tokens: int) -> dict[str, float]:
    params = cllm.SamplingParams(temperature=0, max_tokens=max_tokens)
    rates: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(rounds):
        for name, llm in llms.items():
            for prompt in prompts:
                out = llm.chat([{"role": "user", "content": prompt}], params)[0]
                m, n = out.metrics, len(out.outputs[0].token_ids)
                if n > 1:
                    rates[name].append((n - 1) / (m.last_token_time - m.first_token_time))
    return {name: statistics.median(r) for name, r in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 16, 24])
    parser.add_argument("--tokens", type=int, default=500, help="tokens of README.md scored teacher-forced")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    source = resolve_model_path(args.model)
    vocab = llama_cpp.Llama(model_path=str(source), vocab_only=True, verbose=False)
    ids = vocab.tokenize((REPO / "README.md").read_text().encode())[: args.tokens]
    target = log_probs(source, ids, args.threads).argmax(axis=1)
    sets = prompt_sets()
    settings = dict(model=str(source), n_threads=args.threads, n_seq_max=1, n_ctx=4096)
    print(f"target {source.name}: {source.stat().st_size / 1e6:.0f} MB; one stream, decode tok/s, medians of "
          f"{args.rounds} alternating rounds x 2 prompts, {args.max_tokens} tokens, greedy")
    print("| draft blocks | size MB | greedy agreement | set | off | draft | ratio | proposed / accepted |\n"
          "|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for k in args.layers:
            path = write_layer_draft(source, Path(tmp) / f"draft{k}.gguf", k)
            agreement = (log_probs(path, ids, args.threads).argmax(axis=1) == target).mean()
            with cllm.LLM(**settings, speculative="off") as off, \
                    cllm.LLM(**settings, speculative="draft", speculative_model=str(path)) as draft:
                for name in ("copy", "chat"):
                    before = draft.engine.speculator.stats
                    proposed, accepted = before.proposed_tokens, before.accepted_tokens
                    rates = one_stream({"off": off, "draft": draft}, sets[name][:2], args.rounds, args.max_tokens)
                    stats = draft.engine.speculator.stats
                    print(f"| {k} | {path.stat().st_size / 1e6:.0f} | {agreement:.1%} | {name} | {rates['off']:.1f} | "
                          f"{rates['draft']:.1f} | {rates['draft'] / rates['off']:.2f} | "
                          f"{stats.proposed_tokens - proposed} / {stats.accepted_tokens - accepted} |", flush=True)


if __name__ == "__main__":
    main()

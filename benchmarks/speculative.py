"""Speculative decoding, side by side: cllm with and without it, and llama-server with its n-gram methods.

Same model (the embedded SmolLM2-135M Q4_1 by default), same machine, same prompts, greedy, one
server at a time, the order of the systems alternating between rounds:

- ``cllm``: ``cllm serve --speculative off``;  ``cllm-ngram``: ``cllm serve`` (speculative: ngram, adaptive);
  ``cllm-ngram-b`` (not in the default set): cllm-ngram with ``--b-set NAME=VALUE`` settings, for an A/B;
- ``llama``: ``llama-server`` without speculation; ``llama-ngram-simple``, ``llama-ngram-map-k``,
  ``llama-ngram-mod``: its n-gram methods (``--spec-type``), on their defaults. "llama best" is the best
  of the three per prompt set.

Prompt sets (chat requests, the model's own template on both servers):

- ``copy``: repeat a passage word for word;  ``extract``: copy the sentences of a document that say X;
- ``list``: continue a list that repeats;  ``chat``: free-form questions (nothing to copy);
- ``code``: write a function or a query (nothing to copy);  ``long``: ~1,000 tokens of random common words
  and a question about them: n-grams of the prompt recur everywhere, the answer follows none (issue 45).

For the input-grounded sets the script reports how much of each output the model copied from its
prompt (``copied``: the share of output tokens inside a run of >= 8 tokens found in the prompt), so a
speed-up is shown to come from copying.

One stream: requests one after another; output tokens/s = completion tokens / (last token - first
token) (the decode rate; the prompt's prefill is reported apart as TTFT). Concurrency: ``--clients``
closed loops over the copy and chat sets at once (``--busy-requests`` requests per client), tokens/s =
all completion tokens / wall time, for ``cllm`` and ``cllm-ngram`` only (speculation must never make a
busy server slower), with the draft tokens cllm-ngram proposed and kept there (from ``/v1/engine``).

Targets (issue 29): one stream on copy/extract/list >= 1.8x cllm without speculation and >= 1.5x
llama best; chat >= 0.97x; at 16 and 64 clients >= 0.97x cllm without speculation.

    .venv/bin/python benchmarks/speculative.py --json benchmarks/results/speculative.json   # ~15 min
    .venv/bin/python benchmarks/speculative.py --rounds 1 --clients 16 --quick               # iteration

Fresh servers of the same settings differ here by 5-10 % in one-stream tok/s, so a ratio of two servers
over a few rounds carries that noise. ``--per-request`` measures speculation on one server instead: each
prompt twice, with the request's ``speculative: false`` and without, alternating, prefix cache off
("cllm" in the table is then the same server's requests without speculation; the speculator's own
per-step bookkeeping, ~0.6 % of a step on chat, is paid on both sides).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))
from vs_llama_server import _amx_build, build_llama_server, default_threads  # noqa: E402

from cllm.bench.server_process import BenchServer, free_port  # noqa: E402
from cllm.model_path import resolve_model_path  # noqa: E402

PASSAGES = [
    "The committee met on Tuesday to review the annual budget. After a long discussion, the members agreed to "
    "increase funding for the public library by ten percent, to repair the roof of the community centre, and to "
    "hire two additional staff for the youth programme. The chair thanked everyone for their work.",
    "Photosynthesis is the process by which green plants use sunlight to make food from carbon dioxide and water. "
    "It takes place mainly in the leaves, inside small structures called chloroplasts. Oxygen is released into "
    "the air as a by-product, which is why forests are so important for life on Earth.",
    "To reset your password, open the settings page and choose the security tab. Click the button labelled change "
    "password, enter your current password once and your new password twice, then press save. You will receive "
    "an email confirming the change within a few minutes.",
    "The river rises in the northern hills and flows south for about three hundred kilometres before it reaches "
    "the sea. Along the way it passes through four large towns and feeds a number of farms, which depend on its "
    "water during the dry summer months.",
]
DOCUMENT = (
    "Report of the harbour authority. The new pier was opened in March and can take ships of up to two hundred "
    "metres. Traffic grew by twelve percent compared with the previous year. The fish market moved to the east "
    "quay in June, where it now has cold storage for the first time. Two cranes were replaced because they were "
    "more than forty years old. The authority plans to dredge the main channel next spring."
)
LISTS = [
    "apples, bread, milk, eggs, butter, apples, bread, milk, eggs, butter, apples, bread, milk, eggs, butter, apples,",
    "Monday: gym. Tuesday: piano. Wednesday: gym. Thursday: piano. Friday: gym. Monday: gym. Tuesday: piano. "
    "Wednesday: gym. Thursday: piano. Friday: gym. Monday: gym. Tuesday:",
    "red, green, blue, red, green, blue, red, green, blue, red, green, blue, red, green, blue, red, green, blue, red,",
]
CHAT = [
    "Write a short story about a dragon who learns to bake bread.",
    "What are three good habits for staying healthy? Explain each briefly.",
    "Explain why the sky is blue to a ten year old.",
    "Give me some ideas for a birthday party for a seven year old.",
]
CODE = [
    "Write a Python function that checks whether a string is a palindrome, with a docstring and two examples.",
    "Write a JavaScript function that debounces another function, and explain how to use it.",
    "Write a SQL query that lists the ten customers who spent the most last year, from tables customers and orders.",
    "Write a Python class for a simple bank account with deposit, withdraw and balance methods.",
]
# Words of the long prompts: a small vocabulary, so that two- and three-word n-grams recur all over a
# ~1,000-token prompt (as in vs_llama_server.py's random-word prompts, issue 45) and prompt lookup keeps
# finding matches that the model's answer does not follow.
LONG_WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but "
              "have an they you were her she there one all we their can has more when will would who so no time "
              "people year city water river market school house family work system report music garden story "
              "company street window morning village doctor letter island winter paper table").split()


def long_prompts(n: int = 4, words: int = 980) -> list[str]:
    """``n`` chat prompts of ``words`` seeded random words (~1,000 tokens) and a question about them."""
    rng = random.Random(45)
    return [" ".join(rng.choice(LONG_WORDS) for _ in range(words)) + "\n\nWhich topics do the notes above mention? "
            "Answer in a few sentences." for _ in range(n)]


def prompt_sets() -> dict[str, list[str]]:
    return {
        "copy": [f"Repeat the following text exactly, word for word.\n\n{p}" for p in PASSAGES],
        # Extracting spans: phrasings the embedded model answers by copying (it paraphrased "quote the
        # sentences about X": 5 % copied; these: 81-100 %, listed by the script as "copied").
        "extract": [f"Extract the first three sentences of the following report, exactly as written.\n\n{DOCUMENT}",
                    "Find the sentences in the text below that mention money or staff and list them exactly as "
                    f"written.\n\n{PASSAGES[0]}",
                    "Find the sentences in the text below that contain a number and list them exactly as written, "
                    f"one per line.\n\n{DOCUMENT}",
                    "Find the sentences in the text below that contain a number and list them exactly as written, "
                    f"one per line.\n\n{PASSAGES[3]}"],
        "list": [f"Continue this list exactly as it goes on:\n{items}" for items in LISTS],
        "chat": CHAT,
        "code": CODE,
        "long": long_prompts(),
    }


# ------------------------------------------------------------------------------------------ servers
SYSTEMS = ["cllm", "cllm-ngram", "cllm-ngram-b", "llama", "llama-ngram-simple", "llama-ngram-map-k", "llama-ngram-mod"]


def start(system: str, args: argparse.Namespace, binary: Path | None, extra: tuple[str, ...] = ()) -> BenchServer:
    port = free_port()
    slots = max([1] + args.clients)
    n_ctx = str(slots * args.ctx_per_slot)
    if system.startswith("llama"):
        cmd = [str(binary), "-m", args.model, "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads),
               "-np", str(slots), "-c", n_ctx, "--no-webui", "--log-disable"]
        if _amx_build():
            cmd.append("--no-repack")  # as vs_llama_server.py: llama.cpp's AMX repack crashes multi-token decodes
        if system != "llama":
            cmd += ["--spec-type", system.removeprefix("llama-")]
    else:
        cmd = [sys.executable, "-m", "cllm", "serve", "--model", args.model, "--port", str(port), "--log-level", "warning", "--served-model-name", "m",
               "--n-threads", str(args.threads), "--n-seq-max", str(slots), "--n-ctx", n_ctx,
               "--speculative", "ngram" if system.startswith("cllm-ngram") else "off"]
        if system == "cllm-ngram-b":  # the same server with other settings, for an A/B in one run
            cmd += [arg for setting in args.b_set for arg in ("--set", setting)]
    return BenchServer(system, [*cmd, *extra], port)


# ------------------------------------------------------------------------------------------ client
async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                      **fields: object) -> dict[str, float | str]:
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **fields}
    start = time.perf_counter()
    first = last = None
    text, tokens = [], 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text.append(piece)
    if first is None or last is None or tokens < 2:
        return {"tokens": tokens, "decode_tok_s": 0.0, "ttft_s": 0.0, "text": "".join(text)}
    return {"tokens": tokens, "decode_tok_s": (tokens - 1) / max(last - first, 1e-9), "ttft_s": first - start,
            "text": "".join(text)}


async def one_stream(url: str, prompts: list[str], max_tokens: int) -> list[dict[str, float | str]]:
    # A new connection per request: llama-server closes a connection after a streamed response, and a
    # request sent on it meanwhile failed with "Server disconnected without sending a response" — read
    # until 2026-11-27 as llama-server crashing (its process was alive; 7-9 of 48 set-rounds lost).
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        return [await one_request(client, url, p, max_tokens) for p in prompts]


async def paired_stream(url: str, prompts: list[str], max_tokens: int, off_first: bool) -> tuple[list[dict], list[dict]]:
    """Each prompt twice on one server, with the request's ``speculative: false`` and without it, the order
    alternating from prompt to prompt (``off_first``: the first prompt's): (off results, on results)."""
    limits = httpx.Limits(max_keepalive_connections=0)
    off, on = [], []
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        for i, prompt in enumerate(prompts):
            for speculate in ((False, True) if (i % 2 == 0) == off_first else (True, False)):
                fields = {} if speculate else {"speculative": False}
                (on if speculate else off).append(await one_request(client, url, prompt, max_tokens, **fields))
    return off, on


async def closed_loops(url: str, prompts: list[str], clients: int, requests: int, max_tokens: int) -> float:
    """Output tokens/s of ``clients`` closed loops sending ``requests`` requests in all."""
    queue = list(range(requests))
    total = 0

    async def loop(client: httpx.AsyncClient) -> None:
        nonlocal total
        while queue:
            i = queue.pop()
            tokens = int((await one_request(client, url, prompts[i % len(prompts)], max_tokens))["tokens"])
            total += tokens  # (not `total += await ...`: that reads total before the await and loses updates)

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one_request(client, url, prompts[0], 8)  # warm-up
        started = time.perf_counter()
        await asyncio.gather(*(loop(client) for _ in range(clients)))
        return total / (time.perf_counter() - started)


def copied_share(prompt_ids: list[int], output_ids: list[int], run: int = 8) -> float:
    """Share of output tokens inside a run of >= ``run`` tokens that also occurs in the prompt."""
    grams = {tuple(prompt_ids[i:i + run]) for i in range(len(prompt_ids) - run + 1)}
    covered = [False] * len(output_ids)
    for i in range(len(output_ids) - run + 1):
        if tuple(output_ids[i:i + run]) in grams:
            covered[i:i + run] = [True] * run
    return sum(covered) / len(output_ids) if output_ids else 0.0


# ------------------------------------------------------------------------------------------ main
def run(args: argparse.Namespace) -> dict:
    sets = prompt_sets()
    if args.sets:
        sets = {name: sets[name] for name in args.sets}
    if args.quick:
        sets = {name: prompts[:2] for name, prompts in sets.items()}
    if args.per_request:
        return run_per_request(args, sets)
    binary = build_llama_server() if any(s.startswith("llama") for s in args.systems) else None
    single: dict[str, dict[str, list[dict]]] = {s: {name: [] for name in sets} for s in args.systems}
    busy: dict[str, dict[int, list[float]]] = {s: {c: [] for c in args.clients} for s in args.systems if s.startswith("cllm")}
    mixed = [p for name in ("copy", "chat") for p in sets.get(name, [])] or [p for ps in sets.values() for p in ps]
    drafted: dict[int, list[list[int]]] = {c: [] for c in args.clients}  # per round: [proposed, accepted]
    failures: list[str] = []
    for round_no in range(args.rounds):
        order = args.systems if round_no % 2 == 0 else list(reversed(args.systems))
        for system in order:
            server = start(system, args, binary)
            try:
                asyncio.run(one_stream(server.url, [CHAT[0]], 8))  # warm-up
                for name, prompts in sets.items():
                    try:
                        single[system][name] += asyncio.run(one_stream(server.url, prompts, args.max_tokens))
                    except httpx.HTTPError as err:  # llama-server's ngram-map-k has crashed on some prompts here
                        if not system.startswith("llama"):
                            raise
                        print(f"{system} failed on {name} ({err!r}); restarted", file=sys.stderr)
                        failures.append(f"round {round_no + 1}: {system} on {name}: {err!r}")
                        server.stop()
                        server = start(system, args, binary)
                for clients in args.clients if system in busy else []:
                    before = _spec_counters(server.url)
                    busy[system][clients].append(asyncio.run(closed_loops(server.url, mixed, clients,
                                                                          clients * args.busy_requests, args.busy_tokens)))
                    if system == "cllm-ngram":
                        drafted[clients].append([a - b for a, b in zip(_spec_counters(server.url), before)])
            except Exception:
                print(Path(server.log.name).read_text(errors="replace")[-2000:], file=sys.stderr)
                raise
            finally:
                server.stop()
            print(f"round {round_no + 1}: {system} done", file=sys.stderr, flush=True)
    if args.json:  # the raw results first: a summary that fails must not lose a quarter-hour run
        args.json.with_suffix(".raw.json").write_text(json.dumps({"single": single, "busy": busy}, indent=1))
    report = summarize(single, busy, sets)
    report["busy_drafts"] = {str(c): rounds for c, rounds in drafted.items()}
    report["failures"] = failures
    return report


def run_per_request(args: argparse.Namespace, sets: dict[str, list[str]]) -> dict:
    """``--per-request``: one ``cllm-ngram`` server per round; "cllm" are its requests sent with
    ``speculative: false``. Fresh servers of the same settings differ by 5-10 % in one-stream tok/s here
    (benchmarks/results/speculative_2026-11-29), which a few rounds of one server per system do not
    average out; requests on one server do not see it. The prefix cache is off there: the second request
    of a prompt would read it from the cache, which llama.cpp can round differently from computing it
    (issue 42), and then its greedy text, and how much of it copies the prompt, may differ."""
    single: dict[str, dict[str, list[dict]]] = {s: {name: [] for name in sets} for s in ("cllm", "cllm-ngram")}
    for round_no in range(args.rounds):
        server = start("cllm-ngram", args, None, ("--set", "prefix_cache=false"))
        try:
            asyncio.run(one_stream(server.url, [CHAT[0]], 8))  # warm-up
            for name, prompts in sets.items():
                off, on = asyncio.run(paired_stream(server.url, prompts, args.max_tokens, off_first=round_no % 2 == 0))
                single["cllm"][name] += off
                single["cllm-ngram"][name] += on
        except Exception:
            print(Path(server.log.name).read_text(errors="replace")[-2000:], file=sys.stderr)
            raise
        finally:
            server.stop()
        print(f"round {round_no + 1}: done", file=sys.stderr, flush=True)
    if args.json:
        args.json.with_suffix(".raw.json").write_text(json.dumps({"single": single}, indent=1))
    report = summarize(single, {}, sets)
    report["busy_drafts"], report["failures"] = {}, []
    return report


def _spec_counters(url: str) -> tuple[int, int]:
    """The server's draft tokens proposed and accepted so far (GET /v1/engine)."""
    stats = httpx.get(f"{url}/v1/engine", timeout=30).json()["stats"]
    return stats.get("spec_proposed_tokens", 0), stats.get("spec_accepted_tokens", 0)


def summarize(single: dict[str, dict[str, list[dict]]], busy: dict[str, dict[int, list[float]]],
              sets: dict[str, list[str]]) -> dict:
    table: dict[str, dict[str, float]] = {}
    for system, by_set in single.items():
        table[system] = {name: statistics.median(float(r["decode_tok_s"]) for r in results) if results else 0.0
                         for name, results in by_set.items()}
        table[system].update({f"{name}_ttft_ms": 1000 * statistics.median(float(r["ttft_s"]) for r in results)
                              for name, results in by_set.items() if results})
    llama_spec = [s for s in table if s.startswith("llama-ngram")]
    ratios: dict[str, dict[str, float]] = {}
    for name in sets:
        row: dict[str, float] = {}
        if "cllm-ngram" in table and "cllm" in table:
            row["vs_cllm_off"] = _ratio(table["cllm-ngram"][name], table["cllm"][name])
        if "cllm-ngram" in table and llama_spec:
            best = max(table[s][name] for s in llama_spec)
            row["llama_best"] = best
            row["vs_llama_best"] = _ratio(table["cllm-ngram"][name], best)
        if "cllm-ngram" in table and "llama" in table:
            row["vs_llama_off"] = _ratio(table["cllm-ngram"][name], table["llama"][name])
        ratios[name] = row
    concurrency = {str(c): {s: statistics.median(v[c]) for s, v in busy.items() if v[c]} for c in next(iter(busy.values()), {})}
    for row in concurrency.values():
        if "cllm" in row and "cllm-ngram" in row:
            row["ratio"] = row["cllm-ngram"] / row["cllm"]
    return {"one_stream_tok_s": table, "ratios": ratios, "concurrency_tok_s": concurrency,
            "texts": {s: {name: [r["text"] for r in results[: len(sets[name])]] for name, results in by.items()}
                      for s, by in single.items()}}


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0  # 0: the other system never finished this set (a crash in every round)


def add_copied(report: dict, model: str) -> None:
    """The copied share of cllm's outputs, per input-grounded set (tokenised with the model's tokenizer)."""
    from cllm.backends.llama_cpp.native import LlamaModelHandle
    from cllm.backends.llama_cpp.tokenizer import LlamaCppTokenizer

    handle = LlamaModelHandle(path=Path(model), n_gpu_layers=0, vocab_only=True)
    tok = LlamaCppTokenizer(model=handle)
    sets = prompt_sets()
    shares = {}
    for name in ("copy", "extract", "list"):
        texts = report["texts"].get("cllm", {}).get(name, [])
        values = [copied_share(tok.encode(p, add_special=False), tok.encode(t, add_special=False))
                  for p, t in zip(sets[name], texts)]
        shares[name] = statistics.mean(values) if values else 0.0
    report["copied_share"] = shares
    handle.close()


def print_table(report: dict) -> None:
    t = report["one_stream_tok_s"]
    systems = list(t)
    print("one stream, decode tok/s (median over prompts and rounds)")
    print(f"{'set':<8}" + "".join(f"{s:>20}" for s in systems) + f"{'ngram/off':>11}{'ngram/llama best':>18}")
    for name, r in report["ratios"].items():
        print(f"{name:<8}" + "".join(f"{t[s][name]:>20.1f}" for s in systems)
              + f"{r.get('vs_cllm_off', 0):>11.2f}{r.get('vs_llama_best', 0):>18.2f}")
    for clients, row in report["concurrency_tok_s"].items():
        drafts = report.get("busy_drafts", {}).get(clients, [])
        print(f"{clients} clients (copy + chat): " + ", ".join(f"{k} {v:.2f}" if k == "ratio" else f"{k} {v:.1f} tok/s"
                                                           for k, v in row.items())
              + (f"; cllm-ngram drafted {sum(d[0] for d in drafts)} tokens, kept {sum(d[1] for d in drafts)}" if drafts else ""))
    for failure in report.get("failures", []):
        print(f"failed (0.0 above where no round succeeded): {failure}")
    if "copied_share" in report:
        print("copied from the prompt (runs of >= 8 tokens): " + ", ".join(f"{k} {v:.0%}" for k, v in report["copied_share"].items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2-135M Q4_1)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--clients", type=int, nargs="*", default=[16, 64])
    p.add_argument("--max-tokens", type=int, default=192, help="max_tokens of the one-stream requests")
    p.add_argument("--busy-tokens", type=int, default=96, help="max_tokens of the concurrent requests")
    p.add_argument("--busy-requests", type=int, default=4,
                   help="requests per client at each concurrency level (2 left a round's ratio +-5 %% of noise)")
    p.add_argument("--ctx-per-slot", type=int, default=2048, help="KV cells per slot (the long set's prompts are ~1,000 tokens)")
    p.add_argument("--sets", nargs="+", default=None, help="prompt sets to run (default: all)")
    p.add_argument("--systems", nargs="+", default=[s for s in SYSTEMS if s != "cllm-ngram-b"], choices=SYSTEMS)
    p.add_argument("--b-set", action="append", default=[], metavar="NAME=VALUE",
                   help="settings of the cllm-ngram-b system (cllm-ngram with these --set), e.g. speculative_ngram_min=3")
    p.add_argument("--quick", action="store_true", help="two prompts per set")
    p.add_argument("--per-request", action="store_true",
                   help="one stream only, cllm-ngram against itself: each prompt sent with the request's speculative: "
                        "false and without, on one server per round (no fresh-server variance; see run_per_request)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    args.model = str(resolve_model_path(args.model))
    args.threads = args.threads or default_threads()
    started = time.time()
    report = run(args)
    add_copied(report, args.model)
    report["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    report["machine"] = {"load_average_end": os.getloadavg()[0], "wall_s": time.time() - started}
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

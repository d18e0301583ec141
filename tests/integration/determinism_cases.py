"""Shared by the determinism tests of both backends: one request run under different circumstances, and
what "the same answer" is compared on (its tokens, every logprob, every top alternative, as floats)."""
from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass

import cllm

# The request under test: a prompt of ~400 tokens, so that it is cut into many prefill chunks at n_batch
# 16, and its decode steps attend to more than 512 KV cells (where llama.cpp's kernels change path),
# greedy, with logprobs (and the top 5 alternatives) at every step.
TARGET = ("Here is a list of the planets of the solar system in order from the sun, with facts about each. "
          + " ".join(f"Fact {i}: {planet} has {i + 2} features worth knowing, and its year lasts {i * 37 + 88} days."
                     for i, planet in enumerate(["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus",
                                                 "Neptune"] * 2))
          + " In summary, the planet with the most moons is")
PARAMS = cllm.SamplingParams(max_tokens=24, temperature=0, logprobs=5, ignore_eos=True)
# The same request sampled with a seed: under the setting its draws are the same too.
SAMPLED = cllm.SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7, logprobs=5, ignore_eos=True)
# A copying task: the n-gram drafter finds its continuation in the prompt, so speculation verifies drafts.
COPY = ("Copy the list exactly. List: alpha one, beta two, gamma three, delta four, epsilon five, zeta six, "
        "eta seven, theta eight. Copy: alpha one, beta two,")


@dataclass(frozen=True)
class Trace:
    """What a request gave, compared bitwise: token ids, each token's logprob and the top alternatives."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]

    @classmethod
    def of(cls, out: cllm.RequestOutput) -> Trace:
        lps = out.outputs[0].logprobs
        return cls(tuple(out.outputs[0].token_ids), tuple(x.logprob for x in lps),
                   tuple(tuple((t.token_id, t.logprob) for t in x.top) for x in lps))

    def differences(self, other: Trace) -> int:
        """Steps whose token, logprob or alternatives differ at all (0: bitwise the same)."""
        return sum(a != b for a, b in zip(self._steps(), other._steps())) + abs(len(self.tokens) - len(other.tokens))

    def _steps(self) -> list[tuple]:
        return list(zip(self.tokens, self.logprobs, self.top))


def cases(*, deterministic: bool, base: dict, chunked: dict, preempting: dict | None = None) -> dict[str, Trace]:
    """The target's trace in every circumstance, and the references (alone, fresh engine): "alone",
    "copy alone" and "sampled alone" (see :func:`reference`). ``preempting``: settings under which four
    long prompts at once cannot all keep their KV (None: the backend never preempts for KV)."""
    got: dict[str, Trace] = {}
    with cllm.LLM(deterministic=deterministic, **base) as llm:
        got["alone"] = Trace.of(llm.generate([TARGET], PARAMS)[0])
        got["copy alone"] = Trace.of(llm.generate([COPY], PARAMS)[0])
        got["sampled alone"] = Trace.of(llm.generate([TARGET], SAMPLED)[0])
        for seed in (1, 2):
            got[f"beside 15 others (seed {seed})"] = batched(llm, TARGET, PARAMS, 15, seed)
        got["sampled beside 15 others"] = batched(llm, TARGET, SAMPLED, 15, 3)
        ids = llm.tokenizer.encode(TARGET)
        for length in (3, 17, len(ids) // 2, len(ids) - 1):
            trace, cached = after_prefix(llm, ids, length, seed=length)
            # (llama.cpp reuses any prefix; the torch backend whole blocks of 16 tokens)
            assert cached >= min(length, len(ids) - 1) - 16, f"no prefix-cache hit of {length} tokens (got {cached})"
            got[f"after a {length}-token prefix hit"] = trace
        assert llm.generate([COPY], PARAMS)[0].num_cached_tokens > 0
        got["copy again (cached)"] = Trace.of(llm.generate([COPY], PARAMS)[0])
    with cllm.LLM(deterministic=deterministic, **{**base, "n_threads": 1}) as llm:
        got["alone, 1 thread"] = Trace.of(llm.generate([TARGET], PARAMS)[0])
    with cllm.LLM(deterministic=deterministic, **chunked, **base) as llm:
        got["prefilled in chunks of 16"] = Trace.of(llm.generate([TARGET], PARAMS)[0])
    with cllm.LLM(deterministic=deterministic, speculative="ngram", **base) as llm:
        got["copy with speculation"] = Trace.of(llm.generate([COPY], PARAMS)[0])
        got["copy sampled with speculation"] = Trace.of(llm.generate([COPY], SAMPLED)[0])
        assert llm.engine.stats().spec_accepted_tokens > 0, "no draft was accepted: speculation was not exercised"
    with cllm.LLM(deterministic=deterministic, speculative="off", **base) as llm:
        got["copy without speculation"] = Trace.of(llm.generate([COPY], PARAMS)[0])
        got["copy sampled without speculation"] = Trace.of(llm.generate([COPY], SAMPLED)[0])
    if preempting is not None:
        with cllm.LLM(deterministic=deterministic, **{**base, **preempting}) as llm:
            # three long prompts whose outputs grow past the pool, then the target: the sequences admitted last
            # are preempted when the first ones need blocks, and recomputed
            longs = [f"Variant {i}. " + TARGET.replace("planets", f"{i} worlds") for i in range(3)] + [TARGET]
            grow = cllm.SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
            got["after preemptions"] = Trace.of(llm.generate(longs, [grow] * 3 + [PARAMS])[-1])
            assert llm.engine.stats().num_preemptions > 0, "nothing was preempted"
    got["streamed"] = streamed(lambda: cllm.AsyncLLM(deterministic=deterministic, **base), TARGET, PARAMS)
    return got


def assert_agree_within_rounding(got: dict[str, Trace], *, tol: float, tie: float) -> None:
    """The setting off: each greedy case keeps its reference's tokens, with logprobs within ``tol``, up to
    (if ever) a step where the reference's top two were within ``tie``. Sampled cases are not checked (a
    seeded draw may change wherever the probabilities move); how many steps differ bitwise is printed."""
    for name, t in got.items():
        if "sampled" in name:
            continue
        ref = got[reference(name)]
        for a, b, la, lb, top in zip(t.tokens, ref.tokens, t.logprobs, ref.logprobs, ref.top):
            if a != b:
                assert top[0][1] - top[1][1] <= tie, f"{name}: parted from {reference(name)} at a clear choice"
                break
            assert abs(la - lb) <= tol, f"{name}: logprob {la} against {lb}"
    print("deterministic off, steps differing bitwise:", {n: t.differences(got[reference(n)]) for n, t in got.items()})


def reference(name: str) -> str:
    """The trace a case is compared with: the same request alone in a fresh engine."""
    if name.startswith("copy sampled"):
        return "copy sampled without speculation"
    if name.startswith("copy"):
        return "copy alone"
    return "sampled alone" if name.startswith("sampled") else "alone"


def others(n: int, seed: int) -> list[tuple[str, cllm.SamplingParams]]:
    """``n`` unrelated requests of random lengths and sampling settings to batch the target with."""
    rng = random.Random(seed)
    words = "the of river mountain quickly seven blue code function night market silver ocean".split()
    reqs = []
    for _ in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 60)))
        params = cllm.SamplingParams(max_tokens=rng.randint(4, 30), temperature=rng.choice([0.0, 0.8]),
                                     seed=rng.randint(0, 1000), ignore_eos=True)
        reqs.append((text, params))
    return reqs


def batched(llm: cllm.LLM, prompt: str | list[int], params: cllm.SamplingParams, n_others: int, seed: int) -> Trace:
    """The target in one generate() call with ``n_others`` others, at a random place among them."""
    reqs = others(n_others, seed)
    at = random.Random(seed).randint(0, len(reqs))
    reqs.insert(at, (prompt, params))
    return Trace.of(llm.generate([p for p, _ in reqs], [q for _, q in reqs])[at])  # (outputs in input order)


def after_prefix(llm: cllm.LLM, prompt_ids: list[int], length: int, seed: int) -> tuple[Trace, int]:
    """The target after another request (batched with others) left its first ``length`` tokens in the
    prefix cache; with the number of prompt tokens the target found cached."""
    rng = random.Random(seed)
    tail = [rng.randrange(1000, 20000) for _ in range(rng.randint(1, 20))]
    reqs = others(3, seed) + [(prompt_ids[:length] + tail, cllm.SamplingParams(max_tokens=3, temperature=0))]
    llm.generate([p for p, _ in reqs], [q for _, q in reqs])
    out = llm.generate([prompt_ids], PARAMS)[0]
    return Trace.of(out), out.num_cached_tokens


def streamed(make: Callable[[], cllm.AsyncLLM], prompt: str, params: cllm.SamplingParams) -> Trace:
    """The target through AsyncLLM.generate, read as a stream."""
    async def main() -> Trace:
        engine = make()
        try:
            final = None
            async for final in engine.generate(prompt, params):
                pass
            return Trace.of(final)
        finally:
            await engine.shutdown()
    return asyncio.run(main())

"""How many draft tokens each sequence verifies this step: the batch's expected tokens per second decides.

A draft token at depth j of a sequence whose drafts are accepted with probability a adds a^j
expected output tokens (it counts only if every token before it is accepted) and makes the step one
token longer. Gains fall with depth, so the best plan of m draft tokens takes the m largest gains (a
heap yields them in order). The plan chosen is the m that maximises the step's expected tokens per
second, (E + gains) / T(tokens + m), with E the tokens the step emits for sure (one per sampling
sequence) and T the measured step cost (``StepCost``), plus a draft model's decode step per depth.
Every m is compared, not only the next one, because a step's cost can jump (on CUDA a pure decode
step replays a graph and a step with drafts runs eagerly: the first draft token is expensive, the
next ones nearly free). On a busy batch (E large, T growing with every token) m = 0 wins: no
sequence speculates.

Where drafts run apart (llama.cpp's split KV cache: ``Backend.drafts_run_apart``) and the step has
other sequences, each sequence that verifies k draft tokens adds a forward pass of its own, costing
about what a step of k tokens costs (``T(k)``): the step costs T(base) + the sum of T(k) over those
sequences. Counted by tokens alone (T(base + m)), 16 decoding sequences with 6 draft tokens among them
looked like a 22-token step (61 ms planned) and took 141 ms: n-gram speculation made a 16-client
server 17-27 % slower (benchmarks/vs_llama_server.py, workload a).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from cllm.speculative.step_cost import StepCost

# While the step cost is not yet measured at two token counts, each sequence verifies at most this
# many draft tokens, so that a measurement of a longer step comes.
EXPLORE_TOKENS = 4
MIN_GAIN = 0.02  # a draft token expected to add less than this is never planned
MAX_PLANNED = 512  # draft tokens a plan weighs at most (bounds the planning time of a large batch)


@dataclass(slots=True)
class Candidate:
    """One sequence that could speculate this step."""

    acceptance: float  # expected probability that its next draft token is accepted (0..1)
    limit: int  # most draft tokens it may take (proposal length, max_tokens, context)
    context: int = 0  # tokens its drafts attend to (what a pass of its own costs depends on it)
    take: int = 0  # the plan: draft tokens it verifies


def plan(candidates: list[Candidate], base_tokens: int, num_sampled: int, cost: StepCost, budget: int,
         depth_seconds: float = 0.0, *, apart: bool = False, context: int = 0) -> None:
    """Set each candidate's ``take``. ``base_tokens``: the step's tokens without drafts; ``num_sampled``:
    sequences that sample a token; ``budget``: most draft tokens in all; ``depth_seconds``: the extra
    cost of proposing one token deeper than any sequence so far (a draft model's decode step);
    ``apart``: each drafting sequence runs its drafts as a pass of its own when others share the step;
    ``context``: the step's longest context (steps are priced at it; a pass of its own at its sequence's)."""
    apart = apart and num_sampled > 1
    seconds = cost.seconds(base_tokens, context)
    if not seconds:  # unknown (or, for an empty step, 0): explore (one sequence only where each costs a pass)
        for c in candidates[:1] if apart else candidates:
            c.take = min(c.limit, EXPLORE_TOKENS, budget)
            budget -= c.take
        return
    expected, depth, depth_total, passes = float(num_sampled), 0, 0.0, 0.0
    best_rate, best_m = expected / seconds, 0
    taken: list[tuple[int, int]] = []  # (candidate, depth) in the order of falling gains
    heap = [(-c.acceptance, i, 1) for i, c in enumerate(candidates) if c.limit > 0 and c.acceptance > 0]
    heapq.heapify(heap)
    while heap and len(taken) < min(budget, MAX_PLANNED):
        neg_gain, i, j = heapq.heappop(heap)
        if -neg_gain < MIN_GAIN:
            break
        taken.append((i, j))
        expected -= neg_gain
        if j > depth:
            depth, depth_total = j, depth_total + depth_seconds
        if apart:  # its own pass grows from j - 1 to j tokens
            ctx = candidates[i].context
            passes += (cost.seconds(j, ctx) or seconds) - ((cost.seconds(j - 1, ctx) or 0.0) if j > 1 else 0.0)
            step = seconds + passes
        else:
            step = cost.seconds(base_tokens + len(taken), context) or seconds
        rate = expected / (step + depth_total)
        if rate > best_rate:
            best_rate, best_m = rate, len(taken)
        if j < candidates[i].limit:
            heapq.heappush(heap, (neg_gain * candidates[i].acceptance, i, j + 1))
    for i, j in taken[:best_m]:
        candidates[i].take = j

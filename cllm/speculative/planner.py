"""How many draft tokens each sequence verifies this step: the batch's expected tokens per second decides.

A draft token at depth j of a sequence whose drafts are accepted with probability a adds a^j
expected output tokens (it counts only if every token before it is accepted) and makes the step one
token longer. Adding it pays when it raises the step's expected tokens per second:
(E + a^j) / (T + dT) > E / T, i.e. a^j * T > dT * E, with E the tokens the step emits for sure (one
per sampling sequence) plus the gains taken so far, T the step's expected seconds and dT what one
more token costs (``StepCost``). Gains fall with depth, so taking the best one first (a heap) and
stopping at the first that does not pay is the optimum of this model. On a busy batch (E large and
dT close to T / tokens) nothing pays and no sequence speculates.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from cllm.speculative.step_cost import StepCost

# While the step cost is not yet measured at two token counts, each sequence verifies at most this
# many draft tokens, so that a measurement of a longer step comes.
EXPLORE_TOKENS = 4


@dataclass(slots=True)
class Candidate:
    """One sequence that could speculate this step."""

    acceptance: float  # expected probability that its next draft token is accepted (0..1)
    limit: int  # most draft tokens it may take (proposal length, max_tokens, context)
    take: int = 0  # the plan: draft tokens it verifies


def plan(candidates: list[Candidate], base_tokens: int, num_sampled: int, cost: StepCost, budget: int,
         depth_seconds: float = 0.0) -> None:
    """Set each candidate's ``take``. ``base_tokens``: the step's tokens without drafts; ``num_sampled``:
    sequences that sample a token; ``budget``: most draft tokens in all; ``depth_seconds``: the extra
    cost of proposing one token deeper than any sequence so far (a draft model's decode step)."""
    seconds = cost.seconds(base_tokens)
    if seconds is None:
        for c in candidates:
            c.take = min(c.limit, EXPLORE_TOKENS, budget)
            budget -= c.take
        return
    # ``forward``: the target's step alone (cost.seconds of its token count); ``seconds`` adds the draft
    # model's decode steps (depth_seconds per depth), which the next token's forward cost must not absorb.
    tokens, expected, depth, forward = base_tokens, float(num_sampled), 0, seconds
    heap = [(-c.acceptance, i, 1) for i, c in enumerate(candidates) if c.limit > 0 and c.acceptance > 0]
    heapq.heapify(heap)
    while heap and budget > 0:
        gain, i, j = -heap[0][0], heap[0][1], heap[0][2]
        longer = cost.seconds(tokens + 1)
        longer = forward if longer is None else longer
        extra = longer - forward + (depth_seconds if j > depth else 0.0)
        if gain * seconds <= extra * expected:
            return
        heapq.heappop(heap)
        c = candidates[i]
        c.take, tokens, seconds, expected, depth, budget = j, tokens + 1, seconds + extra, expected + gain, max(depth, j), budget - 1
        forward = longer
        if j < c.limit:
            heapq.heappush(heap, (-gain * c.acceptance, i, j + 1))

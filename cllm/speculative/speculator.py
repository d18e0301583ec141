"""The engine's speculative decoding: proposals, the per-step plan, acceptance bookkeeping, counters."""
from __future__ import annotations

from dataclasses import dataclass

from cllm.backends.base import Backend
from cllm.config import CllmConfig, SpeculativeConfig
from cllm.request import Request
from cllm.scheduler.output import ScheduledChunk, SchedulerOutput
from cllm.speculative.draft_model import DraftModel
from cllm.speculative.ngram import NgramIndex
from cllm.speculative.planner import Candidate, plan
from cllm.speculative.step_cost import StepCost

# A sequence's acceptance rate starts as the engine's recent rate (PRIOR_TRIALS trials' worth) and then
# follows its own recent steps (older ones weigh DECAY less each step), so a sequence that leaves the
# text it was copying stops speculating within a few steps, and one that starts copying is tried again.
# The engine's rate (all sequences' verifications, older ones weighing ENGINE_DECAY less each) starts
# at FIRST_PRIOR: on a server copying documents a new request drafts deep from its first match, where a
# fixed prior of one half ramped it up over several steps (most of a 50-token copy).
# The engine's record fades by FORGET with each new sequence too, towards FIRST_PRIOR (one trial's
# worth, always counted): otherwise a server whose first drafts happened to fail started every later
# sequence too cautious to draft, and with no drafts the record never changed again (an A/B of one
# client on random prompts: 4 draft tokens in 8 requests, where another start drafted 137 and kept 110).
FIRST_PRIOR = 0.5
PRIOR_TRIALS = 1.0
DECAY = 0.7
ENGINE_DECAY = 0.95
FORGET = 0.8
MAX_ACCEPTANCE = 0.995  # never certain: keeps the expected gain of a deep draft token below 1
REST_STEPS = 16  # steps a batch size whose plan found nothing worth drafting is not planned again
# A sequence's drafts are at most ``depth`` tokens deep: FIRST_DEPTH at first, doubled each time a whole
# draft is accepted, cut to twice the accepted tokens (at least 1) when one is rejected. Acceptance on
# free text is bursty (a phrase repeats, then the model goes elsewhere): the per-token rate alone planned
# 7-token drafts on chat prompts that kept 38 % of them (benchmarks/speculative.py: chat 0.95x of no
# speculation; 1.00x with this rule). The first draft may be 12 deep: the planner still prices each of
# its tokens by the sequence's expected acceptance (the engine's recent rate), so on free text it takes
# few; at 4 a copying sequence spent three short steps (4, 8, 16) reaching full depth. Replayed on the
# embedded model with each step priced by the measured step-cost curve (benchmarks/spec_policy.py),
# 4 -> 12 raised the mean one-stream rate by 17 % on copy, 8 % on extract, 6 % on list, chat -0.3 %.
FIRST_DEPTH = 12  # and, after a wholly accepted draft, at least this deep again
# After a rejection the depth is cut to twice the accepted tokens, but never below RETRY_DEPTH. At 1 it
# could never grow again where a step's first extra token is dear: on the AVX-512/BF16 EPYC (flash
# attention on) a 2-token step cost 18 ms against 8 for 1 token, a 5-token one 27 ms; a 1-token draft
# never paid, so the plan took nothing, the depth only grows after an accepted draft, and a copying
# sequence whose draft was cut once (a changed word) never drafted again: 4 verifications in 70 tokens.
# In-process A/B on the copy set (2 rounds x 4 prompts, medians, noisy by ~10 %): floor 1: 1.38x of no
# speculation, 4: 1.44x, 8: 1.70x, 12: 1.50x; code 0.99x, chat 1.00x with 12 (served, with 8: code 0.98x,
# chat 1.17x, benchmarks/results/speculative_epyc_avx512_2026-11-27). The planner still prices
# every token by the sequence's acceptance, so on free text a deeper limit is taken only where it pays.
RETRY_DEPTH = 8


@dataclass(slots=True)
class _Sequence:
    """What the speculator keeps per request."""

    ngrams: NgramIndex | None  # prompt-lookup index (ngram method)
    prior: float  # the engine's acceptance rate when the sequence started
    depth: int  # most draft tokens it verifies next (see FIRST_DEPTH)
    accepted: float = 0.0  # decayed count of accepted draft tokens
    trials: float = 0.0  # decayed count of draft positions tried (accepted ones + the first rejected)

    def rest(self) -> None:
        """A step considered: the record fades towards the prior (a sequence that failed is tried again
        once its failures are a few steps old; one that keeps succeeding refreshes them)."""
        self.accepted *= DECAY
        self.trials *= DECAY

    @property
    def acceptance(self) -> float:
        return min(MAX_ACCEPTANCE, (self.accepted + self.prior * PRIOR_TRIALS) / (self.trials + PRIOR_TRIALS))


@dataclass(slots=True)
class SpeculationStats:
    """Counters since start (``/metrics``, ``/v1/engine``)."""

    proposed_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # of those, kept
    verify_steps: int = 0  # sequence-steps that verified at least one draft token
    emitted_tokens: int = 0  # tokens those sequence-steps produced (accepted + the target's own next)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0


class Speculator:
    """Decides, per step, which decoding sequences verify draft tokens and which tokens."""

    def __init__(self, config: SpeculativeConfig, *, draft_model: DraftModel | None = None,
                 drafts_run_apart: bool = False) -> None:
        self.method = "draft" if draft_model is not None else "ngram"
        self._apart = drafts_run_apart  # the backend's Backend.drafts_run_apart
        self.max_tokens = config.num_speculative_tokens
        self._n_range = (config.speculative_ngram_min, config.speculative_ngram_max)
        self._draft = draft_model
        self._sequences: dict[str, _Sequence] = {}
        self._resting: dict[int, int] = {}  # batch-size class (bit length of sampling sequences) -> steps to skip
        self.cost = StepCost()
        self.stats = SpeculationStats()
        self._engine_accepted = 0.0  # decayed counts over all sequences (see ENGINE_DECAY, FORGET)
        self._engine_trials = 0.0

    def propose(self, out: SchedulerOutput, budget: int, max_model_len: int) -> list[tuple[ScheduledChunk, list[int]]]:
        """Draft tokens for this step's decodes, at most ``budget`` in all: [(chunk, draft)].

        First a plan as if every decode had a full draft: if even that adds nothing at this batch size
        (a busy batch), nothing is proposed for the next REST_STEPS steps of this size, so a large batch
        pays for the question once in REST_STEPS steps. Otherwise proposals, and the plan over them."""
        num_sampled = sum(1 for c in out.chunks if c.sample)
        size = num_sampled.bit_length()
        if self._resting.get(size, 0) > 0:
            self._resting[size] -= 1
            return []
        chunks = [c for c in out.chunks if c.sample and c.num_tokens == 1 and _may_speculate(c.request)]
        if not chunks or budget <= 0:
            return []
        limits = [min(self.max_tokens, c.request.max_tokens - len(c.request.output_token_ids) - 1,
                      max_model_len - c.request.num_tokens - 1) for c in chunks]
        if max(limits) <= 0:  # every decode at its last token: no verdict on this batch size (no rest)
            return []
        seqs = [self._sequence(c.request) for c in chunks]
        limits = [min(limit, seq.depth) for limit, seq in zip(limits, seqs)]
        depth_seconds = self._draft.step_seconds() if self._draft is not None else 0.0
        context = step_context(out.chunks)
        upper = [Candidate(seq.acceptance, limit, c.request.num_tokens) for c, seq, limit in zip(chunks, seqs, limits)]
        plan(upper, out.num_tokens, num_sampled, self.cost, budget, depth_seconds, apart=self._apart, context=context)
        for seq in seqs:  # considered, drafting or not: a sequence whose drafts failed is tried again later
            seq.rest()
        if not any(c.take for c in upper):
            self._resting[size] = REST_STEPS
            return []
        if self._draft is not None:
            wanted = [(c.request, cand.take) for c, cand in zip(chunks, upper) if cand.take > 0]
            drafted = self._draft.propose(wanted)
            return [(c, drafted[c.request.request_id]) for c in chunks if drafted.get(c.request.request_id)]
        proposals: list[tuple[ScheduledChunk, list[int]]] = []
        candidates: list[Candidate] = []
        for c, seq, limit in zip(chunks, seqs, limits):
            tokens = seq.ngrams.propose(c.request.prompt_token_ids, limit, c.request.output_token_ids) if limit > 0 else []
            if tokens:
                proposals.append((c, tokens))
                candidates.append(Candidate(seq.acceptance, len(tokens), c.request.num_tokens))
        plan(candidates, out.num_tokens, num_sampled, self.cost, budget, depth_seconds, apart=self._apart,
             context=context)
        chosen = [(c, tokens[:cand.take]) for (c, tokens), cand in zip(proposals, candidates) if cand.take > 0]
        if not chosen:  # nothing to copy now: look again after a few steps (fewer for a small batch)
            self._resting[size] = min(REST_STEPS, num_sampled)
        return chosen

    def _sequence(self, req: Request) -> _Sequence:
        seq = self._sequences.get(req.request_id)
        if seq is None:
            ngrams = NgramIndex(*self._n_range) if self.method == "ngram" else None
            self._engine_accepted *= FORGET
            self._engine_trials *= FORGET
            prior = (self._engine_accepted + FIRST_PRIOR) / (self._engine_trials + 1.0)
            seq = self._sequences[req.request_id] = _Sequence(ngrams, prior, FIRST_DEPTH)
        return seq

    def observe_step(self, chunks: list[ScheduledChunk], seconds: float) -> None:
        """A decode step's chunks and its time from the forward's start to its sampled tokens. Where drafts
        run apart, a step in which several sequences verified drafts ran several forward passes: it says
        nothing of one pass's cost by its tokens, which the planner adds up per pass."""
        if self._apart and len(chunks) > 1 and any(c.draft for c in chunks):
            return
        self.cost.observe(sum(c.num_tokens for c in chunks), seconds, step_context(chunks))

    def verified(self, req: Request, proposed: int, accepted: int, emitted: int) -> None:
        """The outcome of one sequence's verification: ``accepted`` of ``proposed`` kept, ``emitted`` tokens out."""
        seq = self._sequences.get(req.request_id)
        trials = accepted + (1 if accepted < proposed else 0)
        if seq is not None:
            seq.accepted += accepted
            seq.trials += trials
            if accepted == proposed:
                seq.depth = min(self.max_tokens, max(2 * proposed, FIRST_DEPTH))
            else:
                seq.depth = max(RETRY_DEPTH, 2 * accepted)
        self._engine_accepted = self._engine_accepted * ENGINE_DECAY + accepted
        self._engine_trials = self._engine_trials * ENGINE_DECAY + trials
        s = self.stats
        s.proposed_tokens += proposed
        s.accepted_tokens += accepted
        s.verify_steps += 1
        s.emitted_tokens += emitted
        if self._draft is not None:
            self._draft.sync(req)

    def remove(self, request_id: str) -> None:
        """The request left the engine (finished, handed off): forget it."""
        self._sequences.pop(request_id, None)
        if self._draft is not None:
            self._draft.release(request_id)

    def close(self) -> None:
        if self._draft is not None:
            self._draft.close()


def step_context(chunks: list[ScheduledChunk]) -> int:
    """The longest context among a step's sequences, its drafts included (what its cost is priced at)."""
    return max((c.start + c.num_tokens for c in chunks), default=0)


def _may_speculate(req: Request) -> bool:
    return req.params.speculative and not req.needs_prompt_logits


def create_speculator(config: CllmConfig, backend: Backend) -> Speculator | None:
    """The engine's speculator, or None where speculative decoding is off or the backend cannot roll
    back KV. A draft model runs on a second backend of the same kind, with this config's other settings."""
    sc = config.speculative
    method = sc.speculative
    if method == "auto":  # on only where it was measured never to lose (docs/speculative.md): llama.cpp
        method = "ngram" if config.model.backend == "llama_cpp" else "off"
    if method == "off" or not backend.supports_speculation:
        return None
    draft = None
    if method == "draft":
        from cllm.backends.registry import create_backend

        draft_config = config.with_overrides(model=sc.speculative_model, speculative="off")
        draft = DraftModel(create_backend(draft_config), vocab_size=backend.tokenizer.vocab_size)
    return Speculator(sc, draft_model=draft, drafts_run_apart=backend.drafts_run_apart)

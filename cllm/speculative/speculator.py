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

# A sequence's acceptance rate is its own recent record (older steps weigh DECAY less each step) on top of
# a prior worth PRIOR_TRIALS trials: the engine's recent rate for drafts of the same kind, so a sequence
# that leaves the text it was copying stops speculating within a few steps, and one that starts copying
# is tried again. The kind of an n-gram draft is the length of the match it follows: on the embedded
# model a 2-token match (", beta") is a guess where a 4-token one is usually a copy, and one record for
# both let the first failed 2-gram draft of a server keep every later draft from being tried (issue 45).
# Each kind's record (all sequences' verifications of it, older ones weighing ENGINE_DECAY less each)
# starts at FIRST_PRIOR: on a server copying documents a new request drafts deep from its first match,
# where a fixed prior of one half ramped it up over several steps (most of a 50-token copy).
# The records fade by FORGET with each new sequence too, towards FIRST_PRIOR (one trial's worth, always
# counted): otherwise a server whose first drafts happened to fail started every later sequence too
# cautious to draft, and with no drafts the record never changed again (an A/B of one client on random
# prompts: 4 draft tokens in 8 requests, where another start drafted 137 and kept 110).
FIRST_PRIOR = 0.5
PRIOR_TRIALS = 1.0
DECAY = 0.7
ENGINE_DECAY = 0.95
FORGET = 0.8
# A kind of n-gram draft with less than EXPLORED_TRIALS trials on record (never tried, or its trials faded)
# is explored: a sequence with no recent rejection of its own prices such a draft as if EXPLORE_ACCEPTANCE
# of its tokens were accepted, for at most EXPLORE_TOKENS tokens, and the plan takes it where that would
# pay. Priced at FIRST_PRIOR, no draft pays where a step's first extra token is dear (the AVX-512/BF16
# EPYC: a 2-token step 1.9x a 1-token one, so one sequence needs ~75 % acceptance): a kind whose first
# try failed, or was never tried once the step cost was known, was never tried again. Exploring costs
# one rejected EXPLORE_TOKENS draft per kind, again after a few new sequences (FORGET). A kind not yet
# explored is priced at least at the rate of a shorter kind that was: a longer match is the more specific
# one, so where 2-token matches are being copied, a first 3-token match is not explored 4 tokens at a time
# (a fresh server's first copy went 4, 4, 11 tokens a draft: a 2-, a 3-, then a 4-token match).
EXPLORED_TRIALS = 0.5
EXPLORE_ACCEPTANCE = 0.9
EXPLORE_TOKENS = 4
MAX_ACCEPTANCE = 0.995  # never certain: keeps the expected gain of a deep draft token below 1
REST_STEPS = 16  # steps a batch size whose plan found nothing worth drafting is not planned again
# In a batch of at most 2**FRESH_LOOK_CLASS - 1 sampling sequences a rest ends when a new sequence joins:
# there the verdict was the old sequences' own records (a failed copy), not the batch's cost, and carried
# over it kept one stream's next request from drafting for the rest of 16 steps (served copy set: 7 plain
# steps at the start of a copying request that followed one which left its passage).
FRESH_LOOK_CLASS = 2
# A sequence's drafts are at most ``depth`` tokens deep: FIRST_DEPTH at first, doubled each time a whole
# draft is accepted, cut to twice the accepted tokens (at least 1) when one is rejected. Acceptance on
# free text is bursty (a phrase repeats, then the model goes elsewhere): the per-token rate alone planned
# 7-token drafts on chat prompts that kept 38 % of them (benchmarks/speculative.py: chat 0.95x of no
# speculation; 1.00x with this rule). The first draft may be FIRST_DEPTH deep: the planner prices each of
# its tokens by the sequence's expected acceptance (the engine's recent rate), so on free text it takes
# few; at 4 a copying sequence spent three short steps (4, 8, 16) reaching full depth. Replayed on the
# embedded model with each step priced by the measured step-cost curve (benchmarks/spec_policy.py),
# 4 -> 12 raised the mean one-stream rate by 17 % on copy, 8 % on extract, 6 % on list, chat -0.3 %.
# 12 -> 8 (2026-11-29): replayed on identical text (spec_policy.py --deterministic) copy +3-7 %, the rest
# level; served, 13 alternating rounds of a fresh server's copy then chat requests (speculative.py
# --per-request): copy 2.10x -> 2.25x, chat after copy 0.96x -> 0.98x of no speculation (a failed first
# draft of a chat phrase costs 9 tokens' step, not 13: on the AVX-512/BF16 EPYC 32 against 40 ms).
FIRST_DEPTH = 8  # and, after a wholly accepted draft, at least this deep again
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
class _Record:
    """Decayed counts of draft positions tried (accepted ones + the first rejected) and accepted."""

    accepted: float = 0.0
    trials: float = 0.0

    def fade(self, factor: float) -> None:
        self.accepted *= factor
        self.trials *= factor

    def add(self, accepted: int, trials: int) -> None:
        self.accepted += accepted
        self.trials += trials

    def rate(self, prior: float, weight: float) -> float:
        """The acceptance rate with ``prior`` counted as ``weight`` trials."""
        return (self.accepted + prior * weight) / (self.trials + weight)


@dataclass(slots=True)
class _Sequence:
    """What the speculator keeps per request."""

    ngrams: NgramIndex | None  # prompt-lookup index (ngram method)
    depth: int  # most draft tokens it verifies next (see FIRST_DEPTH)
    record: _Record  # its own verifications (see DECAY)
    kind: int  # the kind of its last proposal (the n-gram match length; 0 for a draft model)

    def rest(self) -> None:
        """A step considered: the record fades towards the prior (a sequence that failed is tried again
        once its failures are a few steps old; one that keeps succeeding refreshes them)."""
        self.record.fade(DECAY)

    @property
    def rejected_lately(self) -> bool:
        """Its recent rejections (decayed) still weigh half a trial or more: it does not explore (EXPLORED_TRIALS)."""
        return self.record.trials - self.record.accepted >= EXPLORED_TRIALS


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
        # the engine's record per kind of draft (see FIRST_PRIOR): n-gram match lengths, or 0 for a draft model
        kinds = range(self._n_range[0], self._n_range[1] + 1) if draft_model is None else [0]
        self._kinds = {kind: _Record() for kind in kinds}

    def prior(self, kind: int) -> float:
        """The engine's recent acceptance rate of drafts of ``kind``; for a kind not explored yet, at least
        that of a shorter kind that was (see EXPLORED_TRIALS)."""
        rate = self._kinds[kind].rate(FIRST_PRIOR, 1.0)
        if self.explored(kind):
            return rate
        shorter = (record.rate(FIRST_PRIOR, 1.0) for k, record in self._kinds.items() if k < kind and self.explored(k))
        return max([rate, *shorter])

    def acceptance(self, seq: _Sequence, prior: float, explore: bool = False) -> tuple[float, int]:
        """The expected acceptance of ``seq``'s next draft, whose kind's record gives ``prior``, and the
        most tokens it is worth: ``max_tokens``, or EXPLORE_TOKENS where the draft would ``explore`` its
        kind (see EXPLORED_TRIALS; n-gram drafts only: a draft model's tokens cost its own decode steps)."""
        rate = min(MAX_ACCEPTANCE, seq.record.rate(prior, PRIOR_TRIALS))
        if explore and rate < EXPLORE_ACCEPTANCE and self._draft is None:
            return EXPLORE_ACCEPTANCE, EXPLORE_TOKENS
        return rate, self.max_tokens

    def explored(self, kind: int) -> bool:
        return self._kinds[kind].trials >= EXPLORED_TRIALS

    def propose(self, out: SchedulerOutput, budget: int, max_model_len: int) -> list[tuple[ScheduledChunk, list[int]]]:
        """Draft tokens for this step's decodes, at most ``budget`` in all: [(chunk, draft)].

        First a plan as if every decode had a full draft of its most promising kind: if even that adds
        nothing at this batch size (a busy batch), nothing is proposed for the next REST_STEPS steps of
        this size, so a large batch pays for the question once in REST_STEPS steps (a small one until a
        new sequence joins: FRESH_LOOK_CLASS). Otherwise proposals, and the plan over them."""
        num_sampled = sum(1 for c in out.chunks if c.sample)
        size = num_sampled.bit_length()
        if self._resting.get(size, 0) > 0:
            if size > FRESH_LOOK_CLASS or not any(self._joined(c) for c in out.chunks):
                self._resting[size] -= 1
                return []
            self._resting[size] = 0
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
        best_prior, all_explored = max(map(self.prior, self._kinds)), all(map(self.explored, self._kinds))
        upper = []
        for c, seq, limit in zip(chunks, seqs, limits):
            rate, most = self.acceptance(seq, best_prior, not all_explored)  # (a rejection fades while it rests)
            upper.append(Candidate(rate, min(limit, most), c.request.num_tokens))
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
                seq.kind = seq.ngrams.matched
                explore = not self.explored(seq.kind) and not seq.rejected_lately
                rate, most = self.acceptance(seq, self.prior(seq.kind), explore)
                proposals.append((c, tokens))
                candidates.append(Candidate(rate, min(len(tokens), most), c.request.num_tokens))
        plan(candidates, out.num_tokens, num_sampled, self.cost, budget, depth_seconds, apart=self._apart,
             context=context)
        chosen = [(c, tokens[:cand.take]) for (c, tokens), cand in zip(proposals, candidates) if cand.take > 0]
        if not chosen:  # nothing to copy now: look again after a few steps (fewer for a small batch)
            self._resting[size] = min(REST_STEPS, num_sampled)
        return chosen

    def _joined(self, chunk: ScheduledChunk) -> bool:
        """A decode of a sequence that may speculate and was never considered."""
        return (chunk.sample and chunk.num_tokens == 1 and chunk.request.request_id not in self._sequences
                and _may_speculate(chunk.request))

    def _sequence(self, req: Request) -> _Sequence:
        seq = self._sequences.get(req.request_id)
        if seq is None:
            ngrams = NgramIndex(*self._n_range) if self.method == "ngram" else None
            for record in self._kinds.values():
                record.fade(FORGET)
            seq = self._sequences[req.request_id] = _Sequence(ngrams, FIRST_DEPTH, _Record(), min(self._kinds))
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
            seq.record.add(accepted, trials)
            if accepted == proposed:
                seq.depth = min(self.max_tokens, max(2 * proposed, FIRST_DEPTH))
            else:
                seq.depth = max(RETRY_DEPTH, 2 * accepted)
            kind = self._kinds[seq.kind]
            kind.fade(ENGINE_DECAY)
            kind.add(accepted, trials)
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

"""A user request and its n choices: text state per choice, and the outputs built from it."""
from __future__ import annotations

from cllm.backends.base import Tokenizer
from cllm.detokenizer import IncrementalDetokenizer
from cllm.outputs import CompletionOutput, RequestOutput, TokenLogprob, TopLogprob, Usage
from cllm.request import FIRST_FINAL, Request
from cllm.sampling.sampler import SampledToken


class RequestGroup:
    """One user request: ``n`` child sequences sharing a prompt.

    Turns sampled tokens into text (stop strings cut), and builds the
    RequestOutput handed to callers, with per-choice deltas since the last one.
    """

    def __init__(self, group_id: str, prompt: str | None, children: list[Request], tokenizer: Tokenizer) -> None:
        self.group_id = group_id
        self.prompt = prompt
        self.children = children
        self._tokenizer = tokenizer
        self._detoks = [
            IncrementalDetokenizer(tokenizer, stop=c.params.stop, include_stop=c.params.include_stop_str_in_output,
                                   skip_special_tokens=c.params.skip_special_tokens, end_ids=_end_ids(c))
            for c in children
        ]
        self._sent_tokens = [0] * len(children)
        self._sent_logprobs = [0] * len(children)

    @property
    def token_out(self) -> bool:
        """An output with a token has been made (LLMEngine.hold_outputs holds none before)."""
        return any(self._sent_tokens)

    @property
    def finished(self) -> bool:
        children = self.children
        return children[0].status.is_finished if len(children) == 1 else all(c.status.is_finished for c in children)

    def on_token(self, index: int, sampled: SampledToken) -> str | None:
        """Record a child's new token; returns a stop string it completed, if any."""
        child = self.children[index]
        params = child.params
        if params.logprobs is not None:
            child.output_logprobs.append(self._logprob(sampled, self._detoks[index].text_length))
        # min_tokens holds stop strings back as it holds back EOS and stop token ids.
        return self._detoks[index].add_token(sampled.token_id,
                                             check_stop=len(child.output_token_ids) >= params.min_tokens)

    def _logprob(self, s: SampledToken, text_offset: int) -> TokenLogprob:
        tok = self._tokenizer
        top = [TopLogprob(t, tok.decode([t]), lp, list(tok.token_bytes(t))) for t, lp in zip(s.top_ids, s.top_logprobs)]
        return TokenLogprob(s.token_id, tok.decode([s.token_id]), s.logprob or 0.0, list(tok.token_bytes(s.token_id)),
                            top, text_offset)

    def replay(self) -> None:
        """A group continued after a hand-off: rebuild each choice's text from the tokens it already
        has, counted as sent (the exporting engine's caller got them); stops were checked there."""
        for i, child in enumerate(self.children):
            for token in child.output_token_ids:
                self._detoks[i].add_token(token, check_stop=False)
            self._detoks[i].take_delta()
            self._sent_tokens[i] = len(child.output_token_ids)
            self._sent_logprobs[i] = len(child.output_logprobs)

    def make_output(self) -> RequestOutput:
        """The group's state now, with deltas since the previous call.

        Streamed (unfinished) outputs are deltas: new text, token ids and logprobs only, and their
        ``token_ids`` / ``logprobs`` are empty (and ``text``, until the choice ends: it is joined from
        the detokenizer's pieces); the final output carries the whole of them as well.
        Nothing per step is proportional to the prompt or the output so far (a copy of both per token
        and request was most of the engine's time at 256 streams). ``prompt_token_ids`` and a complete
        ``prompt_logprobs`` are the request's own lists, shared: read-only for callers."""
        first = self.children[0]
        if len(self.children) == 1:  # n = 1, nearly every request: one lean path (a third of a 256-row step)
            finished = first.status >= FIRST_FINAL
            choices = [self._choice(0, finished)]
            completion, error = len(first.output_token_ids), first.error
        else:
            finished = self.finished
            choices = [self._choice(i, finished) for i in range(len(self.children))]
            completion = sum(c.num_output_tokens for c in self.children)
            error = next((c.error for c in self.children if c.error), None)
        usage = Usage(len(first.prompt_token_ids), completion, first.num_cached_tokens or 0)
        prompt_logprobs = None
        if first.scores_prompt and not first.needs_prompt_logits:
            prompt_logprobs = first.prompt_logprobs  # complete: never appended to again
        return RequestOutput(self.group_id, self.prompt, first.prompt_token_ids, choices,
                             finished, usage, first.metrics, error, prompt_logprobs)

    def plain_delta(self) -> tuple[str, list[int], int, int] | None:
        """make_output's news for the commonest output, without building it: one choice still running,
        no logprobs, no prompt scored: (text delta, token ids delta, completion tokens, cached tokens); None
        for any other group (make_output then). The engine core's flush at 256 streams made and packed 256
        outputs in ~1.1 ms (the step's host time is ~2.5 ms against a 5 ms device step), this ~0.3 ms."""
        if len(self.children) != 1:
            return None
        child = self.children[0]
        if (child.status >= FIRST_FINAL or child.params.logprobs is not None or child.scores_prompt
                or child.stop_reason is not None or child.error):
            return None
        tokens = child.output_token_ids
        new_tokens = tokens[self._sent_tokens[0]:]
        self._sent_tokens[0] = len(tokens)
        return self._detoks[0].take_delta(), new_tokens, len(tokens), child.num_cached_tokens or 0

    def _choice(self, i: int, group_finished: bool) -> CompletionOutput:
        child, detok = self.children[i], self._detoks[i]
        status = child.status
        done = status >= FIRST_FINAL  # (RequestStatus.is_finished, without a property call per token)
        if done:
            detok.finish()
        tokens = child.output_token_ids
        new_tokens = tokens[self._sent_tokens[i]:]
        self._sent_tokens[i] = len(tokens)
        if child.params.logprobs is None:
            return CompletionOutput(  # positional: half the time of keywords, for every token of every stream
                i, detok.text if done else "", list(tokens) if group_finished else [],
                status.finish_reason if done else None, child.stop_reason, None, detok.take_delta(), new_tokens)
        logprobs = child.output_logprobs
        new_logprobs = logprobs[self._sent_logprobs[i]:]
        self._sent_logprobs[i] = len(logprobs)
        return CompletionOutput(i, detok.text if done else "", list(tokens) if group_finished else [],
                                status.finish_reason if done else None, child.stop_reason,
                                list(logprobs) if group_finished else None, detok.take_delta(), new_tokens, new_logprobs)


def _end_ids(child: Request) -> frozenset[int]:
    """The tokens that end the child's output (shown by no skip_special_tokens setting)."""
    params = child.params
    return frozenset(params.stop_token_ids) if params.ignore_eos else child.stop_ids

"""Prompt logprobs: score each prompt token under the logits of the position before it, chunk by chunk.

The backend returns a logits row for every token of a prefill chunk when asked
(``forward_batch(..., all_logits_for=...)``). The row at position p is the
model's distribution for the token at p + 1, so a chunk covering positions
s..e-1 scores prompt tokens s+1..e (those still inside the prompt); the first
prompt token has no context and is scored None, as in OpenAI's echo and vLLM.
Scoring appends to ``Request.prompt_logprobs`` strictly in order, so a chunk
evaluated again (recompute after preemption) adds nothing twice. The values
are the raw model distribution: no bias, penalty or temperature applies.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from cllm.backends.base import Tokenizer
from cllm.outputs import TokenLogprob, TopLogprob
from cllm.request import Request


def score_prompt_chunk(req: Request, start: int, rows: Any, tokenizer: Tokenizer) -> None:
    """Record the prompt logprobs that ``rows`` (logits of positions start.., one per chunk token; numpy,
    or a torch tensor from a backend that samples on its device) give."""
    prompt = req.prompt_token_ids
    if start == 0 and not req.prompt_logprobs:
        req.prompt_logprobs.append(None)
    first = len(req.prompt_logprobs) - 1  # position whose row scores the next unscored token
    last = min(start + len(rows), len(prompt) - 1)  # one past the last useful position
    if first < start or first >= last:
        return
    useful = rows[first - start:last - start]
    if not isinstance(useful, np.ndarray):  # a device tensor: the scores are built on the host
        useful = useful.float().cpu().numpy()
    logprobs = _log_softmax(useful.astype(np.float32))
    k = req.params.prompt_logprobs or 0
    for i, lp in enumerate(logprobs):
        req.prompt_logprobs.append(_entry(prompt[first + 1 + i], lp, k, tokenizer))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    z = x - x.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _entry(token_id: int, lp: np.ndarray, k: int, tokenizer: Tokenizer) -> TokenLogprob:
    top: list[TopLogprob] = []
    if k:
        ids = np.argpartition(lp, -k)[-k:]
        ids = ids[np.argsort(-lp[ids], kind="stable")]
        top = [TopLogprob(int(t), tokenizer.decode([int(t)]), float(lp[t]), list(tokenizer.token_bytes(int(t))))
               for t in ids]
    return TokenLogprob(token_id, tokenizer.decode([token_id]), float(lp[token_id]),
                        list(tokenizer.token_bytes(token_id)), top)

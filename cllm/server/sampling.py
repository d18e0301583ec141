"""Turn an OpenAI request's sampling fields into SamplingParams, enforcing server caps."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cllm.sampling.params import SamplingParams
from cllm.server.errors import APIError, bad_request, param_from_message
from cllm.server.protocol import GenerationRequest


@dataclass(slots=True, frozen=True)
class RequestLimits:
    """Server-side caps a request is checked against (ServerConfig plus the model's vocabulary)."""

    max_tokens_limit: int  # largest max_tokens a request may ask for
    max_n: int  # largest n
    vocab_size: int  # token ids must be below this


def _parse_logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    bias: dict[int, float] = {}
    for key, value in (raw or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"invalid logit_bias key {key!r}: keys must be token ids", param="logit_bias") from None
        bias[token] = value
    return bias


def _check_caps(req: GenerationRequest, max_tokens: int | None, limits: RequestLimits) -> None:
    n = 1 if req.n is None else req.n
    if n > limits.max_n:
        raise bad_request(f"invalid n={n}: this server allows at most {limits.max_n}", param="n")
    if max_tokens is not None and max_tokens > limits.max_tokens_limit:
        raise bad_request(
            f"invalid max_tokens={max_tokens}: this server allows at most {limits.max_tokens_limit}", param="max_tokens"
        )


def build_sampling_params(
    req: GenerationRequest, *, max_tokens: int | None, logprobs: int | None, limits: RequestLimits,
    constraint: dict[str, Any] | None = None,
    prompt_logprobs: int | None = None,
    skip_special_tokens: bool = True,
) -> SamplingParams:
    """SamplingParams from a request; APIError(400) naming the parameter on any bad value.

    ``max_tokens`` and ``logprobs`` come resolved from the endpoint because the
    two APIs spell them differently (``max_completion_tokens``, ``top_logprobs``).
    ``constraint`` holds output-constraint fields the endpoint derived (chat's response_format
    or forced tool call); with the request's own grammar fields, at most one may be set.
    ``skip_special_tokens=False``: control tokens stay in the text (a harmony reply's markers).
    """
    _check_caps(req, max_tokens, limits)
    own = req.constraint()
    both = sorted(set(own) | set(constraint or {}))
    if own and constraint:
        raise bad_request(f"invalid {both[0]}: only one of grammar / guided_* / response_format / a forced tool call "
                          f"may constrain the output (got {', '.join(both)})", param=both[0])
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=_parse_logit_bias(req.logit_bias),
            seed=req.seed,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stop_token_ids=list(req.stop_token_ids or []),
            min_tokens=req.min_tokens or 0,
            ignore_eos=bool(req.ignore_eos),
            speculative=req.speculative is not False,
            n=1 if req.n is None else req.n,
            logprobs=logprobs,
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            **own, **(constraint or {}),
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=skip_special_tokens,
        )
        params.check_vocab(limits.vocab_size)
    except APIError:
        raise
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc), param=param_from_message(str(exc))) from None
    return params

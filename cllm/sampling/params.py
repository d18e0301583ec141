"""SamplingParams: what a request asks of the sampler, validated at construction."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings (OpenAI / vLLM names).

    Invalid values raise ValueError naming the parameter.
    """

    max_tokens: int | None = 16  # output-token cap; None = up to the context length
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = off
    top_p: float = 1.0  # nucleus mass; 1 = off
    min_p: float = 0.0  # drop tokens below min_p * p(max); 0 = off
    repetition_penalty: float = 1.0  # >1 discourages tokens seen in prompt or output (CTRL-style)
    presence_penalty: float = 0.0  # subtracted once from logits of tokens already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence of tokens already generated
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    seed: int | None = None  # per-request RNG seed: same output whatever the batch-mates
    stop: list[str] = field(default_factory=list)  # strings that end generation (not included in text)
    stop_token_ids: list[int] = field(default_factory=list)  # extra tokens that end generation
    min_tokens: int = 0  # EOS/stop suppressed until this many tokens
    ignore_eos: bool = False  # keep going past EOS
    n: int = 1  # completions per prompt
    logprobs: int | None = None  # None = off; k >= 0 returns the chosen token's logprob and k top alternatives
    include_stop_str_in_output: bool = False  # keep a matched stop string in the text
    # Constrained decoding (at most one): the output is guaranteed to match it (cllm.structured).
    json_schema: dict[str, Any] | str | None = None  # a JSON Schema (object or its JSON text)
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    grammar: str | None = None  # a GBNF / EBNF grammar (llama-server's `grammar`), rule `root` first
    regex: str | None = None  # a regular expression the whole output matches
    choice: list[str] | None = None  # the output is exactly one of these strings
    prompt_logprobs: int | None = None  # None = off; k >= 0 returns each prompt token's logprob (first: None) and k top alternatives
    speculative: bool = True  # False: never given draft tokens (speculative decoding off for this request)
    # False: control tokens the model writes ("<|channel|>") stay in the text as their special-token text
    # (vLLM's name); tokens that end the output (EOS unless ignore_eos, stop_token_ids) never do. Chat
    # replies in gpt-oss's harmony format need their markers to be read (cllm.tools.harmony).
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.json_schema, str):
            self.json_schema = _schema_from_text(self.json_schema)
        self.validate()

    def validate(self) -> None:
        # max_tokens=0 only scores the prompt (evaluation harnesses: echo + logprobs), so it needs prompt_logprobs.
        least = 0 if self.prompt_logprobs is not None else 1
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= least), "max_tokens", self.max_tokens,
               "an integer >= 1 or None (0 only with prompt_logprobs)")
        _check(_finite(self.temperature) and 0 <= self.temperature <= 100, "temperature", self.temperature, "a number in [0, 100]")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", self.top_k, "an integer >= 0 (or -1 for off)")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "a number in [0, 1]")
        _check(_finite(self.repetition_penalty) and 0 < self.repetition_penalty <= 10, "repetition_penalty", self.repetition_penalty, "a number in (0, 10]")
        _check(_finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "a number in [-2, 2]")
        _check(_finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty, "a number in [-2, 2]")
        _check(self.seed is None or _is_int(self.seed), "seed", self.seed, "an integer or None")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "non-empty strings")
        _check(len(self.stop) <= 16, "stop", self.stop, "at most 16 strings")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids, "non-negative token ids")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", self.min_tokens, "an integer >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens, f"at most max_tokens ({self.max_tokens})")
        _check(_is_int(self.n) and 1 <= self.n <= 128, "n", self.n, "an integer in [1, 128]")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20), "logprobs", self.logprobs, "an integer in [0, 20] or None")
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20), "prompt_logprobs", self.prompt_logprobs, "an integer in [0, 20] or None")
        _check(isinstance(self.speculative, bool), "speculative", self.speculative, "true or false")
        _check(isinstance(self.skip_special_tokens, bool), "skip_special_tokens", self.skip_special_tokens, "true or false")
        _check(all(k >= 0 and _finite(v) and -100 <= v <= 100 for k, v in self.logit_bias.items()), "logit_bias", self.logit_bias, "token ids >= 0 mapped to numbers in [-100, 100]")
        self._validate_constraint()

    def _validate_constraint(self) -> None:
        _check(self.json_schema is None or isinstance(self.json_schema, (dict, bool)), "json_schema", self.json_schema, "a JSON Schema object")
        _check(isinstance(self.json_object, bool), "json_object", self.json_object, "true or false")
        _check(self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip() != ""), "grammar", self.grammar, "a non-empty GBNF grammar")
        _check(self.regex is None or (isinstance(self.regex, str) and self.regex != ""), "regex", self.regex, "a non-empty regular expression")
        _check(self.choice is None or (isinstance(self.choice, list) and bool(self.choice) and all(isinstance(c, str) and c for c in self.choice)), "choice", self.choice, "a non-empty list of non-empty strings")
        given = [name for name in ("json_schema", "json_object", "grammar", "regex", "choice")
                 if getattr(self, name) not in (None, False)]
        _check(len(given) <= 1, given[-1] if given else "json_schema", given, "only one of json_schema, json_object, grammar, regex, choice")

    @property
    def constraint_key(self) -> tuple[str, str] | None:
        """(kind, text) of the output constraint, the key grammars are compiled and cached by. Schema
        keys keep their order: properties are generated in the order the schema lists them."""
        if self.json_schema is not None:
            return "json_schema", json.dumps(self.json_schema, ensure_ascii=False)
        if self.json_object:
            return "json_object", ""
        if self.grammar is not None:
            return "grammar", self.grammar
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice, ensure_ascii=False)
        return None

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids must exist in the model's vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias.keys()), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            _check(not bad, name, bad, f"token ids below the vocabulary size {vocab_size}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _schema_from_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"invalid json_schema={text[:80]!r}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})") from None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"invalid {name}={value!r}: must be {allowed}")

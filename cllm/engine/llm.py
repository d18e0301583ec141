"""LLM: the synchronous Python API (batch in, outputs out)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from cllm.multimodal.prompt import MultimodalPrompt
from cllm.backends.base import Backend
from cllm.config import CllmConfig, load_config
from cllm.engine.chat_request import attach_tool_calls, prepare_chat
from cllm.engine.llm_engine import LLMEngine, Prompt
from cllm.engine.stats import EngineStats
from cllm.outputs import EmbeddingOutput, RequestOutput
from cllm.sampling.params import SamplingParams


def make_config(config: CllmConfig | str | Path | None, overrides: dict[str, Any]) -> CllmConfig:
    """A CllmConfig from an object or a YAML path, plus flat keyword overrides (None values ignored)."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(config, CllmConfig):
        return config.with_overrides(**overrides)
    return load_config(config, **overrides)


def make_engine(model: str | None, backend: str | Backend | None, config: CllmConfig | str | Path | None,
                overrides: dict[str, Any]) -> LLMEngine:
    """The engine behind LLM and AsyncLLM; ``backend`` is a registry name or a ready Backend instance."""
    instance = backend if isinstance(backend, Backend) else None
    name = None if instance is not None else backend
    return LLMEngine(make_config(config, {"model": model, "backend": name, **overrides}), instance)


class LLM:
    """Offline generation: every prompt of a call is continuously batched together.

    ``LLM(model=None, backend="llama_cpp", config=None, **overrides)``: overrides
    use the flat setting names of config.yaml (n_ctx, n_seq_max, n_threads,
    n_batch, max_num_seqs, max_num_batched_tokens, ...). ``backend`` may also be
    a Backend instance.
    """

    def __init__(self, model: str | None = None, backend: str | Backend | None = None,
                 config: CllmConfig | str | Path | None = None, **overrides: Any) -> None:
        self.engine = make_engine(model, backend, config, overrides)
        self.config = self.engine.config

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def backend_name(self) -> str:
        return self.engine.backend.name

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, priority: int | Sequence[int] = 0, use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast(params or SamplingParams(), len(prompt_list), "params")
        priorities = _broadcast(priority, len(prompt_list), "priority")
        # Validate every prompt before queueing any, so a bad prompt k leaves nothing behind; then feed
        # the bounded waiting queue as it drains, so a batch of any size just works.
        pending = [(p, sp, pr, self.engine.validate_request(p, sp))
                   for p, sp, pr in zip(prompt_list, params_list, priorities)]
        return self._run(pending, use_tqdm)

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]], params: SamplingParams | None = None,
             *, tools: list[dict] | None = None, tool_choice: Any = None, parallel_tool_calls: bool | None = None,
             response_format: Any = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Chat completion(s) with the model's chat template; one conversation or a list of them.

        ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` / ``response_format`` take the OpenAI
        shapes (``response_format`` may also be a pydantic model class); tool calls come back in
        ``outputs[i].tool_calls`` with finish_reason "tool_calls".
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        requests = [prepare_chat(self.engine, c, params, tools=tools, tool_choice=tool_choice,
                                 parallel_tool_calls=parallel_tool_calls, response_format=response_format)
                    for c in conversations]
        outs = self.generate([r.prompt_ids for r in requests], [r.params for r in requests], use_tqdm=use_tqdm)
        return [attach_tool_calls(out, r.plan) for out, r in zip(outs, requests)]

    def embed(self, inputs: Prompt | Sequence[Prompt]) -> list[EmbeddingOutput]:
        """Embeddings of texts (or token-id lists), in input order: pooled final hidden states, L2-normalised.

        Inputs are packed several per forward pass; pooling follows ``embedding_pooling``.
        """
        return self.engine.embed_token_ids(self.engine.embedding_token_ids(_as_prompt_list(inputs)))

    def _feed(self, pending: list[tuple], ids: list[str]) -> None:
        # An idle engine always takes the next request, so a too-large n surfaces as QueueFullError.
        while len(ids) < len(pending) and (self.engine.has_room_for(pending[len(ids)][1].n)
                                           or not self.engine.has_unfinished()):
            prompt, params, priority, token_ids = pending[len(ids)]
            ids.append(self.engine.add_request(prompt, params, priority=priority, prompt_ids=token_ids))

    def _run(self, pending: list[tuple], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        ids: list[str] = []
        bar = tqdm(total=len(pending), disable=not use_tqdm, desc="generate")
        try:
            self._feed(pending, ids)
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
                self._feed(pending, ids)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [final[i] for i in ids]

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def switch_backend(self, backend: str, **overrides: Any) -> None:
        """Move this LLM to another backend (e.g. "torch"), keeping its config and sampling behaviour.

        The new backend is loaded first and the old one closed only after that succeeded: if loading
        fails, the error is raised and this LLM keeps working on the old backend (both are in memory
        for a moment).
        """
        config = self.config.with_overrides(backend=backend, **overrides)
        engine = LLMEngine(config)
        old, self.engine, self.config = self.engine, engine, config
        old.close()

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, MultimodalPrompt)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    return list(prompts)


def _broadcast(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n

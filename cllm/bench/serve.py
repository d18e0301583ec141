"""HTTP target: any OpenAI-compatible server, streamed over httpx.

Works with cllm serve, vLLM, llama.cpp's llama-server, llama-cpp-python's
server and Ollama. Each request streams ``/v1/completions`` (or
``/v1/chat/completions``) with ``stream_options.include_usage`` so output tokens
come from the server's usage when it reports it, else one per non-empty chunk.
``ignore_eos`` is sent as the vLLM-style extension unless disabled (servers that
reject unknown fields need ``--no-ignore-eos``).
"""
from __future__ import annotations

import json
import time
from typing import Any

import httpx

from cllm.bench.metrics import RequestRecord, StreamTimer
from cllm.bench.workload import BenchPrompt, GenerationSettings

ENDPOINTS = ("completions", "chat")


def api_root(base_url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` -> ``http://host:port/v1``."""
    root = base_url.rstrip("/")
    if not root.startswith(("http://", "https://")):
        raise ValueError(f"invalid base URL {base_url!r}: must start with http:// or https://")
    return root if root.endswith("/v1") else root + "/v1"


def _chunk_text(event: dict[str, Any], endpoint: str) -> str:
    """The text carried by one streamed event (empty for usage-only events)."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


class OpenAITarget:
    """An OpenAI-compatible endpoint; one shared connection pool for the whole run."""

    def __init__(self, client: httpx.AsyncClient, *, model: str, endpoint: str, send_ignore_eos: bool, name: str) -> None:
        if endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {endpoint!r}; valid: {', '.join(ENDPOINTS)}")
        self.name = name  # label in tables
        self.model = model  # model id sent with each request
        self._client = client
        self._endpoint = endpoint
        self._send_ignore_eos = send_ignore_eos

    @classmethod
    async def open(
        cls, base_url: str, *, model: str | None = None, endpoint: str = "completions", api_key: str | None = None,
        send_ignore_eos: bool = True, timeout_s: float = 600.0, name: str | None = None,
    ) -> OpenAITarget:
        """Connect; without ``model``, use the first id listed by GET /v1/models."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        client = httpx.AsyncClient(
            base_url=api_root(base_url), headers=headers, timeout=httpx.Timeout(timeout_s, connect=30.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        try:
            model = model or await _first_model(client)
        except Exception:
            await client.aclose()
            raise
        return cls(client, model=model, endpoint=endpoint, send_ignore_eos=send_ignore_eos, name=name or base_url)

    def payload(self, prompt: BenchPrompt, settings: GenerationSettings) -> dict[str, Any]:
        """The JSON body of one streamed request."""
        body: dict[str, Any] = {
            "model": self.model, "max_tokens": prompt.output_len, "temperature": settings.temperature,
            "seed": settings.seed + prompt.index, "stream": True, "stream_options": {"include_usage": True},
        }
        if self._endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt.text}]
        else:
            body["prompt"] = prompt.text
        if self._send_ignore_eos and settings.ignore_eos:
            body["ignore_eos"] = True
        return body

    async def send(self, prompt: BenchPrompt, settings: GenerationSettings, run_start: float) -> RequestRecord:
        """Stream one request; failures become records with their reason."""
        path = "/chat/completions" if self._endpoint == "chat" else "/completions"
        timer = StreamTimer.begin(prompt.index, len(prompt.token_ids), prompt.output_len, run_start, time.perf_counter())
        try:
            async with self._client.stream("POST", path, json=self.payload(prompt, settings)) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode("utf-8", "replace")
                    return timer.fail(time.perf_counter(), f"HTTP {response.status_code}: {body.strip()[:200]}")
                usage = await self._read_stream(response, timer)
        except _StreamError as exc:
            return timer.fail(time.perf_counter(), str(exc))
        except (httpx.HTTPError, OSError, ValueError) as exc:
            return timer.fail(time.perf_counter(), f"{type(exc).__name__}: {exc}".strip())
        now = time.perf_counter()
        if usage is not None:
            timer.record.prompt_tokens = usage.get("prompt_tokens", timer.record.prompt_tokens)
            return timer.finish(now, output_tokens=usage.get("completion_tokens"))
        return timer.finish(now)

    async def _read_stream(self, response: httpx.Response, timer: StreamTimer) -> dict[str, Any] | None:
        """Consume server-sent events; returns the usage object if the server sent one."""
        usage = None
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise _StreamError(f"stream error: {json.dumps(event['error'])[:200]}")
            if _chunk_text(event, self._endpoint):
                timer.chunk(time.perf_counter())
            usage = event.get("usage") or usage
        return usage

    async def close(self) -> None:
        await self._client.aclose()


class _StreamError(Exception):
    """The server reported an error inside the stream."""


async def _first_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError("GET /v1/models listed no model; pass --model NAME")
    return str(models[0]["id"])

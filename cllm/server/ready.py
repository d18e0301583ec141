"""What `cllm serve` prints once the model is loaded: where to chat, where the API is, what runs, a curl to try."""
from __future__ import annotations

import json
import shlex
from typing import Any

from cllm.config import CllmConfig
from cllm.server.body_limit import IMAGE_BODY_BYTES

_ANY_ADDRESS = {"0.0.0.0", "::", "[::]", ""}


def base_url(config: CllmConfig) -> str:
    """The URL a person on this machine opens (a wildcard bind address is reached through loopback)."""
    host = config.server.host
    if host in _ANY_ADDRESS:
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"http://{host}:{config.server.port}"


def device_text(engine: Any, config: CllmConfig) -> str:
    """'llama_cpp on CPU, 2 threads' / 'torch on cuda:0, bfloat16' from the backend where it is in-process
    (an engine in a process of its own says it itself: ProcessEngine.device_text)."""
    if isinstance(getattr(engine, "device_text", None), str):
        return engine.device_text
    backend = getattr(getattr(engine, "engine", None), "backend", None)
    name = getattr(backend, "name", None) or config.model.backend
    if backend is None:
        return f"{name} (replicas)"
    if name == "llama_cpp":
        layers = getattr(backend, "n_gpu_layers", 0)
        threads = getattr(backend, "_n_threads", None)
        where = "GPU (layers offloaded)" if layers else "CPU"
        text = f"llama_cpp on {where}" + (f", {threads} thread{'s' if threads != 1 else ''}" if threads else "")
        if getattr(backend, "thread_governor", None) is not None:
            text += " (fewer while other processes keep the CPU busy)"
        weights, model = getattr(backend, "weights_path", None), getattr(backend, "model_path", None)
        if weights is not None and model is not None and weights != model:
            text += f", weights as a converted copy ({weights.name.split('.')[-3]})"
        verdict = getattr(backend, "flash_attn_verdict", None)
        return text + (f", flash attention {verdict.text()}" if verdict is not None else "")
    device = getattr(backend, "device", None)
    dtype = getattr(backend, "dtype", None)
    return f"{name} on {device}" + (f", {str(dtype).removeprefix('torch.')}" if dtype is not None else "")


def determinism_of(engine: Any) -> Any:
    """The backend's Determinism, in-process or as a core process reported it (None if unknown)."""
    backend = getattr(getattr(engine, "engine", None), "backend", None)
    return getattr(backend, "determinism", None) or getattr(engine, "determinism", None)


def curl_line(config: CllmConfig, model: str) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello! Who are you?"}]})
    auth = ' -H "Authorization: Bearer $CLLM_API_KEY"' if config.server.api_key else ""
    return (f"curl {base_url(config)}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
            f"-d {shlex.quote(body)}")


def ready_lines(config: CllmConfig, engine: Any, model: str, max_model_len: int) -> list[str]:
    """The ready block, one line per fact."""
    url = base_url(config)
    backend = getattr(getattr(engine, "engine", None), "backend", None)
    slots = getattr(getattr(backend, "capacity", None), "max_num_seqs", None) or getattr(engine, "max_num_seqs", None)
    key_note = "  (API key required: Authorization: Bearer <key>; the page asks for it)" if config.server.api_key else ""
    lines = [
        f"cllm is ready: {model}",
        f"  chat page : {url}/",
        f"  API base  : {url}/v1{key_note}",
        f"  model     : {model}",
        f"  backend   : {device_text(engine, config)}",
        f"  engine    : {_engine_text(engine)} (engine_process: {config.server.engine_process})",
    ]
    determinism = determinism_of(engine)
    if determinism is not None and determinism.on:
        lines.append(f"  determinism: {determinism.text()}")
    vision = getattr(backend, "vision_text", None)
    if vision or getattr(engine, "supports_images", False):
        body = config.server.max_body_bytes or IMAGE_BODY_BYTES
        lines.append(f"  images    : {vision or 'accepted'} (at most {config.images.max_images_per_request} a request,"
                     f" request bodies up to {body >> 20} MiB)")
    if slots is not None:
        lines.append(f"  slots     : {slots} sequences at once, {max_model_len} tokens of context each")
    else:
        lines.append(f"  context   : {max_model_len} tokens per sequence")
    lines.append(f"  try       : {curl_line(config, model)}")
    return lines


def ready_lines_models(config: CllmConfig, models: list[Any]) -> list[str]:
    """The ready block of a server with several declared models (each loads on its first request)."""
    url = base_url(config)
    key_note = "  (API key required: Authorization: Bearer <key>; the page asks for it)" if config.server.api_key else ""
    limit = config.router.max_loaded_models
    lines = [
        f"cllm is ready: {len(models)} models, loaded on first use (at most {limit} at once)",
        f"  chat page : {url}/",
        f"  API base  : {url}/v1{key_note}",
    ]
    for info in models:
        keep = "never unloaded" if info.keep_alive_s < 0 else f"keep_alive {info.keep_alive_s:g} s"
        aliases = f" (also {', '.join(info.aliases[1:])})" if len(info.aliases) > 1 else ""
        lines.append(f"  model     : {info.name}{aliases}: {info.backend}, {info.path}, {keep}")
    lines.append(f"  try       : {curl_line(config, models[0].name)}")
    return lines


def _engine_text(engine: object) -> str:
    """Where the engine's loop runs, for the ready lines."""
    if not getattr(engine, "in_own_process", False):
        return "a thread of this process"
    if getattr(engine, "core_realtime", False):
        return "its own process, its loop at real-time priority (core_realtime)"
    return "its own process"

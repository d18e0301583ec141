"""The `cllm` command: chat, generate, backends, serve, bench."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any, Optional

import typer
import yaml

from cllm.config import FIELD_SECTION, CllmConfig, load_config

app = typer.Typer(add_completion=False, no_args_is_help=True, help="cllm: continuous-batching LLM serving over llama.cpp and PyTorch.")

BackendOpt = typer.Option(None, "--backend", "-b", help="backend name (see `cllm backends`)")
ModelOpt = typer.Option(None, "--model", "-m", help="GGUF file or HF model directory (default: embedded SmolLM2-135M)")
ConfigOpt = typer.Option(None, "--config", "-c", help="config.yaml path (default: $CLLM_CONFIG, else built-in defaults)")
SetOpt = typer.Option(None, "--set", help="any setting as KEY=VALUE (repeatable), e.g. --set n_ubatch=256")


def _parse_sets(items: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or key not in FIELD_SECTION:
            raise typer.BadParameter(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(FIELD_SECTION))}")
        out[key] = yaml.safe_load(value)
    return out


def _config(config: Path | None, sets: list[str] | None, **flags: Any) -> CllmConfig:
    """The config from file < environment < --set < the command's own flags (those given)."""
    overrides = _parse_sets(sets)
    overrides.update({key: value for key, value in flags.items() if value is not None})
    try:
        return load_config(config, **overrides)
    except ValueError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="prompt text"),
    backend: Optional[str] = BackendOpt,
    model: Optional[str] = ModelOpt,
    config: Optional[Path] = ConfigOpt,
    max_tokens: int = typer.Option(128, "--max-tokens", help="output tokens at most"),
    temperature: float = typer.Option(0.7, "--temperature", help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    chat: bool = typer.Option(False, "--chat", help="wrap the prompt as a user message with the model's chat template"),
    n_threads: Optional[int] = typer.Option(None, "--n-threads"),
    n_ctx: Optional[int] = typer.Option(None, "--n-ctx"),
    sets: Optional[list[str]] = SetOpt,
) -> None:
    """Stream one completion to the terminal."""
    from cllm.engine.async_llm import AsyncLLM
    from cllm.sampling.params import SamplingParams

    cfg = _config(config, sets, backend=backend, model=model, n_threads=n_threads, n_ctx=n_ctx)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        engine = AsyncLLM(config=cfg)
    except (ValueError, FileNotFoundError, KeyError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    text = engine.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    asyncio.run(_stream(engine, text, params))


async def _stream(engine: Any, prompt: str, params: Any) -> None:
    out = None
    try:
        async for out in engine.generate(prompt, params):
            sys.stdout.write(out.outputs[0].text_delta)
            sys.stdout.flush()
    finally:
        await engine.shutdown(0)
    if out is not None:
        u, m = out.usage, out.metrics
        ttft = (m.ttft or 0) * 1000
        secs = max((m.e2e or 0) - (m.ttft or 0), 1e-9)
        rate = (u.completion_tokens - 1) / secs if u.completion_tokens > 1 else 0.0
        typer.echo(f"\n[{out.outputs[0].finish_reason}] prompt={u.prompt_tokens} completion={u.completion_tokens} "
                   f"ttft={ttft:.0f}ms decode={rate:.1f} tok/s", err=True)


@app.command()
def chat(
    url: Optional[str] = typer.Option(None, "--url", help="a running server, e.g. http://127.0.0.1:8000 (default: load the model in this process)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="CLLM_API_KEY", help="the server's API key (with --url)"),
    backend: Optional[str] = BackendOpt,
    model: Optional[str] = typer.Option(None, "--model", "-m", help="GGUF file or HF model directory (in-process; default: embedded SmolLM2-135M); with --url, the name of the server's model to talk to (default: its first)"),
    config: Optional[Path] = ConfigOpt,
    system: Optional[str] = typer.Option(None, "--system", help="system prompt (/system changes it later)"),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="0 = greedy (default 0.7; /set changes it)"),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="longest reply in tokens (default 512)"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    n_threads: Optional[int] = typer.Option(None, "--n-threads"),
    n_ctx: Optional[int] = typer.Option(None, "--n-ctx", help="context of the conversation in tokens (in-process)"),
    n_seq_max: int = typer.Option(1, "--n-seq-max", help="sequence slots (in-process; one conversation needs one)"),
    sets: Optional[list[str]] = SetOpt,
) -> None:
    """Talk to the model in the terminal: streamed replies, history, /reset, /system, /set; Ctrl-C stops a reply, Ctrl-D exits."""
    from cllm.chat_cli import chat as run_chat

    cfg = None
    if url is None:
        cfg = _config(config, sets, backend=backend, model=model, n_threads=n_threads, n_ctx=n_ctx, n_seq_max=n_seq_max)
    sampling = {k: v for k, v in {"temperature": temperature, "max_tokens": max_tokens, "seed": seed}.items()
                if v is not None}
    raise typer.Exit(run_chat(url=url, api_key=api_key, config=cfg, system=system, sampling=sampling,
                              model_name=model if url is not None else None))


@app.command()
def backends() -> None:
    """List registered backends and whether each can load here."""
    from cllm.backends.registry import describe_backends

    for info in describe_backends():
        mark = "yes" if info.loadable else "no "
        typer.echo(f"{info.name:12s} loadable={mark}  {info.target}" + ("" if info.loadable else f"  ({info.detail})"))


@app.command()
def serve(
    backend: Optional[str] = BackendOpt,
    model: Optional[list[str]] = typer.Option(None, "--model", "-m", help="GGUF file or HF model directory (default: embedded SmolLM2-135M); repeat as NAME=PATH (or NAME=PATH@BACKEND) to serve several, each loaded on its first request"),
    models_dir: Optional[str] = typer.Option(None, "--models-dir", help="serve every GGUF and HF model directory in this folder, named by file"),
    keep_alive: Optional[str] = typer.Option(None, "--keep-alive", help="with several models: how long one stays loaded after its last request (seconds, '5m', 0 = unload at once, -1 = never)"),
    max_loaded_models: Optional[int] = typer.Option(None, "--max-loaded-models", help="with several models: how many may be loaded at once"),
    config: Optional[Path] = ConfigOpt,
    host: Optional[str] = typer.Option(None, "--host", help="bind address (default 127.0.0.1)"),
    port: Optional[int] = typer.Option(None, "--port", help="bind port (default 8000)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="CLLM_API_KEY", help="require this Bearer token on /v1/*"),
    log_level: Optional[str] = typer.Option(None, "--log-level", help="debug | info | warning | error"),
    n_ctx: Optional[int] = typer.Option(None, "--n-ctx"),
    n_seq_max: Optional[int] = typer.Option(None, "--n-seq-max"),
    n_threads: Optional[int] = typer.Option(None, "--n-threads"),
    n_batch: Optional[int] = typer.Option(None, "--n-batch"),
    max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs"),
    max_waiting: Optional[int] = typer.Option(None, "--max-waiting"),
    request_timeout_s: Optional[float] = typer.Option(None, "--request-timeout-s"),
    served_model_name: Optional[list[str]] = typer.Option(None, "--served-model-name", help="model name to answer to (repeatable: aliases)"),
    # "\\[" keeps rich's markup from reading "[ray]" as a style tag and dropping it from the help
    replicas: Optional[int] = typer.Option(None, "--replicas", help="engine replicas on Ray Serve (needs cllm\\[ray])"),
    pd: Optional[str] = typer.Option(None, "--pd", help="prefill/decode replicas on Ray Serve, e.g. prefill=1,decode=1"),
    speculative: Optional[str] = typer.Option(None, "--speculative", help="speculative decoding: auto (default: n-gram on llama.cpp, off on torch) | ngram | draft | off"),
    speculative_model: Optional[str] = typer.Option(None, "--speculative-model", help="draft model of --speculative draft"),
    chat_template: Optional[str] = typer.Option(None, "--chat-template", help="a Jinja chat template file, or the template itself, in place of the model's"),
    deterministic: Optional[bool] = typer.Option(None, "--deterministic/--no-deterministic", help="batch-invariant inference: the same request gets bitwise the same tokens and logprobs whatever it is batched with (docs/reproducibility.md)"),
    mmproj: Optional[str] = typer.Option(None, "--mmproj", help="llama.cpp: the vision projector GGUF (default: looked for beside the model; 'none' = text only)"),
    sets: Optional[list[str]] = SetOpt,
) -> None:
    """Run the OpenAI-compatible HTTP server (on Ray Serve with --replicas N > 1 or --pd)."""
    path, entries = _model_flags(model or [])
    cfg = _config(config, sets, backend=backend, model=path, models_dir=models_dir, keep_alive=keep_alive,
                  max_loaded_models=max_loaded_models, host=host, port=port, api_key=api_key,
                  log_level=log_level, n_ctx=n_ctx, n_seq_max=n_seq_max, n_threads=n_threads, n_batch=n_batch,
                  max_num_seqs=max_num_seqs, max_waiting=max_waiting, request_timeout_s=request_timeout_s,
                  served_model_name=served_model_name or None, replicas=replicas, pd=pd, speculative=speculative,
                  speculative_model=speculative_model, chat_template=chat_template, deterministic=deterministic,
                  mmproj=mmproj)
    if entries:
        cfg = cfg.model_copy(update={"models": [*cfg.models, *entries]})
    try:
        from cllm.router import declared_models

        declared_models(cfg)  # a bad declaration is said now, in one line, not at the first request
    except (ValueError, FileNotFoundError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    if cfg.cluster.replicas > 1 or cfg.cluster.pd is not None:
        try:
            from cllm.cluster.app import serve_ray
        except ImportError as err:
            raise typer.BadParameter(f"--replicas/--pd need Ray Serve: pip install 'cllm[ray]' ({err})") from None
        serve_ray(config=cfg)
        return
    from cllm.server.app import run_server

    run_server(cfg)


def _model_flags(values: list[str]) -> tuple[str | None, list[Any]]:
    """``--model`` values: one PATH (the single model, as before), or NAME=PATH[@BACKEND] entries (a bare
    PATH among several is named by its file)."""
    from cllm.backends.registry import backend_names
    from cllm.config import ModelEntry
    from cllm.router.declare import default_name, parse_model_flag

    if len(values) == 1 and "=" not in values[0]:
        return values[0], []
    try:
        return None, [parse_model_flag(v, backend_names()) if "=" in v else ModelEntry(name=default_name(v), model=v)
                      for v in values]
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None


def _mount_bench() -> None:
    try:
        from cllm.bench.cli import app as bench_app
    except ImportError as err:  # bench extras (httpx, matplotlib) not installed
        reason = str(err)

        @app.command(name="bench")
        def bench_missing() -> None:
            """Benchmarks (needs `pip install cllm\\[bench]`)."""  # "\\[": rich would drop "[bench]"
            typer.echo(f"error: cllm bench needs the bench extras: {reason}", err=True)
            raise typer.Exit(2)
        return
    app.add_typer(bench_app, name="bench", help="Benchmarks: offline, serve, compare.")


_mount_bench()


def main() -> None:
    app()


if __name__ == "__main__":
    main()

"""`cllm serve` over a NullBackend: the whole server (HTTP, streaming, engine thread) with a forward
pass that costs nothing. Used by benchmarks/engine_overhead.py and by tests that need a backend
faster than any socket (stalled readers).

    python -m cllm.bench.null_server --port 8123 --slots 256 --vocab 1024 [--device numpy|torch] [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse

import uvicorn

from cllm.bench.null_backend import NullBackend
from cllm.config import load_config
from cllm.engine.async_llm import AsyncLLM
from cllm.server.app import configure_logging, create_app, uvicorn_config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--device", choices=("numpy", "torch"), default="numpy")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = parser.parse_args(argv)
    overrides: dict[str, object] = {"port": args.port, "n_seq_max": args.slots, "max_sequences_per_client": None,
                                    "log_level": "warning", "max_waiting": 4096}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = value
    config = load_config(None, environ={}, **overrides)
    backend = NullBackend(slots=args.slots, vocab_size=args.vocab, device=args.device)
    engine = AsyncLLM(backend=backend, config=config)
    configure_logging(config.server.log_level)
    app = create_app(config, engine)
    uvicorn.Server(uvicorn_config(app, config)).run()


if __name__ == "__main__":
    main()

"""`cllm serve` over a NullBackend: the whole server (HTTP, streaming, engine thread) with a forward
pass that costs nothing. Used by benchmarks/engine_overhead.py and by tests that need a backend
faster than any socket (stalled readers).

    python -m cllm.bench.null_server --port 8123 --slots 256 --vocab 1024 [--device numpy|torch] [--word-bytes N]
                                     [--step-ms MS | --device-ms MS] [--token-us US] [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import functools
import socket

from cllm.bench.null_backend import NullBackend
from cllm.config import load_config
from cllm.engine.async_llm import AsyncLLM
from cllm.engine.process_engine import ProcessEngine, wants_engine_process
from cllm.server.app import _DrainingServer, configure_logging, create_app, uvicorn_config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--device", choices=("numpy", "torch"), default="numpy")
    parser.add_argument("--word-bytes", type=int, default=0, help="pad each token's text to this many bytes")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="simulated device time of each forward, GIL released (a GPU server's proxy; see NullBackend)")
    parser.add_argument("--token-us", type=float, default=0.0, help="simulated device time per token of each forward")
    parser.add_argument("--device-ms", type=float, default=0.0,
                        help="an asynchronous simulated device: each forward completes this long after its launch")
    parser.add_argument("--sndbuf", type=int, default=0,
                        help="kernel send buffer of each connection, bytes (0: the kernel's autotuned default); small "
                             "makes a client that stops reading block the server's writes at once")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = parser.parse_args(argv)
    overrides: dict[str, object] = {"port": args.port, "n_seq_max": args.slots, "max_sequences_per_client": None,
                                    "log_level": "warning", "max_waiting": 4096, "max_tokens_limit": 32768}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = value
    config = load_config(None, environ={}, **overrides)
    backend = functools.partial(null_backend, slots=args.slots, vocab_size=args.vocab, device=args.device,
                                word_bytes=args.word_bytes, step_ms=args.step_ms, token_us=args.token_us,
                                device_ms=args.device_ms)
    # The engine runs as a GPU server's does: --device-ms stands for a GPU, where engine_process auto is on
    # (torch on CUDA); otherwise auto is off (not torch on CUDA) and server.engine_process=on asks for it.
    own_process = wants_engine_process(config) or (config.server.engine_process == "auto" and bool(args.device_ms))
    engine = ProcessEngine(config, backend) if own_process else AsyncLLM(backend=backend(), config=config)
    configure_logging(config.server.log_level)
    app = create_app(config, engine)
    server = _DrainingServer(uvicorn_config(app, config), app.state.cllm)  # SIGTERM drains and exits 0, as cllm serve
    if not args.sndbuf:
        server.run()
        return
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, args.sndbuf)  # accepted connections inherit it
    sock.bind((config.server.host, config.server.port))
    server.run(sockets=[sock])


def null_backend(**kwargs: object) -> NullBackend:
    """A NullBackend, built in the process that runs the engine (the engine core's, with engine_process on).
    With torch logits the torch sampler's math stands for device work: it gets one thread, not OpenMP
    workers spinning on the cores the event loop and the clients need (2 threads made a 64-row argmax
    cost ~1 ms here; in the engine core's process they took ~24 µs of CPU per streamed token)."""
    if kwargs.get("device") == "torch":
        import torch

        torch.set_num_threads(1)
    return NullBackend(**kwargs)


if __name__ == "__main__":
    main()

"""cllm's OpenAI-compatible HTTP server (FastAPI + uvicorn).

``create_app(config, engine=None)`` builds the ASGI app; ``run_server(config)``
serves it (``cllm serve``).
"""
from __future__ import annotations

from cllm.server.app import create_app, run_server

__all__ = ["create_app", "run_server"]

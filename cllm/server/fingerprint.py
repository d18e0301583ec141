"""``system_fingerprint``: which build and settings produced a response (OpenAI's field).

OpenAI changes the fingerprint when the backend serving a model changes, so a client that pins a
``seed`` can tell why two answers differ. Here it names the cllm version and hashes what decides the
numbers: the backend, its library's version, and the model and backend settings. It is computed
once per app, so every response and chunk of one server process carries the same value.
"""
from __future__ import annotations

import hashlib
import json
from importlib import metadata

from starlette.requests import Request

from cllm import __version__
from cllm.config import CllmConfig

# The distribution whose version decides a backend's numerics (other backends: none known).
_LIBRARIES = {"llama_cpp": "llama_cpp_python", "torch": "torch"}


def _library_version(backend: str) -> str:
    dist = _LIBRARIES.get(backend)
    if dist is None:
        return ""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


def system_fingerprint(config: CllmConfig) -> str:
    """``fp_cllm-<version>-<10 hex>``: the version, and a hash of backend, library and settings."""
    backend = config.model.backend
    settings = getattr(config, backend, None)
    parts = {
        "backend": backend,
        "library": _library_version(backend),
        "model": config.model.model_dump(mode="json"),
        "backend_settings": settings.model_dump(mode="json") if settings is not None else None,
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:10]
    return f"fp_cllm-{__version__}-{digest}"


def fingerprint_of(request: Request) -> str | None:
    """The fingerprint of the app serving ``request`` (set by ``create_app``)."""
    return getattr(request.app.state, "system_fingerprint", None)

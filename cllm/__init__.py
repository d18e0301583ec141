"""cllm: continuous-batching LLM serving over llama.cpp and PyTorch.

    import cllm
    llm = cllm.LLM()                                  # embedded SmolLM2, backend="llama_cpp"
    outs = llm.generate(["The capital of France is"], cllm.SamplingParams(max_tokens=32, temperature=0))
"""
from __future__ import annotations

from cllm.backends.base import Backend, BackendCapacity, Tokenizer
from cllm.backends.registry import backend_names, describe_backends, get_backend_factory
from cllm.config import CllmConfig, load_config
from cllm.engine.async_llm import AsyncLLM
from cllm.engine.llm import LLM
from cllm.engine.stats import EngineStats
from cllm.errors import ContextLengthError, EngineDeadError, QueueFullError
from cllm.outputs import CompletionOutput, EmbeddingOutput, RequestOutput, TokenLogprob, Usage
from cllm.request import RequestStatus
from cllm.router import ModelNotFound, ModelUnavailable, Router
from cllm.sampling.params import SamplingParams

__version__ = "0.1.0"


def serve_ray(*args, **kwargs):  # type: ignore[no-untyped-def]
    """N engine replicas behind one OpenAI-compatible endpoint on Ray Serve (cllm.cluster.app.serve_ray;
    needs the extra cllm[ray], imported only when called)."""
    from cllm.cluster.app import serve_ray as _serve_ray

    return _serve_ray(*args, **kwargs)


__all__ = [
    "LLM", "AsyncLLM", "Router", "ModelNotFound", "ModelUnavailable", "SamplingParams", "RequestOutput", "CompletionOutput", "Usage", "RequestStatus",
    "EmbeddingOutput", "TokenLogprob",
    "CllmConfig", "load_config", "Backend", "BackendCapacity", "Tokenizer", "EngineStats",
    "backend_names", "describe_backends", "get_backend_factory",
    "ContextLengthError", "QueueFullError", "EngineDeadError", "serve_ray", "__version__",
]

"""Whether the model a request reaches takes images: the one place the model side decides, called by
every path after its messages are normalized (LLM.chat and AsyncLLM.chat through
cllm.engine.chat_request.prepare_chat; the server's chat, Responses, Messages, count_tokens and
/tokenize routes through cllm.server.images.resolve_images' caller)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cllm.multimodal.content import count_images


def accepts_images(engine: Any) -> bool:
    """Whether ``engine`` (LLMEngine, AsyncLLM, the engine-process proxy) serves images: its
    ``supports_images`` (a vision encoder / projector loaded); engines without the attribute do not."""
    return bool(getattr(engine, "supports_images", False))


def check_images_accepted(engine: Any, messages: Sequence[dict[str, Any]], model: str | None = None) -> None:
    """ValueError ``"model X does not accept images"`` when normalized ``messages`` hold an image and
    the engine's model cannot take one."""
    count = count_images(messages)
    if count and not accepts_images(engine):
        name = model or _model_name(engine)
        raise ValueError(f"model {name!r} does not accept images (the request holds {count}): it is a text-only "
                         "model, or its vision projector (mmproj) is not loaded")


def _model_name(engine: Any) -> str:
    config = getattr(engine, "config", None)
    path = getattr(getattr(config, "model", None), "model", None)
    return str(path) if path else "the embedded model"

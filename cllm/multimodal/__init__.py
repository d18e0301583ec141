"""Inputs beyond text: images decoded and checked once (``image``), and the spans of a prompt that
arrive as embeddings rather than ids (``span``), which both backends fill in (libmtmd, transformers
processors). A request's image parts are parsed, fetched (``fetch``, when allowed) and decoded
(``decode``) by ``content``; ``support`` is where the model decides whether it takes them."""
from __future__ import annotations

from cllm.multimodal.content import count_images, message_images
from cllm.multimodal.image import ImageData
from cllm.multimodal.prompt import MultimodalPrompt
from cllm.multimodal.span import ImageSpan
from cllm.multimodal.support import accepts_images, check_images_accepted

__all__ = ["ImageData", "ImageSpan", "MultimodalPrompt", "accepts_images", "check_images_accepted", "count_images", "message_images"]

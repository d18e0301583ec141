"""The image parts of a chat-shaped request (chat, Responses and Messages all become one), loaded without
blocking the event loop: URLs fetched asynchronously (when allowed), decoding in a thread. Parts are
parsed and counted first, so a bad part or too many images costs no fetch."""
from __future__ import annotations

import asyncio
from typing import Any

from cllm.config import ImageConfig
from cllm.multimodal.content import (
    ImageRef,
    Item,
    PartError,
    check_image_count,
    load_image,
    load_parts,
    parse_parts,
)
from cllm.multimodal.decode import decode_image
from cllm.multimodal.fetch import fetch_image_async
from cllm.multimodal.image import ImageData
from cllm.multimodal.support import check_images_accepted
from cllm.server.errors import APIError, bad_request
from cllm.server.protocol import ChatMessage, ContentPart


async def resolve_images(messages: list[ChatMessage], settings: ImageConfig, *,
                         transport: Any = None) -> list[str | list[dict[str, Any]]] | None:
    """Each message's content as normalize_messages takes it: a string, or (with images) its text and
    image parts, each image an ImageData. None when no message has a list content (nothing to do).
    APIError 400 naming the part (``param``) for a bad part or image, or too many images."""
    if not any(isinstance(m.content, list) for m in messages):
        return None
    parsed: list[str | list[Item]] = []
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            parsed.append(message.content or "")
            continue
        try:
            parsed.append(parse_parts(message.parts(i), message.role, local=False))
        except PartError as exc:
            raise bad_request(str(exc), param=exc.where) from None
    refs = [item for content in parsed if isinstance(content, list) for item in content if isinstance(item, ImageRef)]
    try:
        check_image_count(len(refs), settings)
    except ValueError as exc:
        raise bad_request(str(exc), param="messages") from None
    images = await _load_all(refs, settings, transport)
    loaded = dict(zip(map(id, refs), images))
    return [content if isinstance(content, str) else load_parts(content, lambda ref: loaded[id(ref)])
            for content in parsed]


def check_model_accepts(engine: Any, model: str, contents: list[Any] | None) -> None:
    """400 ``model X does not accept images`` when the resolved contents hold images the model cannot
    take (cllm.multimodal.support.check_images_accepted, the one place that decides)."""
    if contents is None:
        return
    try:
        check_images_accepted(engine, [{"content": c} for c in contents], model)
    except ValueError as exc:
        raise bad_request(str(exc), param="messages", code="images_not_supported") from None


async def _load_all(refs: list[ImageRef], settings: ImageConfig, transport: Any) -> list[ImageData]:
    """Every image, loaded concurrently; the first bad one in request order is the error."""
    results = await asyncio.gather(*(_load(ref, settings, transport) for ref in refs), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]


async def _load(ref: ImageRef, settings: ImageConfig, transport: Any) -> ImageData:
    try:
        if ref.remote:
            data = await fetch_image_async(ref.url or "", ref.where, settings, transport=transport)
            return await asyncio.to_thread(decode_image, data, ref.where, settings)
        return await asyncio.to_thread(load_image, ref, settings)
    except APIError:
        raise
    except ValueError as exc:
        raise bad_request(str(exc), param=ref.where) from None


def part(where: str, kind: str, **fields: Any) -> ContentPart:
    """A content part built by a protocol's converter, named in errors as that protocol names it."""
    built = ContentPart(type=kind, **fields)
    built._where = where
    return built


async def message_contents(messages: list[ChatMessage], settings: ImageConfig, engine: Any,
                           model: str) -> list[str | list[dict[str, Any]]] | None:
    """``resolve_images``, then the model's say (``check_model_accepts``): what every chat-shaped route
    gives render_chat as ``contents``."""
    contents = await resolve_images(messages, settings)
    check_model_accepts(engine, model, contents)
    return contents


def chat_content(content: Any) -> Any:
    """A converted message's content for ChatMessage: a string as it is; a list of plain parts (``where``
    saying how the client's protocol names each) as ContentParts that name themselves in errors."""
    if not isinstance(content, list):
        return content
    return [part(p.get("where") or "", p["type"], text=p.get("text"), image_url=p.get("image_url")) for p in content]

"""The image parts of a chat-shaped request (chat, Responses and Messages all become one), loaded without
blocking the event loop: URLs fetched asynchronously (when allowed), decoding in a thread. Parts are
parsed and counted first, so a bad part or too many images costs no fetch."""
from __future__ import annotations

import asyncio
import threading
from typing import Any

from starlette.requests import Request

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
                           model: str, request: Request | None = None) -> list[str | list[dict[str, Any]]] | None:
    """``resolve_images``, then the model's say (``check_model_accepts``): what every chat-shaped route
    gives render_chat as ``contents``. With ``request``, the decoded images are held against the server's
    ImageMemory until the request ends (429 when they do not fit)."""
    contents = await resolve_images(messages, settings)
    check_model_accepts(engine, model, contents)
    if contents is not None and request is not None:
        size = sum(len(p["image"].rgb) for c in contents if isinstance(c, list) for p in c if p["type"] == "image")
        hold_image_memory(request, size)
    return contents


class ImageMemory:
    """The decoded image bytes that requests in flight hold, bounded by ``images.image_memory_mib``: a
    request's images are taken when decoded and given back when its response ends (ModelLeaseMiddleware
    releases what is left in the request's scope), so that a flood of large images gets 429s instead of
    the host's memory."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.used = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> _MemoryHold | None:
        with self._lock:
            if self.used + size > self.limit:
                return None
            self.used += size
        return _MemoryHold(self, size)

    def give_back(self, size: int) -> None:
        with self._lock:
            self.used -= size


class _MemoryHold:
    __slots__ = ("memory", "size")

    def __init__(self, memory: ImageMemory, size: int) -> None:
        self.memory, self.size = memory, size

    def release(self) -> None:
        size, self.size = self.size, 0
        if size:
            self.memory.give_back(size)


def hold_image_memory(request: Request, size: int) -> None:
    """Hold ``size`` decoded bytes for this request until it ends; APIError 429 when they do not fit now."""
    from cllm.server.state import LEASES_KEY, get_state

    if size <= 0:
        return
    memory: ImageMemory = get_state(request).image_memory
    hold = memory.take(size)
    if hold is None:
        raise APIError(429, f"the server holds {memory.used >> 20} MiB of decoded images for requests in flight and "
                            f"this request's {size >> 20} MiB would pass images.image_memory_mib "
                            f"({memory.limit >> 20} MiB): retry shortly", code="images_busy",
                       headers={"Retry-After": "1"})
    request.scope.setdefault("state", {}).setdefault(LEASES_KEY, []).append(hold)


def chat_content(content: Any) -> Any:
    """A converted message's content for ChatMessage: a string as it is; a list of plain parts (``where``
    saying how the client's protocol names each) as ContentParts that name themselves in errors."""
    if not isinstance(content, list):
        return content
    return [part(p.get("where") or "", p["type"], text=p.get("text"), image_url=p.get("image_url")) for p in content]

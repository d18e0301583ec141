"""A message's content parts with images: parsed first (which image, from where; cheap, so that a bad
part or too many images is refused before anything is fetched or decoded), then loaded.

After loading, a message's ``content`` is a ``str`` when it has no image (text parts joined, as
before images existed), or a list of ``{"type": "text", "text": str}`` and ``{"type": "image",
"image": ImageData}`` parts in order when it has one or more (adjacent text parts joined).
"""
from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cllm.config import ImageConfig
from cllm.multimodal.decode import check_bytes, decode_image, image_from_pil
from cllm.multimodal.fetch import fetch_image
from cllm.multimodal.image import ImageData

# Roles whose messages may carry images: what the user shows, and what a tool returns (Anthropic's
# tool_result blocks, Responses' function_call_output may hold images). Elsewhere an image is a 400.
IMAGE_ROLES = ("user", "tool")
_PART_TYPES = "text, image_url"


@dataclass(slots=True)
class ImageRef:
    """An image part before it is loaded: exactly one of its sources is set."""

    where: str  # how errors name the part (messages[0].content[2], input[1].content[0], messages.0.content.1)
    url: str | None = None  # a data: URL, or an http(s) URL to fetch (if allowed)
    raw: bytes | None = None  # encoded bytes (Python API)
    path: str | None = None  # an image file (Python API)
    pil: Any = None  # a PIL image (Python API)
    image: ImageData | None = None  # decoded already

    @property
    def remote(self) -> bool:
        """Whether loading it fetches a URL."""
        return self.url is not None and self.url[:5].lower() != "data:"


Item = str | ImageRef  # a text part's text, or an image part


class PartError(ValueError):
    """A bad content part; ``where`` names it, and the message starts with it."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.where = where


def parse_parts(parts: Iterable[tuple[str, Any]], role: str, *, local: bool) -> str | list[Item]:
    """(where, part) pairs of one message: its text when it has no image, else its items in order
    (adjacent texts joined). ``local``: the caller is the Python API, whose ``{"type": "image"}`` parts
    may name files; over HTTP only text and image_url parts (and decoded images) are taken."""
    items: list[Item] = []
    for where, part in parts:
        item = parse_part(part, where, local=local)
        if isinstance(item, ImageRef) and role not in IMAGE_ROLES:
            raise PartError(where, f"images are accepted in user messages and tool results, not in {role} messages")
        if isinstance(item, str) and items and isinstance(items[-1], str):
            items[-1] += item
        else:
            items.append(item)
    if not any(isinstance(item, ImageRef) for item in items):
        return "".join(items)  # type: ignore[arg-type]
    return items


def parse_part(part: Any, where: str, *, local: bool) -> Item:
    """One content part: a text part's text, or the image it names."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise PartError(f"{where}.text", "must be a string")
        return part["text"]
    if kind == "image_url":
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, dict) else value  # {"url", "detail"}, or the URL itself
        if not isinstance(url, str) or not url:
            raise PartError(f"{where}.image_url", 'must be {"url": "data:image/png;base64,..."} or the URL itself')
        return ImageRef(where, url=url)
    if kind == "image":
        return _image_part(part.get("image"), where, local)
    if not isinstance(part, dict):
        raise PartError(where, "must be an object with a 'type'")
    known = _PART_TYPES + (", image" if local else "")
    raise PartError(f"{where}.type", f"content part of type {kind!r} is not supported ({known})")


def _image_part(value: Any, where: str, local: bool) -> ImageRef:
    if isinstance(value, ImageData):
        return ImageRef(where, image=value)
    if not local:
        raise PartError(f"{where}.type", "content part of type 'image' is not supported here: send image_url parts")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return ImageRef(where, raw=bytes(value))
    if isinstance(value, str) and (value[:5].lower() == "data:" or value.startswith(("http://", "https://"))):
        return ImageRef(where, url=value)
    if isinstance(value, (str, Path)):
        return ImageRef(where, path=str(value))
    if hasattr(value, "convert") and hasattr(value, "width"):  # a PIL image (PIL is not imported to check)
        return ImageRef(where, pil=value)
    raise PartError(f"{where}.image", "must be a PIL image, a file path, encoded bytes, a data: URL or an ImageData "
                                      f"(got {type(value).__name__})")


def check_image_count(count: int, settings: ImageConfig) -> None:
    if count > settings.max_images_per_request:
        raise ValueError(f"the request holds {count} images, more than max_images_per_request="
                         f"{settings.max_images_per_request}")


def load_parts(items: Sequence[Item], load: Callable[[ImageRef], ImageData]) -> list[dict[str, Any]]:
    """Parsed items as content parts, each image loaded by ``load``."""
    return [{"type": "text", "text": item} if isinstance(item, str) else {"type": "image", "image": load(item)}
            for item in items]


def load_image(ref: ImageRef, settings: ImageConfig, *, fetch: Callable[..., bytes] = fetch_image) -> ImageData:
    """An image part's pixels (sync; a URL is fetched with ``fetch`` when allowed)."""
    if ref.image is not None:
        return ref.image
    if ref.pil is not None:
        return image_from_pil(ref.pil, ref.where, settings)
    if ref.raw is not None:
        return decode_image(ref.raw, ref.where, settings)
    if ref.path is not None:
        return decode_image(read_file(ref.path, ref.where, settings), ref.where, settings)
    if ref.url is None:
        raise ValueError(f"{ref.where}: image part has no image")
    data = data_url_bytes(ref.url, ref.where, settings) if not ref.remote else fetch(ref.url, ref.where, settings)
    return decode_image(data, ref.where, settings)


def data_url_bytes(url: str, where: str, settings: ImageConfig) -> bytes:
    """The bytes of a ``data:[<media type>];base64,<data>`` URL, its size checked before decoding."""
    head, comma, payload = url.partition(",")
    if not comma or not head.lower().endswith(";base64"):
        raise ValueError(f"{where}: image data: URL must be base64 (data:image/png;base64,...)")
    check_bytes(len(payload) // 4 * 3 - 2, where, settings)  # a lower bound of the decoded size
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        try:  # some clients wrap base64 in lines
            data = base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{where}: image data: URL does not hold valid base64") from None
    check_bytes(len(data), where, settings)
    return data


def read_file(path: str, where: str, settings: ImageConfig) -> bytes:
    """An image file's bytes (Python API only: a server never reads files a request names)."""
    try:
        with open(path, "rb") as f:
            check_bytes(Path(path).stat().st_size, where, settings)
            return f.read(settings.max_image_bytes + 1)
    except OSError as exc:
        raise ValueError(f"{where}: image file {path!r} could not be read ({exc.strerror or exc})") from None


def load_messages(messages: list[dict[str, Any]], settings: ImageConfig | None) -> list[dict[str, Any]]:
    """Messages whose list contents hold parsed items (parse_parts), with every image loaded (sync: a URL
    is fetched here when allowed). ``settings`` None: ImageConfig()'s limits on what is loaded here and
    no count limit (images decoded already were counted where they were loaded)."""
    refs = [item for m in messages if isinstance(m["content"], list) for item in m["content"]
            if isinstance(item, ImageRef)]
    if settings is not None:
        check_image_count(len(refs), settings)
    limits = settings or ImageConfig()
    for m in messages:
        if isinstance(m["content"], list):
            m["content"] = load_parts(m["content"], lambda ref: load_image(ref, limits))
    return messages


def message_images(messages: Sequence[dict[str, Any]]) -> list[ImageData]:
    """The images of normalized messages, in prompt order."""
    return [part["image"] for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if isinstance(part, dict) and part.get("type") == "image"]


def count_images(messages: Sequence[dict[str, Any]]) -> int:
    """How many images normalized messages hold."""
    return len(message_images(messages))

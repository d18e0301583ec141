"""Encoded image bytes -> ImageData, safely: the format is read from the bytes (not from what the client
says it is), the size from the header before a pixel is decoded, and any failure of the decoder on
hostile bytes is a ValueError naming the part, never a crash."""
from __future__ import annotations

import io
from typing import Any

from cllm.config import ImageConfig
from cllm.multimodal.image import ImageData

# PIL format names accepted (what Image.open(...).format says); GIF and WebP animations give their first frame.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
# What PIL may call an accepted file: MPO is a JPEG with more pictures after the first (phone cameras).
_OPENED_AS = (*FORMATS, "MPO")
FORMAT_NAMES = "a PNG, JPEG, WebP or GIF"


def decode_image(data: bytes, where: str, settings: ImageConfig) -> ImageData:
    """The first frame of an encoded image, as RGB (transparency over white). ValueError ``"{where}: ..."``
    for empty, too large, unknown-format, oversized or corrupt images."""
    if not data:
        raise ValueError(f"{where}: image is empty")
    check_bytes(len(data), where, settings)
    from PIL import Image, UnidentifiedImageError

    try:
        # formats=: only these decoders ever see the bytes (PIL would otherwise try every plugin it has).
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:
            if image.format not in _OPENED_AS:  # a subclass plugin answering for one of them
                raise UnidentifiedImageError(image.format)
            check_pixels(image.width, image.height, where, settings)  # from the header: nothing decoded yet
            return _rgb_data(image)
    except _ImageRefused:
        raise
    except UnidentifiedImageError:
        raise ValueError(f"{where}: image is not {FORMAT_NAMES}") from None
    except Image.DecompressionBombError:
        raise ValueError(f"{where}: image has more pixels than max_image_pixels={settings.max_image_pixels}") from None
    except Exception as exc:  # noqa: BLE001 -- hostile bytes reach decoder paths that raise anything (OSError,
        # SyntaxError, struct.error, IndexError, MemoryError ...): each is this one request's bad input
        raise ValueError(f"{where}: image data is corrupt or truncated ({type(exc).__name__}: {exc})") from None


def image_from_pil(image: Any, where: str, settings: ImageConfig) -> ImageData:
    """A caller's PIL image (Python API; any format or none), its first frame as RGB, within max_image_pixels."""
    check_pixels(image.width, image.height, where, settings)
    try:
        if getattr(image, "is_animated", False):
            image.seek(0)
        return _rgb_data(image)
    except Exception as exc:  # noqa: BLE001 -- a lazily loaded PIL image may fail to decode now
        raise ValueError(f"{where}: image could not be read ({type(exc).__name__}: {exc})") from None


def check_bytes(size: int, where: str, settings: ImageConfig) -> None:
    if size > settings.max_image_bytes:
        raise _ImageRefused(f"{where}: image is {size} bytes, more than max_image_bytes={settings.max_image_bytes}")


def check_pixels(width: int, height: int, where: str, settings: ImageConfig) -> None:
    if width <= 0 or height <= 0:
        raise _ImageRefused(f"{where}: image has no pixels ({width}x{height})")
    if width * height > settings.max_image_pixels:
        raise _ImageRefused(f"{where}: image is {width}x{height} = {width * height} pixels, more than "
                            f"max_image_pixels={settings.max_image_pixels}")


class _ImageRefused(ValueError):
    """A limit refused the image (kept apart from the decoder's own ValueErrors, which mean corrupt data)."""


def _rgb_data(image: Any) -> ImageData:
    """The current frame as ImageData. Modes with alpha are put over white (as vLLM and transformers'
    processors do), not cut to their colour channels, where transparent pixels hold arbitrary colours."""
    from PIL import Image

    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        rgb = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    else:
        rgb = image.convert("RGB")
    return ImageData(rgb.tobytes(), rgb.width, rgb.height)

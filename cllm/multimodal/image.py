"""A decoded, checked image: the one form every protocol's image part and every backend's encoder meet in."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ImageData:
    """An image decoded to RGB. Equal pixels give equal ``hash`` whatever file or URL they came from:
    the prefix cache keys an image's span by it."""

    rgb: bytes = field(repr=False)  # width * height * 3 bytes, row-major RGB
    width: int  # pixels
    height: int  # pixels
    hash: str = ""  # sha256 hex of the size and the pixels; computed when not given

    def __post_init__(self) -> None:
        if len(self.rgb) != self.width * self.height * 3:
            raise ValueError(f"image data holds {len(self.rgb)} bytes, not {self.width}x{self.height}x3")
        if not self.hash:
            digest = hashlib.sha256(f"{self.width}x{self.height}:".encode())
            digest.update(self.rgb)
            object.__setattr__(self, "hash", digest.hexdigest())

    @classmethod
    def from_pil(cls, image: Any) -> ImageData:
        """From a PIL image (its first frame, converted to RGB)."""
        if getattr(image, "n_frames", 1) > 1:
            image.seek(0)
        rgb = image.convert("RGB")
        return cls(rgb.tobytes(), rgb.width, rgb.height)

    def to_pil(self) -> Any:
        from PIL import Image
        return Image.frombytes("RGB", (self.width, self.height), self.rgb)

"""Where an image sits in a prompt's ids."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cllm.multimodal.image import ImageData


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """An image's place in a prompt: ``length`` placeholder ids from ``start`` stand for its embeddings.

    The placeholder ids are real vocabulary ids (the model's image token), so penalties, n-gram drafts
    and detokenising treat them as ordinary ids; what tells two images apart is ``image.hash``, which
    the prefix caches compare besides the ids. The scheduler evaluates a span whole, in one step
    (``Request.chunk_end``), so that a backend encodes an image once and never splits its embeddings.
    """

    start: int  # index of the first placeholder in the prompt
    length: int  # placeholder ids (= the embeddings the encoder gives)
    image: ImageData  # the pixels
    n_pos: int = 0  # positions the span advances (M-RoPE models use fewer than ``length``); 0 = length
    payload: Any = field(default=None, compare=False, repr=False)  # the backend's prepared input (an mtmd chunk, pixel tensors)

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def positions(self) -> int:
        return self.n_pos or self.length


def cache_keys(token_ids: Sequence[int], spans: Sequence[ImageSpan]) -> list[int]:
    """What a prefix cache compares for a prompt with images: its ids, each image's placeholders replaced by
    keys made from the image's pixel hash, one per position (negative, so never a token id; within int64, as
    the torch block hashes pack them). Two prompts then share cached KV through an image only when the
    images are equal, whatever URL or file they came from."""
    keys = list(token_ids)
    for span in spans:
        end = min(span.end, len(keys))
        if span.start >= end:
            break
        base = -(int(span.image.hash[:11], 16) << 16)  # 44 bits of the hash, room for 65,536 positions
        keys[span.start:end] = [base - i - 1 for i in range(end - span.start)]
    return keys

"""A prompt with images in it, as the chat template leaves it: text ids, and where each image goes."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cllm.multimodal.image import ImageData
from cllm.multimodal.span import ImageSpan


@dataclass(frozen=True, slots=True)
class MultimodalPrompt:
    """Token ids of the prompt's text, and the images to insert between them.

    The backend that runs the request expands it (``Backend.expand_images``): each image becomes the
    model's image tokens, so how many ids a prompt holds is known only in the engine (an image's token
    count depends on the encoder and, for dynamic-resolution models, on the image's size).
    """

    ids: list[int]  # the text's ids
    images: tuple[tuple[int, ImageData], ...]  # (index in ids before which the image goes, image), in order
    # The request's max_tokens is a default the server chose from the text's length alone: once the images
    # are expanded, the engine lowers it to what the context leaves rather than refusing the request.
    fit_max_tokens: bool = False

    def __post_init__(self) -> None:
        last = 0
        for at, _ in self.images:
            if not last <= at <= len(self.ids):
                raise ValueError(f"image insert index {at} is out of order or outside the prompt's {len(self.ids)} ids")
            last = at


def text_ids(prompt: list[int] | MultimodalPrompt) -> list[int]:
    """A rendered prompt's text ids (all of it when it has no images)."""
    return prompt.ids if isinstance(prompt, MultimodalPrompt) else prompt


def ids_without_images(prompt: list[int] | MultimodalPrompt) -> list[int]:
    """``expanded_ids`` of an engine whose backend is elsewhere (an engine core process, Ray replicas): text
    prompts only."""
    if isinstance(prompt, MultimodalPrompt):
        raise ValueError("the ids of a prompt with images are known only where its engine runs (its images are "
                         "expanded there): use engine_process: off for /tokenize and token counts with images")
    return list(prompt)


def splice_images(prompt: MultimodalPrompt,
                  expand_one: Callable[[ImageData, int], tuple[Sequence[int], ImageSpan]]) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """A prompt's ids with each image's ids put in its place: ``expand_one(image, offset)`` gives the image's
    ids (markers and placeholders) and its span, placed as if those ids started at ``offset``
    (``Backend.expand_images`` of each backend)."""
    out: list[int] = []
    spans: list[ImageSpan] = []
    done = 0
    for at, image in prompt.images:
        out += prompt.ids[done:at]
        done = at
        image_ids, span = expand_one(image, len(out))
        out += image_ids
        spans.append(span)
    out += prompt.ids[done:]
    return out, tuple(spans)

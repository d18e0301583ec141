"""Images on the torch backend: a transformers vision-language model (``AutoModelForImageTextToText``) whose
language model runs over our paged KV through the generic path (hf_model.py).

The processor saved with the checkpoint (``AutoProcessor``) prepares each image as transformers does and
expands the model's image token into one placeholder per embedding (``expand``); the span's payload keeps
the processor's tensors. When the scheduler reaches a span, the model's own ``get_image_features`` (vision
tower and projector) encodes the image in that step, and its rows replace the placeholders' token
embeddings before the decoder runs (``features``), as transformers' ``masked_scatter`` does. The vision
tower keeps transformers' SDPA attention; only the decoder's layers use the paged attention.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cllm.multimodal.image import ImageData
from cllm.multimodal.span import ImageSpan

log = logging.getLogger("cllm.torch")

# Private-use characters around an image part when the processor's template is rendered to find what it
# writes for one (no template or vocabulary gives them meaning).
_BEFORE, _AFTER = "\ue020", "\ue021"


@dataclass(slots=True)
class ImageInputs:
    """One image as the processor prepared it (a span's payload)."""

    tensors: dict[str, torch.Tensor]  # pixel_values and the model's other image inputs (image_sizes, grid_thw, ...)
    rows: torch.Tensor  # offsets within the span of the image-token placeholders (the rows features fill)


def is_vision_config(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


def image_prompt_text(processor: Any) -> str:
    """What the model's chat template writes for an image part (``<image>``, ``<|vision_start|><|image_pad|>
    <|vision_end|>``, ``<start_of_image>`` ...), found by rendering one; the processor's image token when the
    processor has no template."""
    template = getattr(processor, "chat_template", None)
    if template:
        message = [{"role": "user", "content": [{"type": "text", "text": _BEFORE}, {"type": "image"},
                                                 {"type": "text", "text": _AFTER}]}]
        try:
            text = processor.apply_chat_template(message, tokenize=False, add_generation_prompt=False)
            start, end = text.find(_BEFORE), text.rfind(_AFTER)
            if 0 <= start < end:
                between = text[start + 1:end]
                if between.strip():
                    return between
        except Exception as err:  # a template that refuses this probe: fall back to the image token
            log.info("the processor's chat template did not render an image part (%s)", err)
    token = getattr(processor, "image_token", None)
    if not token:
        raise ValueError("the checkpoint's processor names no image token: cannot place images in prompts")
    return token


class TorchVision:
    """A VLM's image side: ``expand`` (processor) and ``features`` (vision tower + projector)."""

    def __init__(self, hf_model: Any, processor: Any, *, device: torch.device, dtype: torch.dtype) -> None:
        self.hf = hf_model
        self.processor = processor
        self.device, self.dtype = device, dtype
        config = hf_model.config
        token_id = getattr(config, "image_token_id", None)
        if token_id is None:
            token_id = getattr(config, "image_token_index", None)
        if token_id is None:
            raise ValueError("the model's config names no image_token_id")
        self.image_token_id = int(token_id)
        self.image_text = image_prompt_text(processor)

    @classmethod
    def load(cls, hf_model: Any, path: Path, *, device: torch.device, dtype: torch.dtype) -> TorchVision:
        from transformers import AutoProcessor

        try:
            processor = AutoProcessor.from_pretrained(path)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"the vision model at {str(path)!r} has no usable processor (AutoProcessor: {err}); "
                             "save the processor with the checkpoint") from None
        return cls(hf_model, processor, device=device, dtype=dtype)

    def expand(self, ids: Sequence[int], images: Sequence[tuple[int, ImageData]]) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """``Backend.expand_images`` for transformers' VLMs."""
        out: list[int] = []
        spans: list[ImageSpan] = []
        done = 0
        for at, image in images:
            out += ids[done:at]
            done = at
            image_ids, inputs = self._prepare(image)
            first = next(i for i, t in enumerate(image_ids) if t == self.image_token_id)
            last = max(i for i, t in enumerate(image_ids) if t == self.image_token_id)
            out += image_ids[:first]
            spans.append(ImageSpan(len(out), last + 1 - first, image, payload=ImageInputs(
                inputs, torch.tensor([i - first for i in range(first, last + 1) if image_ids[i] == self.image_token_id]))))
            out += image_ids[first:]
        out += ids[done:]
        return out, tuple(spans)

    def _prepare(self, image: ImageData) -> tuple[list[int], dict[str, torch.Tensor]]:
        try:
            batch = self.processor(text=[self.image_text], images=[image.to_pil()], return_tensors="pt",
                                   add_special_tokens=False)
        except (ValueError, TypeError, RuntimeError) as err:
            raise ValueError(f"the model's processor refused a {image.width}x{image.height} image: {err}") from None
        ids = batch["input_ids"][0].tolist()
        if self.image_token_id not in ids:
            raise ValueError("the model's processor put no image token in the prompt for an image")
        tensors = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "token_type_ids")
                   and isinstance(v, torch.Tensor)}
        return ids, tensors

    @torch.inference_mode()
    def features(self, span: ImageSpan) -> tuple[torch.Tensor, torch.Tensor]:
        """The span's placeholder offsets and the image's embeddings for them ``[n, hidden]``."""
        inputs: ImageInputs = span.payload
        tensors = {k: v.to(self.device, self.dtype if v.is_floating_point() else v.dtype)
                   for k, v in inputs.tensors.items()}
        out = self.hf.get_image_features(**tensors)
        feats = getattr(out, "pooler_output", out)
        if isinstance(feats, (list, tuple)):
            feats = torch.cat([f.reshape(-1, f.shape[-1]) for f in feats])
        feats = feats.reshape(-1, feats.shape[-1])
        if feats.shape[0] != len(inputs.rows):
            raise RuntimeError(f"the vision encoder gave {feats.shape[0]} embeddings for {len(inputs.rows)} image tokens")
        return inputs.rows, feats

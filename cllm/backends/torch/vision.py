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
import math
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
    mrope: torch.Tensor | None = None  # M-RoPE models: [3, span length] rope positions, relative to the span's start


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


_BIDIRECTIONAL_IMAGES = frozenset({"gemma3", "paligemma"})
# Processors whose video half needs torchvision (transformers 5.24), and their image token: built images-only.
_IMAGES_ONLY = {"Qwen2VLProcessor": "<|image_pad|>", "Qwen2_5_VLProcessor": "<|image_pad|>",
                "Qwen3VLProcessor": "<|image_pad|>"}


def _images_only_processor(path: Path, err: ImportError) -> Any:
    """The checkpoint's processor without its video processor (which needs torchvision; PyPI's torchvision
    does not load beside the CPU torch cllm pins): the image processor, tokenizer and chat template, with
    the image token the processor class would set. Images work; videos are not served anyway."""
    import json

    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    config = path / "processor_config.json"
    name = json.loads(config.read_text()).get("processor_class") if config.is_file() else None
    if name not in _IMAGES_ONLY:
        raise ValueError(f"the processor of {str(path)!r} needs a library cllm does not install ({err})") from None
    cls = getattr(transformers, name)
    processor = cls.__new__(cls)
    processor.image_processor = AutoImageProcessor.from_pretrained(path)
    processor.tokenizer = tokenizer = AutoTokenizer.from_pretrained(path)
    processor.video_processor = None
    template = path / "chat_template.jinja"
    processor.chat_template = template.read_text() if template.is_file() else getattr(tokenizer, "chat_template", None)
    processor.image_token = getattr(tokenizer, "image_token", None) or _IMAGES_ONLY[name]
    processor.image_token_id = tokenizer.convert_tokens_to_ids(processor.image_token)
    processor.video_token, processor.video_token_id = "<|video_pad|>", tokenizer.convert_tokens_to_ids("<|video_pad|>")
    return processor


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
        # Qwen2/2.5/3-VL: an image's tokens take 3-D rope positions (time, row, column) and advance the text's
        # position by less than their number (ImageSpan.n_pos); the model's own get_rope_index says how.
        self.uses_mrope = callable(getattr(getattr(hf_model, "model", None), "get_rope_index", None))
        # Gemma 3: an image's tokens attend to each other both ways (transformers' token_type_ids mask)
        self.bidirectional = config.model_type in _BIDIRECTIONAL_IMAGES

    @classmethod
    def load(cls, hf_model: Any, path: Path, *, device: torch.device, dtype: torch.dtype) -> TorchVision:
        from transformers import AutoProcessor

        try:
            processor = AutoProcessor.from_pretrained(path)
        except ImportError as err:  # a video processor that needs torchvision, which cllm does not install
            processor = _images_only_processor(path, err)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"the vision model at {str(path)!r} has no usable processor (AutoProcessor: {err}); "
                             "save the processor with the checkpoint") from None
        return cls(hf_model, processor, device=device, dtype=dtype)

    def expand_one(self, image: ImageData, offset: int) -> tuple[list[int], ImageSpan]:
        """One image's ids as the processor expands them, and its span (first to last image token), for
        splice_images."""
        image_ids, inputs = self._prepare(image)
        first = next(i for i, t in enumerate(image_ids) if t == self.image_token_id)
        last = max(i for i, t in enumerate(image_ids) if t == self.image_token_id)
        rows = torch.tensor([i - first for i in range(first, last + 1) if image_ids[i] == self.image_token_id])
        mrope = self._mrope(image_ids, inputs, first, last) if self.uses_mrope else None
        n_pos = int(mrope.max()) + 1 if mrope is not None else 0
        return image_ids, ImageSpan(offset + first, last + 1 - first, image, n_pos, payload=ImageInputs(inputs, rows, mrope))

    def _mrope(self, image_ids: list[int], inputs: dict[str, torch.Tensor], first: int, last: int) -> torch.Tensor:
        """The image tokens' rope positions ``[3, last + 1 - first]`` relative to the first one's text position
        (in the image's own prompt text the positions before it are 0..first-1, so that is ``first``)."""
        ids = torch.tensor([image_ids])
        types = (ids == self.image_token_id).to(torch.int32)
        grid = inputs.get("image_grid_thw")
        positions, _ = self.hf.model.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=grid)
        return positions[:, 0, first:last + 1] - first

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

    def encode_largest(self, max_pixels: int) -> int:
        """Encode a blank square image of ``max_pixels`` (the largest the server admits; the processor scales
        it to the most the model takes) and return how many embeddings it gave."""
        from PIL import Image

        side = math.isqrt(max_pixels)
        _, span = self.expand_one(ImageData.from_pil(Image.new("RGB", (side, side))), 0)
        return len(self.features(span)[1])

    def encoder_bytes(self, max_pixels: int) -> int:
        """CUDA: the device memory the largest image's encode allocates beyond what is held, measured by
        encoding one (:meth:`encode_largest`), so that the KV pool leaves it free (llama.cpp's warm-up
        encode before its KV sizing does the same). Elsewhere 0: a CPU's pool is not sized from memory."""
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        embeddings = self.encode_largest(max_pixels)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        log.info("the largest image (%d embeddings) takes %.0f MiB to encode; kept free beside the KV pool",
                 embeddings, peak / 2**20)
        return peak

    @staticmethod
    def image_range(span: ImageSpan) -> tuple[int, int]:
        """Positions [start, end) of the span's image tokens (its placeholders, markers between them included)."""
        rows = span.payload.rows
        return span.start + int(rows[0]), span.start + int(rows[-1]) + 1

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

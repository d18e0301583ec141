"""A seeded zoo of tiny random-weight vision-language models (VLMs), for tests, modelled on ``cllm.tiny_models``.

``build_tiny_vlm(family, path, seed=0)`` writes a Hugging Face model directory (config, float32 safetensors,
SmolLM2's tokenizer plus the family's image tokens, a short ChatML-like chat template, and the family's
processor with an image processor set up for the tiny image size) that ``AutoModelForImageTextToText`` and
``AutoProcessor`` load. ``convert_vlm_to_gguf(model_dir, out_dir)`` turns it into a text GGUF plus an mmproj
GGUF with llama.cpp's own converters (the sources vendored in llama-cpp-python's sdist).

Families (``VLM_FAMILIES``):

- ``"llava"``: LlavaForConditionalGeneration, llava-1.5 style: a 2-layer CLIP vision tower (hidden 32, patch 8,
  32x32 px images, quick_gelu as OpenAI's CLIP), features of the second-to-last layer without the CLS token,
  a GELU MLP projector, and a 2-layer llama text model (tied embeddings). One image = 16 ``<image>`` tokens.
  llama.cpp's ``convert_hf_to_gguf.py --mmproj`` only converts Pixtral towers for this class, so the mmproj
  comes from llama.cpp's legacy llava-1.5 path (``tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py
  --llava-projector``, run through a small shim for transformers 5's CLIPVisionModel layout), which writes the
  projector matrices and the patch-embedding kernel in f16 whatever ``--use-f32`` says; so this family's
  projector and patch kernel are rounded to f16-representable values at build time (the conversion is then
  lossless). NOTE: libmtmd 0.3.36's llava graph appends the CLS embedding *after* the patches (positions in
  that order) and then drops row 0 (patch 0), so its image embeddings do not match transformers' (it matches
  a re-implementation of that ordering to ~7e-4).
- ``"qwen2_vl"``: Qwen2VLForConditionalGeneration: a 3-layer Qwen2-VL vision tower (embed_dim 32, patch 8,
  temporal patch 2, 2x2 spatial merge; 64x64 px images; 3 layers because the converter maps ``merger.mlp.2``
  through the block-index table, which needs depth > 2), M-RoPE text model (2 heads of 32, mrope_section
  [4, 6, 6], the real models' 16:24:24 ratio). One image = ``<|vision_start|>`` + 16 ``<|image_pad|>`` +
  ``<|vision_end|>``. (Qwen2.5-VL adds windowed vision attention that a 4x4 merged grid cannot exercise;
  Qwen2-VL is the plainer M-RoPE family, supported by the converter and libmtmd.)
- ``"gemma3"``: Gemma3ForConditionalGeneration: a 2-layer SigLIP tower (hidden 32, patch 8, 64x64 px images,
  64 patches average-pooled to 4x4 = 16 tokens), RMS-normed linear projector, 2-layer Gemma 3 text model
  (both layers sliding, window 4096, wider than any test prompt: llama.cpp's gemma3 graph hard-codes Gemma 3's
  5-sliding-1-full pattern, so a 2-layer model is all-sliding there, and the sliding layers' rope, theta 10k, must
  be what transformers uses too). The processor expands the
  ``<start_of_image>`` that the chat template writes to ``\\n\\n<start_of_image>`` + 16 ``<image_soft_token>`` +
  ``<end_of_image>\\n\\n``; libmtmd writes ``<start_of_image>`` + 16 image embeddings + ``<end_of_image>``.

Checkpoint layout: transformers 5 saves CLIP/SigLIP towers as ``vision_tower.encoder...``; the saved
safetensors are rewritten to the real checkpoints' ``vision_tower.vision_model.encoder...`` (which llama.cpp's
converters expect and transformers maps back on load).

Qwen2-VL without torchvision: transformers 5.24 cannot construct ``Qwen2VLProcessor`` at all without torchvision
(its video-processor type check), so ``AutoProcessor.from_pretrained`` fails there for *any* Qwen2-VL;
``load_processor(path)`` falls back to an images-only processor from the same files.

Weights: as ``cllm.tiny_models``: transformers' initialisation under ``torch.manual_seed(seed)`` with
``initializer_range`` 0.1, then every vector parameter moved off its neutral value (``neutral + 0.2 * randn``).

Tokenizer: SmolLM2's (49,152 ids) plus the family's image tokens appended as special tokens (ids 49152...);
the text model's vocabulary is exactly the tokenizer's length, so converters see no padding rows.

Image preprocessing: every image processor resizes to the tiny image size and normalises with the mean/std
that the converted mmproj stores (llava: OpenAI CLIP's; qwen2_vl: OpenAI CLIP's; gemma3: 0.5/0.5), so an
image of exactly ``IMAGE_SIZE[family]`` pixels gives the same pixel values in transformers and in libmtmd.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from cllm.tiny_models import (
    BOS_ID,
    EOS_ID,
    INIT_RANGE,
    PAD_ID,
    VOCAB_SIZE,
    _randomize_vectors,
    smollm2_tokenizer_dir,
    tiny_config,
)

VLM_FAMILIES: tuple[str, ...] = ("llava", "qwen2_vl", "gemma3")

# Square images of this many pixels per side give exactly IMAGE_TOKENS[family] image tokens, unresized.
IMAGE_SIZE: dict[str, int] = {"llava": 32, "qwen2_vl": 64, "gemma3": 64}
PATCH_SIZE: dict[str, int] = {"llava": 8, "qwen2_vl": 8, "gemma3": 8}
IMAGE_TOKENS: dict[str, int] = {"llava": 16, "qwen2_vl": 16, "gemma3": 16}

# The special tokens each family appends to SmolLM2's vocabulary, in id order (the first gets id 49152).
SPECIAL_TOKENS: dict[str, tuple[str, ...]] = {
    "llava": ("<image>",),
    "qwen2_vl": ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
    "gemma3": ("<start_of_image>", "<end_of_image>", "<image_soft_token>"),
}

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# How each family's chat template renders an image content part (as the real family's template does).
_IMAGE_PART: dict[str, str] = {
    "llava": "<image>\n",
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "gemma3": "<start_of_image>",
}

# llama.cpp's sources as vendored in the llama-cpp-python sdist that cllm builds its llama-server from.
LLAMA_CPP_SOURCES = Path(os.environ.get(
    "CLLM_LLAMA_CPP_SOURCES",
    str(Path.home() / ".cache/cllm/llama-server-0.3.36/llama_cpp_python-0.3.36/vendor/llama.cpp")))


def chat_template(family: str) -> str:
    """A short ChatML template; image parts (``{"type": "image"}`` / ``"image_url"``) render as the family's
    image placeholder, string content as is."""
    image = json.dumps(_IMAGE_PART[family])
    return (
        "{%- for message in messages -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
        "{%- if message['content'] is string -%}{{- message['content'] -}}"
        "{%- else -%}{%- for part in message['content'] -%}"
        "{%- if part['type'] in ('image', 'image_url') -%}{{- " + image + " -}}"
        "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


def token_ids(family: str) -> dict[str, int]:
    """The ids of ``family``'s added special tokens."""
    return {tok: VOCAB_SIZE + i for i, tok in enumerate(SPECIAL_TOKENS[family])}


def vocab_size(family: str) -> int:
    return VOCAB_SIZE + len(SPECIAL_TOKENS[family])


def _text_settings() -> dict[str, Any]:
    return dict(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)


def vlm_config(family: str):
    """The transformers config of ``family``'s tiny VLM."""
    from transformers import Gemma3Config, LlavaConfig, Qwen2VLConfig

    ids = token_ids(family)
    n_vocab = vocab_size(family)
    if family == "llava":
        text = tiny_config("llama", vocab_size=n_vocab, tie_word_embeddings=True).to_dict()
        vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, image_size=IMAGE_SIZE[family], patch_size=PATCH_SIZE[family],
                      hidden_act="quick_gelu", layer_norm_eps=1e-5, projection_dim=32,
                      initializer_range=INIT_RANGE, initializer_factor=1.0)
        return LlavaConfig(text_config=text, vision_config=vision, image_token_index=ids["<image>"],
                           image_seq_length=IMAGE_TOKENS[family], projector_hidden_act="gelu",
                           vision_feature_select_strategy="default", vision_feature_layer=-2,
                           multimodal_projector_bias=True, tie_word_embeddings=True, **_text_settings())
    if family == "qwen2_vl":
        text = dict(model_type="qwen2_vl_text", vocab_size=n_vocab, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-6,
                    max_position_embeddings=4096, initializer_range=INIT_RANGE, use_sliding_window=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]},
                    tie_word_embeddings=True, **_text_settings())
        vision = dict(depth=3, embed_dim=32, hidden_size=64, hidden_act="quick_gelu", mlp_ratio=2, num_heads=2,
                      in_channels=3, patch_size=PATCH_SIZE[family], spatial_merge_size=2, temporal_patch_size=2,
                      initializer_range=INIT_RANGE)
        return Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                             video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                             vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True,
                             initializer_range=INIT_RANGE, **_text_settings())
    if family == "gemma3":
        # query_pre_attn_scalar = head_dim: the converter does not write it (llama.cpp scales by 1/sqrt(head_dim)).
        text = tiny_config("gemma3_text", vocab_size=n_vocab, num_hidden_layers=2, sliding_window=4096,
                           query_pre_attn_scalar=16,
                           layer_types=["sliding_attention", "sliding_attention"]).to_dict()
        vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, image_size=IMAGE_SIZE[family], patch_size=PATCH_SIZE[family],
                      hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, vision_use_head=False)
        return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=IMAGE_TOKENS[family],
                            boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                            image_token_index=ids["<image_soft_token>"], initializer_range=INIT_RANGE,
                            tie_word_embeddings=True, **_text_settings())
    raise ValueError(f"unknown tiny VLM family {family!r}; one of {', '.join(VLM_FAMILIES)}")


def model_class(family: str):
    from transformers import Gemma3ForConditionalGeneration, LlavaForConditionalGeneration, Qwen2VLForConditionalGeneration

    return {"llava": LlavaForConditionalGeneration, "qwen2_vl": Qwen2VLForConditionalGeneration,
            "gemma3": Gemma3ForConditionalGeneration}[family]


def _round_f16(model: Any, names: tuple[str, ...]) -> None:
    """Round the matrices/kernels whose names contain one of ``names`` to f16-representable float32 values."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and any(n in name for n in names):
                p.copy_(p.to(torch.float16).to(torch.float32))


def _seeded_model(cls: Any, config: Any, seed: int) -> tuple[Any, Any]:
    """``cls`` built from ``config`` under ``seed``, vectors randomised, and every matrix transformers initialises
    to a constant (Gemma 3's mm_input_projection_weight is zeros) drawn from normal(0, INIT_RANGE), so that no
    projector output is identically zero; also the generator, for the caller's own further draws."""
    import torch

    torch.manual_seed(seed)
    model = cls._from_config(config, dtype=torch.float32)
    _randomize_vectors(model, torch.Generator().manual_seed(seed + 1))
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for _, p in model.named_parameters():
            flat = p.reshape(-1)
            if p.dim() >= 2 and bool((flat == flat[0]).all()):
                p.copy_(torch.randn(p.shape, generator=g) * INIT_RANGE)
    return model, g


def build_vlm(family: str, *, seed: int = 0):
    """``family``'s tiny VLM, in memory, in eval mode (float32, seeded, vectors randomised)."""
    import torch

    config = vlm_config(family)
    model, g = _seeded_model(model_class(family), config, seed)
    if family == "llava":
        # The legacy llava mmproj converter stores these in f16 (see the module docstring).
        _round_f16(model, ("multi_modal_projector.", "patch_embedding."))
    if family == "qwen2_vl":
        # The pad id's embedding row (id 2, <|im_end|>, which every ChatML turn ends with) is initialised to
        # zeros; llama.cpp's Qwen2-VL graph turns a zero input row into NaN logits for everything after it
        # (text prompts alone, no image needed). Real checkpoints have no zero row: give it random values.
        with torch.no_grad():
            model.get_input_embeddings().weight[config.text_config.pad_token_id].copy_(
                torch.randn(config.text_config.hidden_size, generator=g) * INIT_RANGE)
    return model.eval()


def build_tokenizer(family: str):
    """SmolLM2's tokenizer plus ``family``'s special tokens and chat template."""
    from transformers import AutoTokenizer

    extra: dict[str, Any] = {}
    if family == "gemma3":
        extra["extra_special_tokens"] = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                         "image_token": "<image_soft_token>"}
    elif family == "llava":
        extra["extra_special_tokens"] = {"image_token": "<image>"}
    elif family == "qwen2_vl":
        extra["extra_special_tokens"] = {"vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
                                         "image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
    tok = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()), **extra)
    from tokenizers import AddedToken

    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS[family]],
                   special_tokens=True)
    got = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS[family]))
    if got != list(token_ids(family).values()) or len(tok) != vocab_size(family):
        raise RuntimeError(f"tiny {family}: added tokens got ids {got}, tokenizer length {len(tok)}")
    tok.chat_template = chat_template(family)
    return tok


def build_processor(family: str, tokenizer: Any = None):
    """``family``'s processor, its image processor set up for the tiny image size."""
    tok = tokenizer if tokenizer is not None else build_tokenizer(family)
    size = IMAGE_SIZE[family]
    template = chat_template(family)
    if family == "llava":
        from transformers import CLIPImageProcessorPil as CLIPImageProcessor, LlavaProcessor

        ip = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size},
                                do_center_crop=True, image_mean=CLIP_MEAN, image_std=CLIP_STD)
        return LlavaProcessor(image_processor=ip, tokenizer=tok, chat_template=template,
                              patch_size=PATCH_SIZE[family], vision_feature_select_strategy="default",
                              num_additional_image_tokens=1, image_token="<image>")
    if family == "qwen2_vl":
        from transformers import Qwen2VLImageProcessorPil as Qwen2VLImageProcessor, Qwen2VLProcessor

        pixels = {"min_pixels": 8 * 16 * 16, "max_pixels": 4096 * 16 * 16}  # clip.cpp's limits: 8..4096 tokens
        ip = Qwen2VLImageProcessor(size={"shortest_edge": pixels["min_pixels"], "longest_edge": pixels["max_pixels"]},
                                   patch_size=PATCH_SIZE[family], temporal_patch_size=2, merge_size=2,
                                   image_mean=CLIP_MEAN, image_std=CLIP_STD)
        return _qwen2_vl_processor(ip, tok, template)
    if family == "gemma3":
        from transformers import Gemma3ImageProcessorPil as Gemma3ImageProcessor, Gemma3Processor

        ip = Gemma3ImageProcessor(size={"height": size, "width": size}, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                  resample=2)  # bilinear, as clip.cpp resizes Gemma 3 images
        return Gemma3Processor(image_processor=ip, tokenizer=tok, chat_template=template,
                               image_seq_length=IMAGE_TOKENS[family])
    raise ValueError(f"unknown tiny VLM family {family!r}; one of {', '.join(VLM_FAMILIES)}")


def _qwen2_vl_video_settings() -> dict[str, Any]:
    """Qwen2VLVideoProcessor's settings, matching the image processor's."""
    pixels = {"min_pixels": 8 * 16 * 16, "max_pixels": 4096 * 16 * 16}
    return dict(size={"shortest_edge": pixels["min_pixels"], "longest_edge": pixels["max_pixels"]},
                patch_size=PATCH_SIZE["qwen2_vl"], temporal_patch_size=2, merge_size=2,
                image_mean=CLIP_MEAN, image_std=CLIP_STD)


def _qwen2_vl_processor(ip: Any, tok: Any, template: str):
    """Qwen2VLProcessor. transformers 5.24 cannot construct one without torchvision (its __init__ type-checks the
    video processor against a class that only exists with torchvision, even for ``None``), so without
    torchvision this builds an images-only instance field by field (``video_processor`` None)."""
    from transformers import Qwen2VLProcessor
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        from transformers import Qwen2VLVideoProcessor

        return Qwen2VLProcessor(image_processor=ip, tokenizer=tok, chat_template=template,
                                video_processor=Qwen2VLVideoProcessor(**_qwen2_vl_video_settings()))
    proc = Qwen2VLProcessor.__new__(Qwen2VLProcessor)
    proc.chat_template = template
    proc.image_processor, proc.tokenizer, proc.video_processor = ip, tok, None
    proc.image_token, proc.video_token = "<|image_pad|>", "<|video_pad|>"
    proc.image_token_id = tok.convert_tokens_to_ids(proc.image_token)
    proc.video_token_id = tok.convert_tokens_to_ids(proc.video_token)
    return proc


def save_processor(processor: Any, path: Path) -> None:
    """``processor.save_pretrained(path)``; for an images-only Qwen2VLProcessor (no torchvision), the same files
    written by hand: tokenizer files, chat_template.jinja and a processor_config.json with both the image
    processor's and an equivalent video processor's settings, as transformers writes them with torchvision."""
    path = Path(path)
    if getattr(processor, "video_processor", False) is not None:
        processor.save_pretrained(str(path))
        return
    processor.tokenizer.save_pretrained(str(path))
    (path / "chat_template.jinja").write_text(processor.chat_template)
    video = {**_qwen2_vl_video_settings(), "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
             "do_resize": True, "rescale_factor": 1 / 255, "resample": 3,
             "video_processor_type": "Qwen2VLVideoProcessor"}
    config = {"image_processor": processor.image_processor.to_dict(), "video_processor": video,
              "processor_class": "Qwen2VLProcessor"}
    config["image_processor"].pop("processor_class", None)
    (path / "processor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    tok_config["processor_class"] = "Qwen2VLProcessor"
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")


def load_processor(path: Path):
    """``AutoProcessor.from_pretrained(path)``; for Qwen2-VL without torchvision (where transformers cannot build
    Qwen2VLProcessor), the images-only processor from the same files."""
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    path = Path(path)
    if _family_of(path) != "qwen2_vl" or is_torchvision_available():
        return AutoProcessor.from_pretrained(str(path))
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    config = json.loads((path / "processor_config.json").read_text())
    ip_config = {k: v for k, v in config["image_processor"].items() if k != "image_processor_type"}
    return _qwen2_vl_processor(Qwen2VLImageProcessorPil(**ip_config), AutoTokenizer.from_pretrained(str(path)),
                               (path / "chat_template.jinja").read_text())


def sample_image(family: str, seed: int = 0):
    """A deterministic RGB PIL image of exactly the family's image size (smooth gradients plus noise)."""
    import numpy as np
    from PIL import Image

    n = IMAGE_SIZE[family]
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:n, 0:n].astype(np.float32) / max(n - 1, 1)
    base = np.stack([x, y, 1 - (x + y) / 2], axis=-1) * 200 + 20
    img = np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(img, "RGB")


def build_tiny_vlm(family: str, path: Path, *, seed: int = 0) -> Path:
    """Build ``family``'s tiny VLM and save it (model, tokenizer, processor, chat template) at ``path``."""
    import torch

    path = Path(path)
    model = build_vlm(family, seed=seed)
    processor = build_processor(family)
    # Sanity: the processor expands the image, the model runs on it and gives finite, varied logits.
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=prompt, images=[sample_image(family)], return_tensors="pt")
    image_id = model.config.image_token_id
    if int((inputs["input_ids"] == image_id).sum()) != IMAGE_TOKENS[family]:
        raise RuntimeError(f"tiny {family}: processor gave {int((inputs['input_ids'] == image_id).sum())} image "
                           f"tokens, expected {IMAGE_TOKENS[family]}")
    with torch.no_grad():
        logits = model(**inputs).logits[0]
    if not torch.isfinite(logits).all():
        raise RuntimeError(f"tiny {family}: non-finite logits")
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    if family in ("llava", "gemma3"):
        _restore_vision_model_prefix(path)
    save_processor(processor, path)
    return path


# Families built for the torch backend only (no llama.cpp conversion in tests/assets): same tokenizer, processor
# settings and image size as their sibling in VLM_FAMILIES.
TORCH_ONLY_FAMILIES: dict[str, str] = {"qwen2_5_vl": "qwen2_vl"}


def build_tiny_qwen2_5_vl(path: Path, *, seed: int = 0) -> Path:
    """A tiny Qwen2.5-VL (its windowed-attention vision tower: 2 blocks, the second full attention; the text model
    and the processor of the ``qwen2_vl`` family, processor class Qwen2_5_VLProcessor), saved at ``path``."""
    import json

    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    base = vlm_config("qwen2_vl")
    text = base.text_config.to_dict()
    text["model_type"] = "qwen2_5_vl_text"
    vision = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, in_channels=3,
                  patch_size=PATCH_SIZE["qwen2_vl"], spatial_merge_size=2, temporal_patch_size=2, window_size=32,
                  fullatt_block_indexes=[1], initializer_range=INIT_RANGE, hidden_act="silu")
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=base.image_token_id,
                              video_token_id=base.video_token_id, vision_start_token_id=base.vision_start_token_id,
                              vision_end_token_id=base.vision_end_token_id, tie_word_embeddings=True)
    model, g = _seeded_model(Qwen2_5_VLForConditionalGeneration, config, seed)
    with torch.no_grad():
        model.get_input_embeddings().weight[text["pad_token_id"]].copy_(torch.randn(64, generator=g) * INIT_RANGE)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(str(path))
    save_processor(build_processor("qwen2_vl"), path)
    processor_config = path / "processor_config.json"
    saved = json.loads(processor_config.read_text())
    saved["processor_class"] = "Qwen2_5_VLProcessor"
    processor_config.write_text(json.dumps(saved, indent=2))
    return path


def _restore_vision_model_prefix(path: Path) -> None:
    """transformers 5 drops the ``vision_model.`` level of CLIP/SigLIP towers and saves ``vision_tower.encoder...``;
    real checkpoints (and llama.cpp's converters) have ``vision_tower.vision_model.encoder...``. Rewrite the keys to
    the real layout (transformers maps them back on load)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            metadata = sf.metadata()
            tensors = {k: sf.get_tensor(k) for k in sf.keys()}
        renamed = {("vision_tower.vision_model." + k[len("vision_tower."):]
                    if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.") else k): v
                   for k, v in tensors.items()}
        save_file(renamed, str(f), metadata=metadata)


def _run(cmd: list[str], sources: Path | None = None) -> None:
    with tempfile.TemporaryDirectory(prefix="cllm-convert-") as stub:
        paths = [str(LLAMA_CPP_SOURCES / "gguf-py") if sources is None else str(sources / "gguf-py")]
        try:
            import sentencepiece  # noqa: F401
        except ImportError:
            # LlamaModel.set_vocab imports sentencepiece before it looks for tokenizer.model (absent here: SmolLM2's
            # tokenizer is BPE, so the converter falls back to tokenizer.json); a stub lets it get that far.
            (Path(stub) / "sentencepiece").mkdir()
            (Path(stub) / "sentencepiece" / "__init__.py").write_text(
                "class SentencePieceProcessor:\n    def __init__(self, *a, **k):\n"
                "        raise ImportError('sentencepiece stub (cllm.tiny_vlms)')\n")
            paths.append(stub)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}")


def _check_sources(sources: Path) -> Path:
    script = sources / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise FileNotFoundError(
            f"llama.cpp's converter not found at {script}: unpack the llama-cpp-python 0.3.36 sdist there "
            f"(cllm's llama-server build does), or set CLLM_LLAMA_CPP_SOURCES / pass sources= to its vendor/llama.cpp")
    return script


def _family_of(model_dir: Path) -> str:
    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    for family in VLM_FAMILIES:
        if model_type == family:
            return family
    raise ValueError(f"{model_dir}: model_type {model_type!r} is not a tiny VLM family")


# The legacy script predates transformers 5, whose CLIPVisionModel has no ``.vision_model`` level (the script pops
# ``model.vision_model.encoder.layers[-1]`` and names tensors from ``vision_model.*`` keys): run it unchanged with
# CLIPVisionModel.from_pretrained returning the model wrapped in that level.
_LEGACY_RUNNER = """\
import runpy, sys
import torch, transformers

class _LegacyLayout(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.vision_model = model

_load = transformers.CLIPVisionModel.from_pretrained
transformers.CLIPVisionModel.from_pretrained = lambda *a, **k: _LegacyLayout(_load(*a, **k))
sys.argv[0] = {script!r}
sys.path.insert(0, {script!r}.rsplit('/', 1)[0])
runpy.run_path({script!r}, run_name='__main__')
"""


def _llava_legacy_mmproj(model_dir: Path, out: Path, sources: Path) -> None:
    """llava-1.5's mmproj via llama.cpp's legacy ``convert_image_encoder_to_gguf.py``: the CLIP tower saved
    on its own (``--clip-model-is-vision``) plus the projector weights as ``llava.projector``."""
    import torch
    from safetensors.torch import load_file
    from transformers import CLIPVisionConfig, CLIPVisionModel

    config = json.loads((model_dir / "config.json").read_text())
    state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    with tempfile.TemporaryDirectory(prefix="cllm-llava-mmproj-") as tmp:
        tmp_p = Path(tmp)
        vdir = tmp_p / "vision"
        vcfg = CLIPVisionConfig(**{k: v for k, v in config["vision_config"].items() if k != "model_type"})
        vision = CLIPVisionModel(vcfg)
        prefix = "vision_tower.vision_model."
        vstate = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        missing, unexpected = vision.load_state_dict(vstate, strict=False)
        if unexpected or [m for m in missing if not m.endswith("position_ids")]:
            raise RuntimeError(f"llava vision tower: missing {missing}, unexpected {unexpected}")
        vision.save_pretrained(str(vdir))
        # With vision_feature_layer in the config the script writes clip.vision.feature_layer, and clip.cpp then
        # runs exactly that many layers; without it the script drops the last layer *and* clip.cpp runs
        # n_layer - 1 of the remaining ones (one layer short of transformers' vision_feature_layer -2).
        vconf = json.loads((vdir / "config.json").read_text())
        vconf["vision_feature_layer"] = config.get("vision_feature_layer", -2)
        (vdir / "config.json").write_text(json.dumps(vconf, indent=2))
        pprefix = next(p for p in ("model.multi_modal_projector.", "multi_modal_projector.") if any(k.startswith(p) for k in state))
        proj = {"multi_modal_projector." + k[len(pprefix):]: v for k, v in state.items() if k.startswith(pprefix)}
        torch.save(proj, str(tmp_p / "llava.projector"))
        odir = tmp_p / "out"
        legacy = sources / "tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py"
        runner = tmp_p / "run_legacy.py"
        runner.write_text(_LEGACY_RUNNER.format(script=str(legacy)))
        _run([sys.executable, str(runner),
              "-m", str(vdir), "--llava-projector", str(tmp_p / "llava.projector"), "--output-dir", str(odir),
              "--clip-model-is-vision", "--use-f32", "--projector-type", "mlp",
              "--image-mean", *map(str, CLIP_MEAN), "--image-std", *map(str, CLIP_STD)], sources)
        shutil.move(str(odir / "mmproj-model-f32.gguf"), str(out))


def convert_vlm_to_gguf(model_dir: Path, out_dir: Path, *, name: str | None = None,
                        sources: Path | None = None) -> tuple[Path, Path]:
    """Convert a tiny VLM directory to ``(out_dir/tiny-NAME-f32.gguf, out_dir/mmproj-tiny-NAME-f32.gguf)`` with
    llama.cpp's converters (``convert_hf_to_gguf.py --outtype f32``, and ``--mmproj`` for the projector; the
    legacy llava-1.5 script for ``llava``). ``NAME`` defaults to the family; ``sources`` to ``LLAMA_CPP_SOURCES``."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    sources = Path(sources) if sources is not None else LLAMA_CPP_SOURCES
    script = _check_sources(sources)
    family = _family_of(model_dir)
    name = name or family.replace("_", "-")
    out_dir.mkdir(parents=True, exist_ok=True)
    text_out = out_dir / f"tiny-{name}-f32.gguf"
    mmproj_out = out_dir / f"mmproj-tiny-{name}-f32.gguf"
    _run([sys.executable, str(script), str(model_dir), "--outtype", "f32", "--outfile", str(text_out)], sources)
    if family == "llava":
        _llava_legacy_mmproj(model_dir, mmproj_out, sources)
    else:
        _run([sys.executable, str(script), str(model_dir), "--outtype", "f32", "--mmproj", "--outfile", str(mmproj_out)], sources)
    return text_out, mmproj_out


IMAGE_CHUNK = 1  # MTMD_INPUT_CHUNK_TYPE_IMAGE


_LOG_SINK: Any = None


def _quiet_llama_cpp() -> None:
    """Drop llama.cpp's and libmtmd's log output (the callback is kept alive for the process)."""
    global _LOG_SINK
    import llama_cpp
    from llama_cpp import mtmd_cpp as mtmd

    if _LOG_SINK is None:
        _LOG_SINK = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
    llama_cpp.llama_log_set(_LOG_SINK, None)
    mtmd.mtmd_log_set(_LOG_SINK, None)
    mtmd.mtmd_helper_log_set(_LOG_SINK, None)


def mtmd_run(text_gguf: Path, mmproj_gguf: Path, image: Any, prompt: str | None = None, *, n_threads: int = 2,
             decode: bool = True, verbose: bool = False) -> dict[str, Any]:
    """Run an image through llama.cpp's libmtmd (llama-cpp-python's low-level bindings), on the CPU.

    Tokenizes ``prompt`` (default: just the media marker; special tokens parsed, no BOS added) with one bitmap of
    ``image`` (an RGB PIL image, passed unresized), encodes the image chunk, and (``decode``) evaluates the whole
    prompt teacher-forced: text chunks through ``llama_decode`` with logits for every token, the image chunk
    through ``mtmd_helper_decode_image_chunk`` (which sets up non-causal attention / M-RoPE positions itself).

    Returns ``chunks`` (per chunk: ``type`` 0 text / 1 image, ``n_tokens``, ``n_pos``, ``tokens`` for text
    chunks), ``use_non_causal`` / ``use_mrope`` (libmtmd's ``mtmd_decode_use_*``), ``marker``, ``image_embd``
    (float32 ``[n_image_tokens, n_embd]``, the projector's output) and, with ``decode``, ``logits`` (float32
    ``[n_text_tokens, n_vocab]``, one row per text token in order) and ``n_past`` (positions used).

    Crashes in native code take the process down: callers that must survive one run this in a subprocess."""
    import ctypes

    import llama_cpp
    import numpy as np
    from llama_cpp import mtmd_cpp as mtmd

    llama_cpp.llama_backend_init()
    if not verbose:
        _quiet_llama_cpp()
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(text_gguf).encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {text_gguf}")
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 512, 512, 512
    cparams.n_threads = cparams.n_threads_batch = n_threads
    if os.environ.get("CLLM_TINY_VLM_FA") is not None:
        cparams.flash_attn_type = int(os.environ["CLLM_TINY_VLM_FA"])
    lctx = llama_cpp.llama_init_from_model(model, cparams)
    params = mtmd.mtmd_context_params_default()
    params.use_gpu = False
    params.n_threads = n_threads
    params.print_timings = False
    params.warmup = False
    ctx = mtmd.mtmd_init_from_file(str(mmproj_gguf).encode(), model, params)
    if not ctx:
        raise RuntimeError(f"libmtmd could not load {mmproj_gguf}")
    out: dict[str, Any] = {}
    try:
        marker = mtmd.mtmd_default_marker().decode()
        text = (prompt if prompt is not None else "{marker}").replace("{marker}", marker).encode()
        rgb = np.ascontiguousarray(np.asarray(image.convert("RGB"), dtype=np.uint8))
        ny, nx = rgb.shape[:2]
        buf = (ctypes.c_ubyte * rgb.size).from_buffer_copy(rgb.tobytes())
        bitmap = mtmd.mtmd_bitmap_init(nx, ny, buf)
        chunks = mtmd.mtmd_input_chunks_init()
        inp = mtmd.mtmd_input_text(text=text, text_len=len(text), add_special=False, parse_special=True)
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        rc = mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(inp), bitmaps, 1)
        if rc != 0:
            raise RuntimeError(f"mtmd_tokenize returned {rc}")
        out.update(marker=marker, use_mrope=bool(mtmd.mtmd_decode_use_mrope(ctx)),
                   use_non_causal=bool(mtmd.mtmd_decode_use_non_causal(ctx, None)), chunks=[])
        n_embd = llama_cpp.llama_model_n_embd(model)
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        logits: list[Any] = []
        n_past = 0
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            ctype = int(mtmd.mtmd_input_chunk_get_type(chunk))
            info: dict[str, Any] = {"type": ctype, "n_tokens": int(mtmd.mtmd_input_chunk_get_n_tokens(chunk)),
                                    "n_pos": int(mtmd.mtmd_input_chunk_get_n_pos(chunk))}
            if ctype == IMAGE_CHUNK:
                if mtmd.mtmd_encode_chunk(ctx, chunk) != 0:
                    raise RuntimeError("mtmd_encode_chunk failed")
                embd_ptr = mtmd.mtmd_get_output_embd(ctx)
                n = info["n_tokens"]
                embd = np.ctypeslib.as_array(ctypes.cast(embd_ptr, ctypes.POINTER(ctypes.c_float)), shape=(n * n_embd,))
                out["image_embd"] = embd.reshape(n, n_embd).copy()
                info["use_non_causal"] = bool(mtmd.mtmd_decode_use_non_causal(ctx, chunk))
                if decode:
                    new_n_past = llama_cpp.llama_pos(0)
                    rc = mtmd.mtmd_helper_decode_image_chunk(ctx, lctx, chunk, embd_ptr, n_past, 0, 512,
                                                             ctypes.byref(new_n_past),
                                                             mtmd.mtmd_helper_post_decode_callback(), None)
                    if rc != 0:
                        raise RuntimeError(f"mtmd_helper_decode_image_chunk returned {rc}")
                    n_past = new_n_past.value
            else:
                n_tok = ctypes.c_size_t(0)
                ptr = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n_tok))
                info["tokens"] = [int(ptr[j]) for j in range(n_tok.value)]
                if decode and info["tokens"]:
                    toks = info["tokens"]
                    batch = llama_cpp.llama_batch_init(len(toks), 0, 1)
                    try:
                        batch.n_tokens = len(toks)
                        for j, t in enumerate(toks):
                            batch.token[j], batch.pos[j], batch.n_seq_id[j] = t, n_past + j, 1
                            batch.seq_id[j][0], batch.logits[j] = 0, True
                        if llama_cpp.llama_decode(lctx, batch) != 0:
                            raise RuntimeError("llama_decode failed")
                        for j in range(len(toks)):
                            row = llama_cpp.llama_get_logits_ith(lctx, j)
                            logits.append(np.ctypeslib.as_array(row, shape=(n_vocab,)).copy())
                    finally:
                        llama_cpp.llama_batch_free(batch)
                    n_past += len(toks)
            out["chunks"].append(info)
        if decode:
            out["logits"] = np.stack(logits) if logits else np.zeros((0, n_vocab), np.float32)
            out["n_past"] = n_past
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
    finally:
        mtmd.mtmd_free(ctx)
        llama_cpp.llama_free(lctx)
        llama_cpp.llama_model_free(model)
    return out


def image_placeholder_ids(family: str, chunks: list[dict[str, Any]]) -> list[int]:
    """The transformers input ids equivalent to libmtmd's chunks: text tokens as they are, each image chunk as
    ``n_tokens`` copies of the model's image token id."""
    image_id = token_ids(family)[{"llava": "<image>", "qwen2_vl": "<|image_pad|>", "gemma3": "<image_soft_token>"}[family]]
    ids: list[int] = []
    for c in chunks:
        ids += [image_id] * c["n_tokens"] if c["type"] == IMAGE_CHUNK else c["tokens"]
    return ids


def hf_image_features(model: Any, inputs: Any):
    """transformers' projector output for the processor's ``inputs``: ``[n_image_tokens, text_hidden]``."""
    import torch

    kwargs = {"pixel_values": inputs["pixel_values"]}
    if "image_grid_thw" in inputs:
        kwargs["image_grid_thw"] = inputs["image_grid_thw"]
    with torch.no_grad():
        feats = model.get_image_features(**kwargs)
    feats = getattr(feats, "pooler_output", feats)
    if isinstance(feats, (list, tuple)):
        feats = torch.cat([f.reshape(-1, f.shape[-1]) for f in feats])
    return feats.reshape(-1, feats.shape[-1]).float()


__all__ = ["VLM_FAMILIES", "IMAGE_SIZE", "IMAGE_TOKENS", "PATCH_SIZE", "SPECIAL_TOKENS", "LLAMA_CPP_SOURCES",
           "build_processor", "build_tiny_vlm", "load_processor", "save_processor", "build_tokenizer", "build_vlm", "chat_template",
           "convert_vlm_to_gguf", "hf_image_features", "image_placeholder_ids", "model_class", "mtmd_run", "sample_image", "token_ids", "vlm_config", "vocab_size"]

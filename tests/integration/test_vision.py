"""Images through the engine, on both backends, with the tiny VLM zoo (cllm/tiny_vlms.py): seeded random
LLaVA (CLIP tower), Qwen2-VL (M-RoPE) and Gemma 3 (SigLIP) checkpoints built by transformers, and their
llama.cpp conversions (tests/assets/models/, made from these very builds).

What is asserted, and why these tolerances:
- torch, float32: the teacher-forced logprobs of a greedy reply to a prompt holding an image equal
  transformers' own forward of the same ids and pixels within 1e-4 (measured 1.4e-6 at most: the same kernels, the
  decoder's attention over the paged pool instead of SDPA over a dense tensor).
- llama.cpp, f32 weights and f32 KV cache: within 1e-3 of transformers (measured 2.0e-4 Gemma 3, 4.0e-4
  Qwen2-VL: ggml's fused/reordered reductions, its tanh GELU in the projector; an f16 KV cache, the default,
  puts it at ~4e-3). LLaVA is not among the llama.cpp families: llama.cpp 0.3.36's clip.cpp orders the CLS
  embedding differently from transformers for a llava-1.5 tower (test_tiny_vlms pins that, xfail strict).
- Batching: a request's greedy tokens are the same alone and beside another request with another image; its
  logprobs within 1e-4 (torch) — float rounding of a batched matmul may differ, the tokens may not.
- Prefix cache: the same image again reuses the cached KV through the image (cached_tokens past its span);
  another image with the same text reuses only the text before it (keys are the pixels' hash).
"""
from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cllm import LLM  # noqa: E402
from cllm import tiny_vlms as tv
from cllm.multimodal import ImageData  # noqa: E402
from cllm.sampling.params import SamplingParams  # noqa: E402

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "models"
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=1)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlms")
    return {f: tv.build_tiny_vlm(f, root / f) for f in tv.VLM_FAMILIES}


def image(family: str, seed: int = 0) -> ImageData:
    return ImageData.from_pil(tv.sample_image(family, seed=seed))


def chat(img: ImageData, text: str = "What is in the picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image", "image": img},
                                         {"type": "text", "text": text}]}]


def hf_logprobs(family: str, model_dir: Path, out, img: ImageData) -> list[float]:
    """transformers' teacher-forced logprobs of ``out``'s tokens, given its prompt ids and the image."""
    model = tv.model_class(family).from_pretrained(model_dir).eval()
    processor = tv.load_processor(model_dir)
    token = model.config.image_token_id if getattr(model.config, "image_token_id", None) is not None \
        else model.config.image_token_index
    ids = torch.tensor([out.prompt_token_ids + out.outputs[0].token_ids])
    inputs = processor.image_processor(images=[img.to_pil()], return_tensors="pt")
    extra = {k: v for k, v in inputs.items() if k in ("pixel_values", "image_grid_thw", "image_sizes")}
    if family == "qwen2_vl":
        extra["mm_token_type_ids"] = (ids == token).to(torch.int32)
    if family == "gemma3":
        extra["token_type_ids"] = (ids == token).long()
    with torch.no_grad():
        logits = model(input_ids=ids, **extra).logits[0].float().log_softmax(-1)
    n = len(out.prompt_token_ids)
    return [logits[n - 1 + i, t].item() for i, t in enumerate(out.outputs[0].token_ids)]


def ours(out) -> list[float]:
    return [lp.logprob for lp in out.outputs[0].logprobs]


# ---------------------------------------------------------------------------------------------- torch


@pytest.fixture(scope="module")
def torch_llms(built):
    llms = {f: LLM(model=str(built[f]), backend="torch", dtype="float32", n_ctx=2048, n_seq_max=4)
            for f in tv.VLM_FAMILIES}
    yield llms
    for llm in llms.values():
        llm.close()


@pytest.mark.parametrize("family", tv.VLM_FAMILIES)
def test_torch_matches_transformers(family, built, torch_llms):
    img = image(family)
    out = torch_llms[family].chat(chat(img), GREEDY)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 8
    placeholder = torch_llms[family].engine.backend._vision.image_token_id
    assert out.prompt_token_ids.count(placeholder) == tv.IMAGE_TOKENS[family]
    ref = hf_logprobs(family, built[family], out, img)
    assert max(abs(a - b) for a, b in zip(ref, ours(out))) < 1e-4


def test_torch_qwen2_5_vl_matches_transformers(tmp_path):
    """Qwen2.5-VL (windowed vision attention, M-RoPE), torch only: no llama.cpp pair in the assets."""
    from transformers import AutoModelForImageTextToText

    path = tv.build_tiny_qwen2_5_vl(tmp_path / "qwen2_5_vl")
    llm = LLM(model=str(path), backend="torch", dtype="float32", n_ctx=2048, n_seq_max=2)
    try:
        img = image("qwen2_vl")
        out = llm.chat(chat(img), GREEDY)[0]
        vision = llm.engine.backend._vision
        assert out.error is None and vision.uses_mrope
        assert out.prompt_token_ids.count(vision.image_token_id) == tv.IMAGE_TOKENS["qwen2_vl"]
        model = AutoModelForImageTextToText.from_pretrained(path).eval()
        ids = torch.tensor([out.prompt_token_ids + out.outputs[0].token_ids])
        inputs = vision.processor.image_processor(images=[img.to_pil()], return_tensors="pt")
        with torch.no_grad():
            logits = model(input_ids=ids, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                           mm_token_type_ids=(ids == vision.image_token_id).to(torch.int32)).logits[0].log_softmax(-1)
        n = len(out.prompt_token_ids)
        ref = [logits[n - 1 + i, t].item() for i, t in enumerate(out.outputs[0].token_ids)]
        assert max(abs(a - b) for a, b in zip(ref, ours(out))) < 1e-4
    finally:
        llm.close()


@pytest.mark.parametrize("family", tv.VLM_FAMILIES)
def test_torch_largest_image_encodes_for_the_memory_reserve(family, torch_llms):
    """On CUDA the KV pool leaves free what the largest admitted image's encode takes, measured at load by
    encoding one (TorchVision.encoder_bytes); here the encode itself runs: a blank image that the processor
    scales to the most the model takes gives as many embeddings as the expansion made placeholders."""
    vision = torch_llms[family].engine.backend._vision
    from PIL import Image

    for side in (40, 96):  # fixed-size processors resize both alike; Qwen2-VL's grid grows with the image
        _, span = vision.expand_one(ImageData.from_pil(Image.new("RGB", (side, side))), 0)
        assert vision.encode_largest(side * side) == len(span.payload.rows) > 0
    assert vision.encoder_bytes(96 * 96) == 0  # a CPU's KV pool is not sized from memory


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_torch_batched_images_equal_alone(family, torch_llms):
    llm = torch_llms[family]
    a, b = chat(image(family, 1)), chat(image(family, 2), "Describe it.")
    alone = [llm.chat(m, GREEDY, )[0] for m in (a, b)]
    together = llm.chat([a, b], GREEDY)
    for x, y in zip(alone, together):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert max(abs(p - q) for p, q in zip(ours(x), ours(y))) < 1e-4
    assert alone[0].outputs[0].token_ids != alone[1].outputs[0].token_ids or ours(alone[0]) != ours(alone[1])


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_torch_prefix_cache_keys_on_the_image(family, torch_llms):
    llm = torch_llms[family]
    text = "A long question about this picture, long enough to fill a few blocks of the cache. " * 2
    first = llm.chat(chat(image(family, 3), text), GREEDY)[0]
    again = llm.chat(chat(image(family, 3), text), GREEDY)[0]
    other = llm.chat(chat(image(family, 4), text), GREEDY)[0]
    span_end = first.prompt_token_ids.index(llm.engine.backend._vision.image_token_id) + tv.IMAGE_TOKENS[family]
    assert again.usage.cached_tokens > span_end  # through the image
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert max(abs(p - q) for p, q in zip(ours(first), ours(again))) < 1e-4
    assert other.usage.cached_tokens < span_end - tv.IMAGE_TOKENS[family] + 1  # not through another image


def test_torch_two_images_in_one_message_and_a_second_turn(built, torch_llms):
    llm, family = torch_llms["llava"], "llava"
    one, two = image(family, 5), image(family, 6)
    convo = [{"role": "user", "content": [{"type": "image", "image": one}, {"type": "text", "text": "and"},
                                           {"type": "image", "image": two}]},
             {"role": "assistant", "content": "Two pictures."},
             {"role": "user", "content": [{"type": "text", "text": "Again:"}, {"type": "image", "image": one}]}]
    out = llm.chat(convo, GREEDY)[0]
    placeholder = llm.engine.backend._vision.image_token_id
    assert out.prompt_token_ids.count(placeholder) == 3 * tv.IMAGE_TOKENS[family]
    ref = hf_logprobs_many(family, built[family], out, [one, two, one])
    assert max(abs(a - b) for a, b in zip(ref, ours(out))) < 1e-4


def hf_logprobs_many(family: str, model_dir: Path, out, images: list[ImageData]) -> list[float]:
    model = tv.model_class(family).from_pretrained(model_dir).eval()
    processor = tv.load_processor(model_dir)
    ids = torch.tensor([out.prompt_token_ids + out.outputs[0].token_ids])
    pixels = processor.image_processor(images=[i.to_pil() for i in images], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels).logits[0].float().log_softmax(-1)
    n = len(out.prompt_token_ids)
    return [logits[n - 1 + i, t].item() for i, t in enumerate(out.outputs[0].token_ids)]


# ------------------------------------------------------------------------------------------ llama.cpp


# libmtmd's markers around an image's placeholders, per family
MARKERS = {"gemma3": ("<start_of_image>", "<end_of_image>"), "qwen2_vl": ("<|vision_start|>", "<|vision_end|>")}
GGUF_FAMILIES = tuple(MARKERS)


@pytest.fixture(scope="module")
def ggufs():
    llms = {f: LLM(model=str(ASSETS / f"tiny-{f.replace('_', '-')}-f32.gguf"), backend="llama_cpp", n_ctx=4096,
                   n_seq_max=4, type_k="f32", type_v="f32", speculative="off") for f in GGUF_FAMILIES}
    yield llms
    for llm in llms.values():
        llm.close()


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_llama_cpp_finds_the_projector_beside_the_model(family, ggufs):
    assert ggufs[family].engine.supports_images
    assert ggufs[family].engine.backend._vision.path.name == f"mmproj-tiny-{family.replace('_', '-')}-f32.gguf"
    assert ggufs[family].engine.backend._vision.uses_mrope == (family == "qwen2_vl")


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_llama_cpp_matches_transformers(family, built, ggufs):
    img = image(family)
    out = ggufs[family].chat(chat(img), GREEDY)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 8
    ids = tv.token_ids(family)
    begin, end = MARKERS[family]
    start = out.prompt_token_ids.index(ids[begin])
    # libmtmd's layout: the begin marker, one placeholder per embedding, the end marker
    assert out.prompt_token_ids[start + 1 + tv.IMAGE_TOKENS[family]] == ids[end]
    ref = hf_logprobs(family, built[family], out, img)
    assert max(abs(a - b) for a, b in zip(ref, ours(out))) < 1e-3


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_llama_cpp_batched_images_and_prefix_cache(family, ggufs):
    llm = ggufs[family]
    a, b = chat(image(family, 1)), chat(image(family, 2), "Describe it.")
    alone = [llm.chat(m, GREEDY)[0] for m in (a, b)]
    together = llm.chat([a, b], GREEDY)
    for x, y in zip(alone, together):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
    again = llm.chat(a, GREEDY)[0]
    assert again.outputs[0].token_ids == alone[0].outputs[0].token_ids
    image_end = again.prompt_token_ids.index(tv.token_ids(family)[MARKERS[family][1]])
    assert again.usage.cached_tokens > image_end  # the KV through the image was reused
    other = llm.chat(chat(image(family, 7)), GREEDY)[0]
    assert other.usage.cached_tokens <= image_end - tv.IMAGE_TOKENS[family]  # not through another image


def test_llama_cpp_a_failing_image_fails_only_its_request(ggufs, monkeypatch):
    llm = ggufs["gemma3"]
    good, bad = chat(image("gemma3", 11)), chat(image("gemma3", 12), "Describe it.")
    # the reference from an engine of its own: in the shared one, nothing has seen either image (no cache hit),
    # so the good image is decoded in the failing step and has to be undone there
    fresh = LLM(model=str(ASSETS / "tiny-gemma3-f32.gguf"), backend="llama_cpp", n_ctx=4096, n_seq_max=4,
                type_k="f32", type_v="f32", speculative="off")
    try:
        alone = fresh.chat(good, GREEDY)[0]
    finally:
        fresh.close()
    vision = llm.engine.backend._vision
    real = vision.decode
    bad_hash = image("gemma3", 12).hash

    def decode(lctx, span, **kw):
        if span.image.hash == bad_hash:
            raise RuntimeError("injected encoder failure")
        return real(lctx, span, **kw)

    monkeypatch.setattr(vision, "decode", decode)
    outs = llm.chat([bad, good], GREEDY)
    assert outs[0].outputs[0].finish_reason == "error" and "image" in outs[0].error
    assert outs[1].error is None and outs[1].outputs[0].token_ids == alone.outputs[0].token_ids
    monkeypatch.setattr(vision, "decode", real)
    again = llm.chat(bad, GREEDY)[0]  # the engine and the slots are fine afterwards
    assert again.error is None and len(again.outputs[0].token_ids) == 8


def test_text_model_refuses_images_with_a_clear_error():
    llm = LLM(model=str(ASSETS / "tiny-gemma3-text-q8_0.gguf"), backend="llama_cpp", n_ctx=512, n_seq_max=1)
    try:
        with pytest.raises(ValueError, match="does not accept images"):
            llm.chat(chat(image("gemma3")), GREEDY)
    finally:
        llm.close()

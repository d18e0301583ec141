"""Images in the scheduler, on a fake backend: a chunk never splits an image's span, a span is evaluated
whole in one step (even past the token budget), text decodes keep running beside it, and a model without
images refuses them."""
from __future__ import annotations

import pytest

from cllm.engine.llm_engine import LLMEngine
from cllm.multimodal import ImageData, ImageSpan, MultimodalPrompt
from cllm.request import Request
from cllm.sampling.params import SamplingParams
from tests.unit.fakes import FakeBackend, fake_config, run_all

GREEDY = SamplingParams(max_tokens=3, temperature=0)
PLACEHOLDER = 50


def image(width: int, shade: int = 0) -> ImageData:
    return ImageData(bytes([shade]) * (width * 3), width, 1)


class FakeImageBackend(FakeBackend):
    """An image of width w becomes w placeholder ids; admit() records the spans it was given."""

    supports_images = True

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.spans: dict[str, tuple[ImageSpan, ...]] = {}

    def expand_images(self, prompt: MultimodalPrompt):
        ids: list[int] = []
        spans = []
        done = 0
        for at, img in prompt.images:
            ids += prompt.ids[done:at]
            done = at
            spans.append(ImageSpan(len(ids), img.width, img))
            ids += [PLACEHOLDER] * img.width
        ids += prompt.ids[done:]
        return ids, tuple(spans)

    def admit(self, sequence_id, token_ids, *, reuse_prefix=True, images=()):
        self.spans[sequence_id] = tuple(images)
        return super().admit(sequence_id, token_ids, reuse_prefix=reuse_prefix)


def make(max_batch_tokens: int = 8, **kw) -> tuple[LLMEngine, FakeImageBackend]:
    backend = FakeImageBackend(max_batch_tokens=max_batch_tokens, **kw)
    return LLMEngine(fake_config(n_batch=max_batch_tokens), backend), backend


def chunks_of(backend: FakeBackend, sid: str) -> list[tuple[int, int]]:
    """(first position, tokens) of each step's chunk of ``sid``."""
    out = []
    for _, positions, seqs in backend.batches:
        mine = [p for p, s in zip(positions, seqs) if s == sid]
        if mine:
            out.append((mine[0], len(mine)))
    return out


def test_fit_chunk_stops_before_an_image_and_takes_one_whole():
    img = image(10)
    req = Request("r", [1] * 30, GREEDY, 3, mm_spans=(ImageSpan(5, 10, img), ImageSpan(17, 10, img)))
    assert req.fit_chunk(8) == 5  # text up to the first image
    req.num_computed_tokens = 5
    assert req.fit_chunk(4) == 10  # the whole image, past the budget of 4
    assert req.fit_chunk(14) == 12  # the image and the text after it, up to the next image
    req.num_computed_tokens = 27
    assert req.fit_chunk(8) == 8  # past every image: as asked


def test_engine_never_splits_a_span_and_decodes_beside_it():
    engine, backend = make(max_batch_tokens=8)
    engine.add_request([5, 6, 7], GREEDY, request_id="text")
    engine.step()  # "text" is decoding from now on
    prompt = MultimodalPrompt([1, 2, 3, 4, 5, 6], ((2, image(12)), (4, image(3, shade=9))))
    engine.add_request(prompt, GREEDY, request_id="img")
    outs = run_all(engine)
    spans = backend.spans["img"]
    assert [(s.start, s.length) for s in spans] == [(2, 12), (16, 3)]
    chunks = chunks_of(backend, "img")
    for start, n in chunks:
        end = start + n
        for s in spans:
            assert not (start < s.start < end) or end <= s.start or start == s.start, (chunks, s)
            assert not (s.start < start < s.end), f"a chunk starts inside an image: {chunks}"
            if start == s.start:
                assert end >= s.end, f"an image split over steps: {chunks}"
    assert (2, 12) in [(s, min(n, 12)) for s, n in chunks] and max(n for _, n in chunks) >= 12
    # the decoding sequence ran in the step that carried the image
    image_steps = [i for i, (_, pos, seqs) in enumerate(backend.batches) if ("img", 2) in zip(seqs, pos)]
    assert len(image_steps) == 1 and "text" in backend.batches[image_steps[0]][2]
    assert outs["img"].usage.prompt_tokens == 6 + 12 + 3
    assert outs["img"].outputs[0].finish_reason == "length"


def test_a_text_model_refuses_images():
    engine, _ = make()
    engine.backend.supports_images = False
    engine.supports_images = False
    with pytest.raises(ValueError, match="does not accept images"):
        engine.add_request(MultimodalPrompt([1, 2], ((1, image(2)),)), GREEDY)


def test_too_many_images_and_an_image_at_the_end_are_refused():
    engine, _ = make()
    many = MultimodalPrompt([1, 2], tuple((1, image(1)) for _ in range(engine.config.images.max_images_per_request + 1)))
    with pytest.raises(ValueError, match="max_images_per_request"):
        engine.add_request(many, GREEDY)
    with pytest.raises(ValueError, match="must not end with an image"):
        engine.add_request(MultimodalPrompt([1, 2], ((2, image(2)),)), GREEDY)


def test_a_request_with_images_is_not_handed_off():
    from cllm.engine import migration

    engine, _ = make()
    rid = engine.add_request(MultimodalPrompt([1, 2, 3], ((1, image(4)),)), GREEDY)
    engine.step()
    with pytest.raises(ValueError, match="holds images"):
        migration.export_request(engine, rid)
    assert run_all(engine)[rid].outputs[0].finish_reason == "length"  # it runs on where it is

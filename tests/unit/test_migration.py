"""Exporting a live request from one engine and continuing it in another, on the fake counting backend."""
from __future__ import annotations

import pytest

from cllm.engine.llm_engine import LLMEngine
from cllm.errors import QueueFullError
from cllm.handoff.local import hand_off
from cllm.sampling.params import SamplingParams
from tests.unit.fakes import FakeBackend, fake_config, run_all

GREEDY = SamplingParams(max_tokens=6, temperature=0)


def engine_pair(**overrides) -> tuple[LLMEngine, FakeBackend, LLMEngine, FakeBackend]:
    a, b = FakeBackend(), FakeBackend()
    overrides.setdefault("n_batch", 64)
    return LLMEngine(fake_config(**overrides), a), a, LLMEngine(fake_config(**overrides), b), b


def test_running_request_continues_where_it_stopped():
    src, a, dst, b = engine_pair()
    src.add_request([1, 2, 3], GREEDY, request_id="r")
    src.step()  # prefill + first token
    src.step()  # second token
    report = hand_off(src, dst, "r", chunk_bytes=2)
    assert not src.has_unfinished() and "r" in a.released and "r" not in a.held
    assert report.kv_tokens == 4 and report.kv_bytes == 4 and report.num_chunks == 2
    out = run_all(dst)["r"]
    assert out.outputs[0].token_ids == [4, 5, 6, 7, 8, 9]  # the same as without a hand-off
    # The receiver evaluated only the one sampled token the sender had not: KV came with the request.
    assert b.batches[0] == ([5], [4], ["r"])
    assert out.outputs[0].finish_reason == "length" and out.usage.prompt_tokens == 3


def test_text_and_deltas_continue_without_repeats():
    src, _, dst, _ = engine_pair()
    src.add_request([7, 8], SamplingParams(max_tokens=4, temperature=0), request_id="r")
    sent = "".join(o.outputs[0].text_delta for _ in range(2) for o in src.step())
    hand_off(src, dst, "r", chunk_bytes=64)
    rest = []
    while dst.has_unfinished():
        rest += [o.outputs[0] for o in dst.step()]
    assert sent + "".join(c.text_delta for c in rest) == rest[-1].text == "jklm"
    assert rest[0].token_ids_delta == [11]  # only new tokens are reported after the hand-off


def test_waiting_request_moves_without_kv_and_is_recomputed():
    src, _, dst, b = engine_pair()
    src.add_request([1, 2, 3], GREEDY, request_id="r")
    report = hand_off(src, dst, "r", chunk_bytes=8)
    assert report.kv_tokens == 0 and report.kv_bytes == 0 and report.num_chunks == 1
    assert run_all(dst)["r"].outputs[0].token_ids == [4, 5, 6, 7, 8, 9]
    assert b.batches[0] == ([1, 2, 3], [0, 1, 2], ["r"] * 3)


def test_swapped_out_request_moves_its_saved_kv():
    src, a, dst, b = engine_pair(preemption_mode="swap")
    src.add_request([1, 2, 3], GREEDY, request_id="r")
    src.step()
    src.scheduler._preempt(src.scheduler.requests["r"])
    hand_off(src, dst, "r", chunk_bytes=3)
    assert run_all(dst)["r"].outputs[0].token_ids == [4, 5, 6, 7, 8, 9]
    assert b.batches[0] == ([4], [3], ["r"])


def test_refusals_leave_the_request_where_it_was():
    dst = LLMEngine(fake_config(n_batch=64, max_waiting=0), FakeBackend())
    src = LLMEngine(fake_config(n_batch=64), FakeBackend())
    src.add_request([1, 2, 3], GREEDY, request_id="r")
    src.step()
    with pytest.raises(QueueFullError):
        hand_off(src, dst, "r", chunk_bytes=8)
    assert src.request_ids() == ["r"] and run_all(src)["r"].outputs[0].token_ids == [4, 5, 6, 7, 8, 9]
    src.add_request([1], SamplingParams(max_tokens=2, n=2), request_id="g")
    with pytest.raises(ValueError, match="n=2"):
        src.export_request("g")
    with pytest.raises(KeyError):
        src.export_request("nope")


def test_other_backend_or_model_is_refused():
    src, _, dst, _ = engine_pair()
    src.add_request([1, 2, 3], GREEDY, request_id="r")
    src.step()
    snap, segments = src.export_request("r")
    snap.model = "other.gguf:1"
    with pytest.raises(ValueError, match="other.gguf"):
        dst.import_request(snap, segments)


async def test_async_export_hands_out_every_token_once_and_resume_continues():
    """AsyncLLM: the exporting stream yields the tokens made before the export, then ends with
    RequestHandedOffError; the other engine's stream carries on from the next token."""
    from cllm.engine.async_llm import AsyncLLM
    from cllm.errors import RequestHandedOffError

    # 2 ms a step on the source: its 3,000 tokens take >= 6 s, so the export (sent right after the first
    # output) always finds the request live; unslowed, a loaded CI machine once let all 3,000 finish first.
    src = AsyncLLM(backend=FakeBackend(forward_sleep_s=0.002), n_batch=64)
    dst = AsyncLLM(backend=FakeBackend(), n_batch=64)
    params = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)
    gen = src.generate([1, 2, 3], params, request_id="r")
    seen = list((await gen.__anext__()).outputs[0].token_ids_delta)
    snapshot, segments = await src.export_request("r")
    with pytest.raises(RequestHandedOffError):
        async for out in gen:
            seen += out.outputs[0].token_ids_delta
    assert seen == snapshot.output_token_ids  # everything made here was handed out here
    async for out in dst.resume(snapshot, segments):
        seen += out.outputs[0].token_ids_delta
    expected, last = [], 3
    for _ in range(3000):
        last = (last + 1) % 64
        expected.append(last)
    assert seen == expected
    assert out.finished and out.outputs[0].token_ids == expected
    await src.shutdown()
    await dst.shutdown()

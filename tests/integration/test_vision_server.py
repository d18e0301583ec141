"""Images through `cllm serve`, driven by the official clients: the tiny Gemma 3 GGUF and its projector
(tests/assets/models/, found beside the model) on the llama.cpp backend. OpenAI Chat (`image_url` data URL),
the Responses API (`input_image`) and Anthropic Messages (`image` base64 block) all answer, with the image
counted in the prompt's tokens and in /tokenize; the same picture sent through any protocol is the same
prompt (greedy replies equal); bad images are 400s naming the part; the engine lives on."""
from __future__ import annotations

import base64
import io
from pathlib import Path

import anthropic
import numpy as np
import openai
import pytest
from PIL import Image

from cllm import tiny_vlms as tv
from cllm.stress.server_process import ServerProcess, finish_server, start_server

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "models"
MODEL = "tiny-gemma3-f32"
QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def server():
    srv = start_server("--model", str(ASSETS / f"{MODEL}.gguf"), "--n-seq-max", "4", "--n-ctx", "4096",
                       "--speculative", "off", "--set", "type_k=f32", "--set", "type_v=f32")
    yield srv
    finish_server(srv)


def png_b64(seed: int = 0) -> str:
    buffer = io.BytesIO()
    tv.sample_image("gemma3", seed=seed).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def chat_parts(seed: int = 0) -> list[dict]:
    return [{"type": "text", "text": QUESTION},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png_b64(seed)}"}}]


def test_openai_chat_with_an_image(server: ServerProcess):
    client = server.openai()
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": chat_parts()}],
                                           max_tokens=6, temperature=0)
    text_only = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                               max_tokens=6, temperature=0)
    assert reply.choices[0].finish_reason == "length"
    # <start_of_image> + 16 placeholders + <end_of_image> more than the same text alone
    assert reply.usage.prompt_tokens == text_only.usage.prompt_tokens + tv.IMAGE_TOKENS["gemma3"] + 2
    again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": chat_parts()}],
                                           max_tokens=6, temperature=0)
    assert again.choices[0].message.content == reply.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > tv.IMAGE_TOKENS["gemma3"]


def test_every_protocol_sends_the_same_prompt(server: ServerProcess):
    client = server.openai()
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": chat_parts(5)}],
                                          max_tokens=6, temperature=0)
    responses = client.responses.create(model=MODEL, max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION},
                                     {"type": "input_image", "image_url": f"data:image/png;base64,{png_b64(5)}"}]}])
    ant = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60.0)
    message = ant.messages.create(model=MODEL, max_tokens=6, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [{"type": "text", "text": QUESTION},
                                     {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": png_b64(5)}}]}])
    assert responses.output_text == chat.choices[0].message.content
    assert message.content[0].text == chat.choices[0].message.content
    counted = ant.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": [{"type": "text", "text": QUESTION},
                                     {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": png_b64(5)}}]}])
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_tokenize_expands_the_image(server: ServerProcess):
    with server.http() as http:
        body = http.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": chat_parts()}]})
    assert body.status_code == 200
    tokens = body.json()["tokens"]
    ids = tv.token_ids("gemma3")
    start = tokens.index(ids["<start_of_image>"])
    assert tokens[start + 1 + tv.IMAGE_TOKENS["gemma3"]] == ids["<end_of_image>"]


@pytest.mark.parametrize("url, says", [
    ("data:image/png;base64,aGVsbG8=", "messages"),  # not an image
    ("data:image/png;base64,!!!", "messages"),  # not base64
    ("http://127.0.0.1/x.png", "allow_image_urls"),  # URLs are off by default
])
def test_bad_images_are_400s_naming_the_part(server: ServerProcess, url: str, says: str):
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]}])
    assert says in str(caught.value)
    # the engine lives on
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def test_too_many_images_is_a_400(server: ServerProcess):
    client = server.openai()
    parts = [{"type": "text", "text": "hi"}] + chat_parts()[1:] * 9  # max_images_per_request: 8
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": parts}])
    assert "max_images_per_request" in str(caught.value)


def test_an_inline_photo_past_a_text_servers_body_limit_is_served(server: ServerProcess):
    pixels = np.random.default_rng(0).integers(0, 256, size=(720, 720, 3), dtype=np.uint8)  # noise: PNG cannot shrink it
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    photo = base64.b64encode(buffer.getvalue()).decode()
    assert len(photo) > 1 << 20  # a text-only server's auto limit (1 MiB) would answer 413
    with server.http() as http:
        reply = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"},
                                         {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{photo}"}}]}]})
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] > 1


def test_a_flood_of_images_past_the_memory_budget_gets_429_then_passes():
    srv = start_server("--model", str(ASSETS / f"{MODEL}.gguf"), "--n-seq-max", "2", "--n-ctx", "1024",
                       "--speculative", "off", "--set", "image_memory_mib=1")  # max_body_bytes: auto (32 MiB)
    try:
        buffer = io.BytesIO()
        tv.sample_image("gemma3").resize((640, 640)).save(buffer, format="PNG")  # 1.2 MB decoded
        big = base64.b64encode(buffer.getvalue()).decode()
        with srv.http() as http:
            reply = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi"},
                                             {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{big}"}}]}]})
            assert reply.status_code == 429 and reply.headers["retry-after"] == "1"
            assert reply.json()["error"]["code"] == "images_busy"
            buffer = io.BytesIO()
            tv.sample_image("gemma3").resize((448, 448)).save(buffer, format="PNG")  # 602 kB decoded
            half = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {
                "url": f"data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}"}}]
            for _ in range(3):  # each fits alone, two would not: every request gave its images back
                ok = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                             "messages": [{"role": "user", "content": half}]})
                assert ok.status_code == 200
    finally:
        finish_server(srv)


def test_engine_report_and_ready_block_say_images(server: ServerProcess):
    with server.http() as http:
        report = http.get("/v1/engine").json()
    # max_body_bytes: auto is 32 MiB while a model takes images (1 MiB on a text-only server: test_server.py)
    assert report["images"] == {"accepted": True, "encoder": "libmtmd, projector mmproj-tiny-gemma3-f32.gguf",
                                "max_body_bytes": 32 << 20}
    assert ("images    : libmtmd, projector mmproj-tiny-gemma3-f32.gguf (at most 8 a request, request bodies up to"
            " 32 MiB)") in server.log_text()

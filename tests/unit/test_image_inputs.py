"""Image inputs from every protocol up to the normalized messages (cllm.multimodal.content): each shape
normalizes to the contract (a str without images; text and ImageData parts in order with them), every
bad image is a ValueError / 400 naming its part, the URL policy (off by default, public addresses only,
bytes and time bounded, redirects re-checked), and a text-only model refusing images."""
from __future__ import annotations

import asyncio
import base64
import io
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

import cllm
from cllm.chat_template import normalize_messages
from cllm.config import ImageConfig, load_config
from cllm.multimodal import ImageData, count_images, message_images
from cllm.multimodal.decode import decode_image
from cllm.multimodal.fetch import fetch_image, fetch_image_async, is_public
from cllm.server.app import create_app
from tests.unit.fakes import FakeBackend

RED, BLUE, WHITE = (255, 0, 0), (0, 0, 255), (255, 255, 255)
ALLOW = ImageConfig(allow_image_urls=True, allow_private_image_urls=True)


def encoded(fmt: str = "PNG", size: tuple[int, int] = (4, 3), color: tuple = RED, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def first_pixel(image: ImageData) -> tuple[int, int, int]:
    return tuple(image.rgb[:3])


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def huge_header_png(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` (a decompression bomb's header, with no pixels)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", zlib.compress(b"\0" * 64)) \
        + _png_chunk(b"IEND", b"")


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def image_url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


# ---- Python / OpenAI chat shapes -> the contract ------------------------------------------------------


def test_text_only_content_stays_a_string():
    assert normalize_messages(user({"type": "text", "text": "a"}, {"type": "text", "text": "b"})) == \
        [{"role": "user", "content": "ab"}]
    assert normalize_messages([{"role": "user", "content": "hi"}], images=ImageConfig()) == [{"role": "user", "content": "hi"}]


def test_every_python_image_shape_normalizes_in_order(tmp_path: Path):
    png = encoded(color=RED)
    path = tmp_path / "blue.webp"
    path.write_bytes(encoded("WEBP", color=BLUE))
    decoded = ImageData(bytes(WHITE) * 4, 2, 2)
    messages = user(
        {"type": "text", "text": "one"}, image_url(data_url(png)),
        {"type": "image_url", "image_url": data_url(encoded("JPEG"))},  # the short form
        {"type": "text", "text": "two"}, {"type": "text", "text": "+"},
        {"type": "image", "image": Image.new("RGB", (3, 3), BLUE)},
        {"type": "image", "image": str(path)}, {"type": "image", "image": path}, {"type": "image", "image": png},
        {"type": "image", "image": decoded}, {"type": "image", "image": data_url(png)},
    )
    out = normalize_messages(messages, images=ImageConfig())
    content = out[0]["content"]
    assert [p["type"] for p in content] == ["text", "image", "image", "text"] + ["image"] * 6
    assert content[0] == {"type": "text", "text": "one"} and content[3] == {"type": "text", "text": "two+"}
    images = message_images(out)
    assert count_images(out) == 8 and all(isinstance(i, ImageData) for i in images)
    assert first_pixel(images[0]) == RED and (images[0].width, images[0].height) == (4, 3)
    assert first_pixel(images[2]) == BLUE and images[3].hash == images[4].hash  # str path and Path: one image
    assert images[5].hash == images[0].hash and images[6] is decoded
    assert normalize_messages(out) == out  # normalized messages pass through unchanged


def test_tool_results_may_hold_images_system_and_assistant_may_not():
    png = data_url(encoded())
    out = normalize_messages([{"role": "tool", "tool_call_id": "c", "content": [image_url(png)]}])
    assert count_images(out) == 1
    for role in ("system", "assistant", "developer"):
        with pytest.raises(ValueError, match=rf"messages\[1\]\.content\[1\]: images are accepted .* not in {role}"):
            normalize_messages([{"role": "user", "content": "x"},
                                {"role": role, "content": [{"type": "text", "text": "a"}, image_url(png)]}])


def test_gif_gives_its_first_frame_and_alpha_goes_over_white():
    frames = [Image.new("RGB", (5, 5), RED), Image.new("RGB", (5, 5), BLUE)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=10, loop=0)
    gif = decode_image(buf.getvalue(), "x", ImageConfig())
    assert (gif.width, gif.height, first_pixel(gif)) == (5, 5, RED)
    clear = decode_image(encoded(mode="RGBA", color=(0, 0, 0, 0)), "x", ImageConfig())
    assert first_pixel(clear) == WHITE


def test_equal_pixels_give_equal_hashes_whatever_the_file():
    a = decode_image(encoded("PNG", color=BLUE), "x", ImageConfig())
    b = decode_image(encoded("WEBP", color=BLUE), "x", ImageConfig())  # WebP's default is lossy: not the same
    c = decode_image(encoded("GIF", color=BLUE), "x", ImageConfig())
    assert a.hash == c.hash and (a.width, a.height) == (b.width, b.height)


# ---- bad images: a ValueError naming the part ------------------------------------------------------------


def _bmp() -> bytes:
    return encoded("BMP")


BAD = [
    ("empty", {"type": "image", "image": b""}, "image is empty"),
    ("garbage", {"type": "image", "image": b"not an image at all"}, "is not a PNG, JPEG, WebP or GIF"),
    ("bmp", image_url(data_url(_bmp(), "image/bmp")), "is not a PNG, JPEG, WebP or GIF"),
    ("tiff", {"type": "image", "image": encoded("TIFF")}, "is not a PNG, JPEG, WebP or GIF"),
    ("truncated png", {"type": "image", "image": encoded(size=(64, 64))[:-30]}, "corrupt or truncated"),
    ("truncated jpeg", {"type": "image", "image": encoded("JPEG", size=(64, 64))[:200]}, "corrupt or truncated"),
    ("bomb header", {"type": "image", "image": huge_header_png(100_000, 100_000)}, "max_image_pixels"),
    ("large header", {"type": "image", "image": huge_header_png(9000, 9000)}, "9000x9000 = 81000000 pixels, more than max_image_pixels"),
    ("not base64", image_url("data:image/png;base64,%%%%"), "not hold valid base64"),
    ("not base64 at all", image_url("data:image/png,rawbytes"), "must be base64"),
    ("not a url", image_url("x"), "must be a data: URL"),
    ("file scheme", image_url("file:///etc/passwd"), "must be a data: URL"),
    ("url off", image_url("https://example.com/cat.png"), "allow_image_urls"),
    ("missing url", {"type": "image_url", "image_url": {"detail": "auto"}}, r"content\[1\]\.image_url: must be"),
    ("unknown type", {"type": "input_audio", "input_audio": {}}, r"content\[1\]\.type: content part of type 'input_audio'"),
    ("text not str", {"type": "text", "text": 5}, r"content\[1\]\.text: must be a string"),
    ("missing file", {"type": "image", "image": "/nonexistent/cat.png"}, "could not be read"),
    ("odd object", {"type": "image", "image": 3.5}, r"content\[1\]\.image: must be a PIL image"),
    ("not an object", "just a string", r"content\[1\]: must be an object"),
]


@pytest.mark.parametrize(("part", "needle"), [(p, n) for _, p, n in BAD], ids=[b[0] for b in BAD])
def test_a_bad_image_part_is_a_value_error_naming_it(part, needle):
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[1\]") as err:
        normalize_messages(user({"type": "text", "text": "see"}, part), images=ImageConfig())
    assert err.type is ValueError or issubclass(err.type, ValueError)
    assert err.match(needle)


def test_limits_name_the_setting():
    small = ImageConfig(max_image_bytes=1024, max_image_pixels=100, max_images_per_request=2)
    big = encoded(size=(200, 200), color=None, mode="RGB")
    noisy = bytes(range(256)) * 8
    with pytest.raises(ValueError, match=r"content\[0\]: image is \d+ bytes, more than max_image_bytes=1024"):
        normalize_messages(user({"type": "image", "image": noisy}), images=small)
    with pytest.raises(ValueError, match=r"more than max_image_bytes=1024"):  # refused before base64 decoding
        normalize_messages(user(image_url(data_url(noisy))), images=small)
    with pytest.raises(ValueError, match=r"200x200 = 40000 pixels, more than max_image_pixels=100"):
        normalize_messages(user({"type": "image", "image": big}), images=small)
    with pytest.raises(ValueError, match=r"more than max_image_pixels=100"):
        normalize_messages(user({"type": "image", "image": Image.new("RGB", (20, 20))}), images=small)
    tiny = {"type": "image", "image": encoded(size=(2, 2))}
    with pytest.raises(ValueError, match="holds 3 images, more than max_images_per_request=2"):
        normalize_messages(user(tiny, tiny) + user(tiny), images=small)
    assert count_images(normalize_messages(user(tiny, tiny), images=small)) == 2


def _mutations() -> st.SearchStrategy[bytes]:
    seeds = [encoded(fmt, size=(9, 7)) for fmt in ("PNG", "JPEG", "WEBP", "GIF")] + [huge_header_png(9, 7)]

    def mutate(seed: bytes, cut: int, flips: list[tuple[int, int]]) -> bytes:
        data = bytearray(seed[: max(1, cut % (len(seed) + 1))])
        for at, value in flips:
            if data:
                data[at % len(data)] = value
        return bytes(data)

    return st.builds(mutate, st.sampled_from(seeds), st.integers(0, 10_000),
                     st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=8))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=512), _mutations()))
def test_decoder_fuzz_only_ever_value_error(data: bytes):
    try:
        image = decode_image(data, "fuzz", ImageConfig(max_image_pixels=1 << 20))
    except ValueError as exc:
        assert str(exc).startswith("fuzz: ")
    else:
        assert len(image.rgb) == image.width * image.height * 3


def test_huge_headers_are_refused_before_decoding():
    gif = b"GIF89a" + struct.pack("<HH", 65535, 65535) + b"\x00\x00\x00" + b"\x2c" + b"\0" * 8 + b"\x02\x02L\x01\x00;"
    started = time.perf_counter()
    for data in (huge_header_png(1 << 20, 1 << 20), huge_header_png(40_000, 40_000), gif):
        with pytest.raises(ValueError, match="max_image_pixels"):
            decode_image(data, "x", ImageConfig())
    assert time.perf_counter() - started < 1.0


# ---- URL policy ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("address", "public"), [
    ("8.8.8.8", True), ("2606:4700:4700::1111", True), ("127.0.0.1", False), ("10.1.2.3", False),
    ("192.168.0.1", False), ("172.16.0.1", False), ("169.254.169.254", False), ("100.64.0.1", False),
    ("0.0.0.0", False), ("224.0.0.1", False), ("::1", False), ("fe80::1%eth0", False), ("fc00::1", False),
    ("::ffff:127.0.0.1", False), ("2002:7f00:1::", False), ("64:ff9b::a00:1", False), ("64:ff9b::808:808", True),
])
def test_is_public(address: str, public: bool):
    assert is_public(address) is public


class _Handler(BaseHTTPRequestHandler):
    PNG = encoded(color=BLUE)

    def do_GET(self) -> None:  # noqa: N802 -- http.server's name
        routes = {"/img.png": self._image, "/big": self._big, "/big-unsized": self._big_unsized,
                  "/slow": self._slow, "/drip": self._drip, "/redirect": self._redirect}
        routes.get(self.path, self._missing)()

    def _image(self) -> None:
        self._send(200, self.PNG)

    def _big(self) -> None:
        self._send(200, b"\0" * 4096)

    def _big_unsized(self) -> None:
        self.send_response(200)
        self.end_headers()  # no Content-Length: the body runs until the connection closes
        self.wfile.write(b"\0" * 4096)

    def _slow(self) -> None:
        time.sleep(1.5)
        self._send(200, self.PNG)

    def _drip(self) -> None:
        self.send_response(200)
        self.end_headers()
        for _ in range(12):
            self.wfile.write(b"\0" * 8)
            self.wfile.flush()
            time.sleep(0.1)

    def _redirect(self) -> None:
        self.send_response(302)
        self.send_header("Location", "/img.png")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _missing(self) -> None:
        self._send(404, b"no")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass  # a client that stops reading (size limit, timeout) breaks the handler's pipe: expected here


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = _QuietServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _fetch_both(url: str, settings_: ImageConfig) -> list[bytes | str]:
    """fetch_image and fetch_image_async of one URL: the body, or the error's text."""
    out: list[bytes | str] = []
    for fetch in (lambda: fetch_image(url, "p", settings_),
                  lambda: asyncio.run(fetch_image_async(url, "p", settings_))):
        try:
            out.append(fetch())
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_fetch_from_a_local_server_when_private_addresses_are_allowed(image_server: str):
    assert _fetch_both(f"{image_server}/img.png", ALLOW) == [_Handler.PNG] * 2
    assert _fetch_both(f"{image_server}/redirect", ALLOW) == [_Handler.PNG] * 2
    out = normalize_messages(user(image_url(f"{image_server}/img.png")), images=ALLOW)
    assert first_pixel(message_images(out)[0]) == BLUE
    assert all("HTTP 404" in e for e in _fetch_both(f"{image_server}/nope", ALLOW))


def test_urls_are_off_by_default_and_private_addresses_refused(image_server: str):
    port = image_server.rsplit(":", 1)[1]
    assert all("allow_image_urls" in e for e in _fetch_both(f"{image_server}/img.png", ImageConfig()))
    public_only = ImageConfig(allow_image_urls=True)
    for url in (f"{image_server}/img.png", f"http://localhost:{port}/img.png", "http://[::1]/x.png",
                "http://169.254.169.254/latest/meta-data", "http://10.0.0.1/x.png"):
        for error in _fetch_both(url, public_only):
            assert isinstance(error, str) and "private, loopback, link-local or reserved" in error, (url, error)
            assert "allow_private_image_urls" in error


def test_size_limit_and_timeout(image_server: str):
    small = ImageConfig(allow_image_urls=True, allow_private_image_urls=True, max_image_bytes=1024)
    for path in ("/big", "/big-unsized"):
        assert all("more than max_image_bytes=1024" in e for e in _fetch_both(f"{image_server}{path}", small)), path
    quick = ImageConfig(allow_image_urls=True, allow_private_image_urls=True, image_url_timeout_s=0.5)
    for path in ("/slow", "/drip"):
        started = time.monotonic()
        errors = _fetch_both(f"{image_server}{path}", quick)
        assert all("took longer than image_url_timeout_s=0.5" in e for e in errors), (path, errors)
        assert time.monotonic() - started < 3.5


def _public_resolver(names: dict[str, str]):
    return lambda host, port: [names[host]] if host in names else socket.gethostbyname_ex(host)[2]


def test_connection_goes_to_the_checked_address_and_redirects_are_checked_again():
    seen: list[tuple[str, str, str | None]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.headers["host"], request.extensions.get("sni_hostname")))
        if request.headers["host"] == "cdn.example":
            return httpx.Response(302, headers={"Location": "https://img.example/cat.png"})
        if request.headers["host"] == "img.example":
            return httpx.Response(200, content=_Handler.PNG)
        return httpx.Response(302, headers={"Location": "http://127.0.0.1/admin"})

    resolve = _public_resolver({"cdn.example": "93.184.216.34", "img.example": "2606:2800:220:1::1",
                                "evil.example": "93.184.216.35"})
    policy = ImageConfig(allow_image_urls=True)
    assert fetch_image("https://cdn.example/cat.png", "p", policy, transport=httpx.MockTransport(handler),
                       resolve=resolve) == _Handler.PNG
    assert seen == [("93.184.216.34", "cdn.example", "cdn.example"), ("2606:2800:220:1::1", "img.example", "img.example")]
    with pytest.raises(ValueError, match=r"^p: image URL host '127.0.0.1' resolves to 127.0.0.1"):
        fetch_image("http://evil.example/x", "p", policy, transport=httpx.MockTransport(handler), resolve=resolve)

    async def fetch_async() -> bytes:
        return await fetch_image_async("https://cdn.example/cat.png", "p", policy,
                                       transport=httpx.MockTransport(handler), resolve=resolve)
    assert asyncio.run(fetch_async()) == _Handler.PNG
    with pytest.raises(ValueError, match="resolves to 10.9.9.9"):
        fetch_image("http://intra.example/", "p", policy, resolve=_public_resolver({"intra.example": "10.9.9.9"}))


# ---- the server: each protocol's shapes, its errors, and a text-only model ------------------------------


def _take_images(engine) -> None:
    """Make a fake engine say it takes images (the wrapped LLMEngine's flag, and AsyncLLM's own unless it reads that)."""
    engine.engine.supports_images = True
    if not isinstance(getattr(type(engine), "supports_images", None), property):
        engine.supports_images = True


@pytest.fixture()
def served() -> Iterator[tuple[TestClient, cllm.AsyncLLM, list]]:
    """A server whose engine takes images and records the messages it renders."""
    config = load_config(None, environ={}, n_seq_max=2, n_batch=64, log_level="warning", accept_any_model=True)
    engine = cllm.AsyncLLM(config=config, backend=FakeBackend(slots=2, max_batch_tokens=64))
    rendered: list = []

    def tokenize_chat(messages, add_generation_prompt=True, tools=None, *, continue_final_message=False):
        rendered.append(normalize_messages(messages))
        return [1, 2, 3]

    _take_images(engine)
    engine.tokenize_chat = tokenize_chat
    with TestClient(create_app(config, engine=engine), base_url="http://localhost") as client:
        yield client, engine, rendered


PNG_URL = data_url(encoded(color=RED))


def _contract(messages: list[dict]) -> list:
    return [(m["role"], m["content"] if isinstance(m["content"], str) else
             [p["text"] if p["type"] == "text" else first_pixel(p["image"]) for p in m["content"]]) for m in messages]


def test_chat_completions_images(served):
    client, _, rendered = served
    body = {"max_tokens": 2, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "what is "}, image_url(PNG_URL),
                                     {"type": "image_url", "image_url": PNG_URL}, {"type": "text", "text": "?"}]}]}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert _contract(rendered[-1]) == [("system", "be brief"), ("user", ["what is ", RED, RED, "?"])]


def test_responses_images(served):
    client, _, rendered = served
    body = {"max_output_tokens": 2, "instructions": "sys", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "see"},
                                     {"type": "input_image", "image_url": PNG_URL, "detail": "low"}]},
        {"type": "function_call", "call_id": "c1", "name": "snap", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_image", "image_url": PNG_URL}]}]}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert _contract(rendered[-1]) == [("system", "sys"), ("user", ["see", RED]), ("assistant", ""), ("tool", [RED])]
    # the stored conversation holds the image as sent (JSON), loaded again by the next turn
    again = client.post("/v1/responses", json={"input": "and now?", "previous_response_id": r.json()["id"],
                                               "max_output_tokens": 2})
    assert again.status_code == 200, again.text
    assert count_images(rendered[-1]) == 2


def test_messages_images(served):
    client, _, rendered = served
    b64 = PNG_URL.split(",", 1)[1]
    body = {"model": "m", "max_tokens": 2, "system": "sys", "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
                                     {"type": "text", "text": "this"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "snap", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True, "content": [
            {"type": "text", "text": "blurry"}, {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                               "data": b64}}]}]}]}
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    assert _contract(rendered[-1]) == [("system", "sys"), ("user", [RED, "this"]), ("assistant", ""),
                                       ("tool", ["Error: blurry", RED])]
    counted = client.post("/v1/messages/count_tokens", json={k: v for k, v in body.items() if k != "max_tokens"})
    assert counted.status_code == 200 and counted.json() == {"input_tokens": 3}


SERVER_BAD = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                        image_url("data:image/png;base64,AAAA")]}]},
     "messages.0.content.1", "image is not a PNG"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image", "image": "/etc/passwd"}]}]},
     "messages.0.content.0.type", "not supported here"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": [image_url(PNG_URL)]}]},
     "messages.0.content.0", "not in assistant messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [image_url(PNG_URL)] * 9}]},
     "messages", "max_images_per_request=8"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [image_url("http://169.254.169.254/x")]}]},
     "messages.0.content.0", "allow_image_urls"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]", "must be a data: URL"),
    ("/v1/responses", {"instructions": "s", "input": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [
        {"type": "input_image", "image_url": PNG_URL}]}]}, "input[1].content[0]", "not in assistant messages"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input[0].content[0].file_id", "file inputs are not supported"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image",
                                                              "image_url": data_url(huge_header_png(9000, 9000))}]}]},
     "input[0].content[0]", "max_image_pixels"),
]


@pytest.mark.parametrize(("route", "body", "param", "needle"), SERVER_BAD, ids=[f"{r}:{n}" for r, _, _, n in SERVER_BAD])
def test_server_bad_image_is_a_400_naming_the_part(served, route, body, param, needle):
    client, _, rendered = served
    before = len(rendered)
    r = client.post(route, json={"max_tokens": 2, **body} if route.endswith("completions") else body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error
    assert error["message"].startswith(param) or param == "messages", error
    assert len(rendered) == before  # refused before the template


MESSAGES_BAD = [
    ([{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}],
     "messages.0.content.0: image is not a PNG"),
    ([{"type": "image", "source": {"type": "base64", "media_type": "image/svg+xml", "data": "AAAA"}}],
     "messages.0.content.0.source.media_type"),
    ([{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}], "messages.0.content.0: image URLs are not"),
    ([{"type": "image", "source": {"type": "file", "file_id": "f"}}], "messages.0.content.0.source.type"),
    ([{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}],
     "messages.0.content.0.content.0.source.type"),
]


@pytest.mark.parametrize(("content", "needle"), MESSAGES_BAD, ids=[n for _, n in MESSAGES_BAD])
def test_messages_bad_image_is_an_anthropic_400(served, content, needle):
    client, _, _ = served
    r = client.post("/v1/messages", json={"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert needle in body["error"]["message"], body
    assistant = client.post("/v1/messages", json={"model": "m", "max_tokens": 2, "messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]})
    assert assistant.status_code == 400 and "messages.1.content.0.type" in assistant.json()["error"]["message"]


def test_a_text_only_model_refuses_images_on_every_route():
    config = load_config(None, environ={}, n_seq_max=2, n_batch=64, log_level="warning", accept_any_model=True)
    engine = cllm.AsyncLLM(config=config, backend=FakeBackend(slots=2, max_batch_tokens=64))
    routes = [
        ("/v1/chat/completions", {"max_tokens": 2, "messages": user(image_url(PNG_URL))}),
        ("/v1/chat/completions/input_tokens", {"messages": user(image_url(PNG_URL))}),
        ("/tokenize", {"messages": user(image_url(PNG_URL))}),
        ("/v1/responses", {"max_output_tokens": 2, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": PNG_URL}]}]}),
        ("/v1/messages", {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_URL.split(",")[1]}}]}]}),
        ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_URL.split(",")[1]}}]}]}),
    ]
    with TestClient(create_app(config, engine=engine), base_url="http://localhost") as client:
        for route, body in routes:
            r = client.post(route, json=body)
            assert r.status_code == 400, (route, r.text)
            assert "does not accept images" in r.text, (route, r.text)
        text = client.post("/v1/chat/completions", json={"max_tokens": 2, "messages": user({"type": "text", "text": "hi"})})
        assert text.status_code == 200, text.text


# ---- the Python API ---------------------------------------------------------------------------------------


def test_llm_chat_images_and_a_text_only_model():
    llm = cllm.LLM(backend=FakeBackend(slots=2, max_batch_tokens=64), n_seq_max=2, n_batch=64)
    messages = user({"type": "text", "text": "hi"}, {"type": "image", "image": Image.new("RGB", (2, 2), RED)})
    with pytest.raises(ValueError, match="does not accept images"):
        llm.chat(messages)
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\]: image is not a PNG"):
        llm.chat(user({"type": "text", "text": "hi"}, {"type": "image", "image": b"junk"}))
    rendered: list = []

    def tokenize_chat(convo, add_generation_prompt=True, tools=None, **_):
        rendered.append(convo)
        return [1, 2, 3]

    llm.engine.supports_images = True
    llm.engine.tokenize_chat = tokenize_chat
    out = llm.chat(messages, cllm.SamplingParams(max_tokens=2))
    assert out[0].outputs and _contract(rendered[-1]) == [("user", ["hi", RED])]
    with pytest.raises(ValueError, match="max_images_per_request"):
        cllm.LLM(backend=FakeBackend(slots=2, max_batch_tokens=64), n_seq_max=2, n_batch=64,
                 max_images_per_request=0).chat(messages)


def test_every_hostile_image_case_is_a_400():
    """The stress battery's image cases (cllm/stress/hostile*.py), against a text-only model: all 400s."""
    from cllm.stress.hostile import hostile_cases
    from cllm.stress.hostile_protocols import protocol_hostile_cases

    cases = [c for c in hostile_cases() + protocol_hostile_cases() if "image" in c.name]
    assert len(cases) >= 20
    config = load_config(None, environ={}, n_seq_max=2, n_batch=64, log_level="warning", accept_any_model=True)
    engine = cllm.AsyncLLM(config=config, backend=FakeBackend(slots=2, max_batch_tokens=64))
    with TestClient(create_app(config, engine=engine), base_url="http://localhost") as client:
        for case in cases:
            r = client.post(case.path, content=case.body, headers=case.headers)
            assert r.status_code == 400, (case.name, r.text)

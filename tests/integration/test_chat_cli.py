"""`cllm chat` driven through piped stdin: against a live `cllm serve` (--url) and in-process, with the
real embedded model. Commands, history, Ctrl-C (SIGINT) stopping a reply but not the program, EOF exit."""
from __future__ import annotations

import io
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from cllm.chat_cli import ChatLoop, Conversation, RemoteModel
from tests.integration.conftest_server import API_KEY, ServerProcess, _finish, start_server


@pytest.fixture(scope="module")
def chat_server() -> Iterator[ServerProcess]:
    srv = start_server("--n-seq-max", "2", "--n-ctx", "4096", api_key=API_KEY)
    yield srv
    _finish(srv)


def _chat_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "cllm", "chat", *args]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLLM_")}
    env["CLLM_PROGRESS"] = "0"
    return env


class _Reader:
    """Collects a pipe's output on a thread, so a test can wait for text while the process runs."""

    def __init__(self, pipe: io.BufferedReader) -> None:
        self.chunks: queue.Queue[bytes] = queue.Queue()
        self.text = ""
        threading.Thread(target=self._pump, args=(pipe,), daemon=True).start()

    def _pump(self, pipe: io.BufferedReader) -> None:
        while chunk := os.read(pipe.fileno(), 4096):
            self.chunks.put(chunk)

    def wait_for(self, predicate, timeout_s: float, what: str) -> str:  # noqa: ANN001
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                self.text += self.chunks.get(timeout=0.05).decode(errors="replace")
            except queue.Empty:
                pass
            if predicate(self.text):
                return self.text
        raise AssertionError(f"{what}; output so far: {self.text[-2000:]!r}")


def test_chat_against_a_server_with_piped_stdin(chat_server: ServerProcess) -> None:
    script = "\n".join([
        "Hello!",
        "/set temperature 0",
        "/set max_tokens 8",
        "/system You are terse.",
        "What is 2+2?",
        "/set",
        "/reset",
        "/set nonsense 1",
        "",
    ])
    env = _env() | {"CLLM_API_KEY": API_KEY}
    done = subprocess.run(_chat_cmd("--url", chat_server.base_url, "--max-tokens", "12"), input=script.encode(),
                          capture_output=True, timeout=120, env=env)
    out, err = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, err
    lines = out.splitlines()
    assert lines[0].strip(), "no reply to the first message"
    assert "(temperature = 0.0)" in out and "(max_tokens = 8)" in out
    assert "(system prompt: 'You are terse.')" in out
    assert "  max_tokens = 8" in out and "  temperature = 0.0" in out  # /set lists the settings
    assert "(conversation forgotten)" in out
    assert "unknown setting 'nonsense'" in out
    # one stats line per reply, the second limited by /set max_tokens 8
    stats = [line for line in err.splitlines() if line.startswith("[")]
    assert len(stats) == 2, err
    assert stats[1].startswith("[8 tokens") or "stop" in stats[1], stats


def test_chat_without_a_key_says_what_is_wrong(chat_server: ServerProcess) -> None:
    done = subprocess.run(_chat_cmd("--url", chat_server.base_url), input=b"hi\n", capture_output=True,
                          timeout=60, env=_env())
    assert done.returncode == 2
    assert "needs an API key" in done.stderr.decode()


async def _never(*_args: object) -> None:
    raise AssertionError("not called")


def test_history_and_system_prompt_go_to_the_server(chat_server: ServerProcess) -> None:
    """In this process (a ChatLoop over RemoteModel): each turn sends the system prompt and every turn before."""
    import asyncio

    loop = asyncio.new_event_loop()
    model = RemoteModel(chat_server.base_url, API_KEY)
    sent: list[list[dict[str, str]]] = []
    real_reply = model.reply

    async def recording_reply(messages, sampling, on_text):  # noqa: ANN001, ANN202
        sent.append([dict(m) for m in messages])
        return await real_reply(messages, sampling, on_text)

    model.reply = recording_reply  # type: ignore[method-assign]
    try:
        loop.run_until_complete(model.connect())
        assert model.name.startswith("SmolLM2")
        conversation = Conversation(sampling={"temperature": 0, "max_tokens": 6})
        stdin = io.StringIO("/system Be brief.\nfirst question\nsecond question\n")
        stdout, stderr = io.StringIO(), io.StringIO()
        assert ChatLoop(model, conversation, loop=loop, stdin=stdin, stdout=stdout, stderr=stderr).run() == 0
    finally:
        loop.run_until_complete(model.close())
        loop.close()
    assert sent[0] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "first question"}]
    assert [m["role"] for m in sent[1]] == ["system", "user", "assistant", "user"]
    assert sent[1][2]["content"] == conversation.history[1]["content"] != ""
    assert len(conversation.history) == 4


def _interrupt_a_long_reply(cmd: list[str], env: dict[str, str], *, server: ServerProcess | None) -> None:
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    out, err = _Reader(proc.stdout), _Reader(proc.stderr)  # type: ignore[arg-type]
    try:
        assert proc.stdin is not None
        proc.stdin.write(b"/set ignore_eos true\n/set max_tokens 1500\nTell me a very long story.\n")
        proc.stdin.flush()
        out.wait_for(lambda t: len(t.split("(max_tokens = 1500)\n", 1)[-1]) > 40, 90, "the long reply never started")
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        err.wait_for(lambda t: "[stopped]" in t, 10, "Ctrl-C did not stop the reply")
        if server is not None:  # the server aborted the request (the stream was closed)
            with server.http() as http:
                deadline = time.monotonic() + 5
                while http.get("/v1/engine").json()["running"]:
                    assert time.monotonic() < deadline, "the server still runs the interrupted request"
                    time.sleep(0.05)
        assert proc.poll() is None, "Ctrl-C ended the program"
        proc.stdin.write(b"/set max_tokens 4\nAnd now?\n")
        proc.stdin.flush()
        err.wait_for(lambda t: "[4 tokens" in t, 60, "no reply after the interrupted one")
        proc.stdin.close()  # EOF exits
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ctrl_c_stops_the_reply_not_the_program_over_http(chat_server: ServerProcess) -> None:
    env = _env() | {"CLLM_API_KEY": API_KEY}
    _interrupt_a_long_reply(_chat_cmd("--url", chat_server.base_url), env, server=chat_server)


def test_in_process_chat_ctrl_c_and_eof() -> None:
    _interrupt_a_long_reply(_chat_cmd("--n-threads", "1", "--temperature", "0"), _env(), server=None)


def test_image_command_attaches_images_to_the_next_message(tmp_path) -> None:
    """`/image PATH` in-process on the tiny Gemma 3 VLM (its projector beside it): the next message carries the
    image as an image_url part (kept in the history for later turns), the model answers; a missing file and a
    non-image are refused in the terminal without sending anything."""
    import asyncio
    from pathlib import Path

    from cllm import tiny_vlms
    from cllm.chat_cli import InProcessModel
    from cllm.config import load_config
    from cllm.engine.async_llm import AsyncLLM

    picture = tmp_path / "picture.png"
    tiny_vlms.sample_image("gemma3").save(picture)
    (tmp_path / "notes.txt").write_text("not an image")
    gguf = Path(__file__).resolve().parent.parent / "assets" / "models" / "tiny-gemma3-f32.gguf"
    loop = asyncio.new_event_loop()
    model = InProcessModel(AsyncLLM(config=load_config(model=str(gguf), backend="llama_cpp", n_ctx=2048, n_seq_max=1)))
    conversation = Conversation(sampling={"temperature": 0, "max_tokens": 4})
    script = f"/image {tmp_path / 'missing.png'}\n/image {tmp_path / 'notes.txt'}\n/image {picture}\nWhat is it?\nAnd now?\n"
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        assert ChatLoop(model, conversation, loop=loop, stdin=io.StringIO(script), stdout=stdout, stderr=stderr).run() == 0
    finally:
        loop.run_until_complete(model.close())
        loop.close()
    out = stdout.getvalue()
    assert "cannot attach" in out and "no such file" in out and "not a PNG, JPEG, WebP or GIF" in out
    assert "(image 1 attached to your next message)" in out
    first = conversation.history[0]["content"]
    assert first[0] == {"type": "text", "text": "What is it?"}
    assert first[1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert conversation.history[2] == {"role": "user", "content": "And now?"}  # the image went with one message
    assert stderr.getvalue().count("[4 tokens") == 2


# ---------------------------------------------------------------------------------------------- /image


def _sample_png(path, seed: int = 0, family: str = "llava"):  # noqa: ANN001, ANN202
    from cllm import tiny_vlms

    tiny_vlms.sample_image(family, seed=seed).save(path)
    return path


def _data_url(path, media_type: str) -> str:  # noqa: ANN001
    import base64

    return f"data:{media_type};base64," + base64.b64encode(path.read_bytes()).decode()


@pytest.mark.parametrize(("fmt", "suffix", "media_type"), [
    ("PNG", "png", "image/png"), ("JPEG", "jpg", "image/jpeg"), ("WEBP", "webp", "image/webp"), ("GIF", "gif", "image/gif")])
def test_image_part_holds_the_file_as_a_data_url(tmp_path, fmt: str, suffix: str, media_type: str) -> None:
    """The media type comes from the bytes, not the name: a WebP named .png is still image/webp."""
    from cllm import tiny_vlms
    from cllm.chat_cli import image_part

    path = tmp_path / f"picture.{suffix}"
    tiny_vlms.sample_image("llava").save(path, format=fmt)
    assert image_part(str(path)) == {"type": "image_url", "image_url": {"url": _data_url(path, media_type)}}
    misnamed = tmp_path / "misnamed.png"
    misnamed.write_bytes(path.read_bytes())
    assert image_part(str(misnamed))["image_url"]["url"].startswith(f"data:{media_type};base64,")


def test_image_command_checks_the_file_and_keeps_the_list(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What /image refuses (and why, in the terminal), what it lists, drops, and attaches, without a model."""
    import pathlib

    from cllm.chat_cli import HELP, MAX_IMAGE_FILE_BYTES

    conv = Conversation()
    spaced = _sample_png(tmp_path / "my picture.png")
    other = _sample_png(tmp_path / "other.png", seed=1)
    huge = tmp_path / "huge.png"
    with open(huge, "wb") as f:
        f.truncate(MAX_IMAGE_FILE_BYTES + 1)  # sparse: one byte over 20 MB
    (tmp_path / "notes.txt").write_text("not an image")
    locked = _sample_png(tmp_path / "locked.png")
    real_open = pathlib.Path.open
    monkeypatch.setattr(pathlib.Path, "open", lambda self, *a, **k: (
        (_ for _ in ()).throw(PermissionError(13, "Permission denied")) if self.name == "locked.png"
        else real_open(self, *a, **k)))

    assert "/image PATH" in conv.command("/help")[0] and "/image PATH" in HELP
    refusals = {
        f"/image {tmp_path / 'missing.png'}": "no such file",
        f"/image {tmp_path}": "not a file (a directory)",
        f"/image {huge}": "more than 20 MB",
        f"/image {tmp_path / 'notes.txt'}": "not a PNG, JPEG, WebP or GIF image",
        f"/image {locked}": "Permission denied",
    }
    for line, why in refusals.items():
        said, leave = conv.command(line)
        assert said.startswith("cannot attach") and why in said and not leave, (line, said)
    assert conv.images == [] and conv.command("/image")[0].startswith("(no image attached)")

    assert conv.command(f"/image {spaced}")[0] == "(image 1 attached to your next message)"  # a space in the name
    assert conv.command(f"/image '{other}'")[0] == "(image 2 attached to your next message)"  # dropped in, quoted
    escaped = str(spaced).replace(" ", "\\ ")
    assert conv.command(f"/image {escaped}")[0] == "(image 3 attached to your next message)"  # or escaped
    assert conv.command("/image")[0].startswith(f"attached to your next message:\n  1. {spaced}\n  2. {other}\n")
    assert conv.command("/image none")[0] == "(3 attached images dropped)" and conv.images == []

    conv.command(f"/image {spaced}")
    conv.command(f"/image {other}")
    message = conv.user_message("Compare them.")
    assert message == {"role": "user", "content": [
        {"type": "text", "text": "Compare them."},
        {"type": "image_url", "image_url": {"url": _data_url(spaced, "image/png")}},
        {"type": "image_url", "image_url": {"url": _data_url(other, "image/png")}}]}
    assert conv.images == [] and conv.user_message("Next.") == {"role": "user", "content": "Next."}
    conv.command(f"/image {spaced}")
    conv.command("/reset")  # forgets the attached images with the conversation
    assert conv.images == []


@pytest.fixture(scope="module")
def llava_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The tiny random LLaVA (cllm/tiny_vlms.py: CLIP tower, 16 image tokens a picture) on the torch backend."""
    from cllm import tiny_vlms

    model = tiny_vlms.build_tiny_vlm("llava", tmp_path_factory.mktemp("tiny-llava") / "tiny-llava")
    srv = start_server("--backend", "torch", "--model", str(model), "--set", "dtype=float32",
                       "--n-seq-max", "2", "--n-ctx", "4096", "--speculative", "off")
    yield srv
    _finish(srv)


def _remote_chat(server: ServerProcess, script: str, conversation: Conversation, api_key: str | None = None):  # noqa: ANN202
    """Run ``script`` through a ChatLoop over RemoteModel; (requests' messages as sent, stdout, stderr)."""
    import asyncio

    loop = asyncio.new_event_loop()
    model = RemoteModel(server.base_url, api_key)
    sent: list[list[dict]] = []
    real_reply = model.reply

    async def recording_reply(messages, sampling, on_text):  # noqa: ANN001, ANN202
        sent.append(json.loads(json.dumps(messages)))
        return await real_reply(messages, sampling, on_text)

    model.reply = recording_reply  # type: ignore[method-assign]
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        loop.run_until_complete(model.connect())
        assert ChatLoop(model, conversation, loop=loop, stdin=io.StringIO(script), stdout=stdout, stderr=stderr).run() == 0
    finally:
        loop.run_until_complete(model.close())
        loop.run_until_complete(loop.shutdown_asyncgens())  # as chat() does
        loop.close()
    return sent, stdout.getvalue(), stderr.getvalue()


def test_images_go_to_a_live_llava_server(llava_server: ServerProcess, tmp_path) -> None:
    """Two /image lines, one message: the request holds the text and both images as data URLs, the tiny LLaVA
    answers (the server counted 2 x 16 image tokens), and the next turn sends them again in the history."""
    first, second = _sample_png(tmp_path / "a.png"), _sample_png(tmp_path / "b.png", seed=1)
    conversation = Conversation(sampling={"temperature": 0, "max_tokens": 4, "ignore_eos": True})
    sent, out, err = _remote_chat(llava_server, f"/image {first}\n/image {second}\nWhat differs?\nAnd now?\n",
                                  conversation)
    parts = [{"type": "text", "text": "What differs?"},
             {"type": "image_url", "image_url": {"url": _data_url(first, "image/png")}},
             {"type": "image_url", "image_url": {"url": _data_url(second, "image/png")}}]
    assert sent[0] == [{"role": "user", "content": parts}]
    assert sent[1][0] == {"role": "user", "content": parts} and sent[1][2] == {"role": "user", "content": "And now?"}
    assert err.count("[4 tokens") == 2, err
    assert conversation.history[1]["content"] and conversation.history[3]["content"]
    import httpx

    with httpx.Client(base_url=llava_server.base_url, timeout=60) as http:  # the server reads both images
        usage = [http.post("/v1/chat/completions", json={"messages": m, "max_tokens": 1}).json()["usage"]
                 for m in (sent[0], [{"role": "user", "content": "What differs?"}])]
    assert usage[0]["prompt_tokens"] - usage[1]["prompt_tokens"] == 2 * 17  # <image> (16 tokens) + "\n" each


def test_a_refused_image_stays_attached_and_the_terminal_says_why(chat_server: ServerProcess, tmp_path) -> None:
    """The embedded text model: an image over the server's 1 MiB body limit gets the 413 and a hint, one within
    it the 400 "does not accept images"; neither message stays in the history, its images stay attached until
    /image none; then the conversation goes on."""
    import numpy as np
    from PIL import Image

    big = tmp_path / "noise.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (700, 700, 3), dtype=np.uint8), "RGB").save(big)
    small = _sample_png(tmp_path / "small.png")
    conversation = Conversation(sampling={"temperature": 0, "max_tokens": 4, "ignore_eos": True})
    script = f"/image {big}\nLook.\n/image none\n/image {small}\nLook again.\n/image\n/image none\nJust text.\n"
    sent, out, err = _remote_chat(chat_server, script, conversation, API_KEY)
    assert "error: server answered 413: request body exceeds the server's limit of 1048576 bytes" in err, err
    assert "--set max_body_bytes=N" in err
    assert "error: server answered 400: " in err and "does not accept images" in err
    assert err.count("(its 1 image stays attached to your next message; /image none drops it") == 2
    assert "1. image 1 of the unanswered message" in out
    assert [len(s) for s in sent] == [1, 1, 1] and sent[2] == [{"role": "user", "content": "Just text."}]
    assert [m["role"] for m in conversation.history] == ["user", "assistant"] and "[4 tokens" in err

"""`cllm chat`: a conversation with the model in the terminal.

In-process by default (an ``AsyncLLM`` on this machine), or against a running server (``--url``, any
OpenAI-compatible ``/v1/chat/completions``, streamed over httpx). The reply streams as it is made;
the conversation is kept and sent whole each turn (the engine's prefix cache makes that cheap).

Commands: ``/image PATH`` attaches an image file to the next message (for a vision model: it goes as an
OpenAI ``image_url`` part holding a base64 ``data:`` URL; ``/image`` alone lists the attached ones, ``/image
none`` drops them), ``/reset`` forgets the conversation, ``/system TEXT`` sets the system prompt (``/system``
alone clears it), ``/set KEY VALUE`` changes a sampling setting (``/set`` alone lists them), ``/help``,
``/exit``. Ctrl-C stops the reply being written (the request is aborted: in-process at once, over HTTP
by closing the stream, which the server aborts) and returns to the prompt; Ctrl-D (EOF) exits.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

import yaml



def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("expected true or false")
    return value


# Settings `/set` accepts and how each value is read (None clears an optional one: `/set seed none`).
SETTABLE: dict[str, Callable[[Any], Any]] = {
    "temperature": float, "top_p": float, "top_k": int, "min_p": float, "max_tokens": int,
    "repetition_penalty": float, "presence_penalty": float, "frequency_penalty": float, "seed": int,
    "stop": lambda v: [v] if isinstance(v, str) else [str(s) for s in v],
    "min_tokens": int, "ignore_eos": _boolean,
}
DEFAULT_SAMPLING = {"temperature": 0.7, "max_tokens": 512}  # as the chat page

HELP = """commands:
  /image PATH         attach an image file (PNG, JPEG, WebP, GIF; at most 20 MB) to your next message;
                      repeat for several; /image alone lists them, /image none drops them
  /reset              forget the conversation (the system prompt stays)
  /system TEXT        set the system prompt; /system alone clears it
  /set KEY VALUE      sampling setting, e.g. /set temperature 0.2 (/set alone lists them; VALUE none unsets)
                      keys: """ + ", ".join(SETTABLE) + """
  /help               this text
  /exit               leave (or Ctrl-D)
Ctrl-C stops the reply being written."""


@dataclass(slots=True)
class ReplyStats:
    """How one reply went."""

    tokens: int  # completion tokens (counted chunks where the server sent no usage)
    ttft_s: float | None  # request sent -> first text
    elapsed_s: float  # request sent -> end
    finish: str  # stop | length | ...

    def line(self) -> str:
        parts = [f"{self.tokens} tokens"]
        if self.ttft_s is not None:
            parts.append(f"TTFT {self.ttft_s * 1000:.0f} ms")
            decode_s = self.elapsed_s - self.ttft_s
            if self.tokens > 1 and decode_s > 0:
                parts.append(f"{(self.tokens - 1) / decode_s:.1f} tok/s")
        parts.append(self.finish)
        return "[" + ", ".join(parts) + "]"


class ChatModel(Protocol):
    """Where the replies come from."""

    name: str

    async def reply(self, messages: list[dict[str, Any]], sampling: dict[str, Any],
                    on_text: Callable[[str], None]) -> ReplyStats: ...

    async def close(self) -> None: ...


@dataclass(slots=True)
class Conversation:
    """The system prompt, the turns so far, and the sampling settings."""

    system: str | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_SAMPLING))
    images: list[dict[str, Any]] = field(default_factory=list)  # image_url parts for the next message
    image_names: list[str] = field(default_factory=list)  # their files, as /image named them (for /image alone)

    def user_message(self, text: str) -> dict[str, Any]:
        """The next user message: its text, and the images attached since the last one (then cleared)."""
        if not self.images:
            return {"role": "user", "content": text}
        content = [{"type": "text", "text": text}, *self.images]
        self.images, self.image_names = [], []
        return {"role": "user", "content": content}

    def take_back(self, message: dict[str, Any]) -> int:
        """A user message that was not answered: its images are attached to the next one again; how many."""
        content = message.get("content")
        parts = [p for p in content if p.get("type") == "image_url"] if isinstance(content, list) else []
        if parts and not self.images:
            self.images = parts
            self.image_names = [f"image {i + 1} of the unanswered message" for i in range(len(parts))]
        return len(parts)

    def messages(self) -> list[dict[str, Any]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.history

    def command(self, line: str) -> tuple[str, bool]:
        """Run a /command; (what to print, whether to exit)."""
        name, _, arg = line[1:].partition(" ")
        arg = arg.strip()
        if name in ("exit", "quit"):
            return "", True
        if name == "help":
            return HELP, False
        if name == "reset":
            self.history.clear()
            self.images, self.image_names = [], []
            return "(conversation forgotten)", False
        if name == "system":
            self.system = arg or None
            return f"(system prompt: {arg!r})" if arg else "(system prompt cleared)", False
        if name == "set":
            return self._set(arg), False
        if name == "image":
            return self._image(arg), False
        return f"unknown command /{name}; /help lists them", False

    def _image(self, arg: str) -> str:
        if not arg:
            listed = "".join(f"\n  {i + 1}. {name}" for i, name in enumerate(self.image_names))
            return ("attached to your next message:" + listed if listed else "(no image attached)") + \
                "\nusage: /image PATH (a PNG, JPEG, WebP or GIF file); /image none drops the attached ones"
        if arg == "none":
            n = len(self.images)
            self.images, self.image_names = [], []
            return f"({n} attached image{'' if n == 1 else 's'} dropped)"
        path = _typed_path(arg)
        try:
            part = image_part(path)
        except (OSError, ValueError) as err:
            return f"cannot attach {path!r}: {err}"
        self.images.append(part)
        self.image_names.append(path)
        return f"(image {len(self.images)} attached to your next message)"

    def _set(self, arg: str) -> str:
        if not arg:
            return "\n".join(f"  {k} = {json.dumps(v)}" for k, v in sorted(self.sampling.items())) or "  (server defaults)"
        key, _, raw = arg.partition(" ")
        if key not in SETTABLE:
            return f"unknown setting {key!r}: one of {', '.join(SETTABLE)}"
        if not raw.strip():
            return f"usage: /set {key} VALUE"
        try:
            value = yaml.safe_load(raw)
            if value is None or (isinstance(value, str) and value.lower() == "none"):
                self.sampling.pop(key, None)
                return f"({key} unset)"
            self.sampling[key] = SETTABLE[key](value)
        except (ValueError, TypeError, yaml.YAMLError) as err:
            return f"bad value for {key}: {raw!r} ({err})"
        return f"({key} = {json.dumps(self.sampling[key])})"


MAX_IMAGE_FILE_BYTES = 20 << 20  # the server's max_image_bytes default
_IMAGE_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "MPO": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}


def _typed_path(arg: str) -> str:
    """The path as typed, or as a shell would read it when that is no file: a path dropped into a terminal
    comes quoted ('/a b.png') or escaped (/a\\ b.png)."""
    import os
    import shlex

    if os.path.exists(os.path.expanduser(arg)):
        return arg
    try:
        words = shlex.split(arg)
    except ValueError:
        return arg
    return words[0] if len(words) == 1 else arg


def image_part(path: str) -> dict[str, Any]:
    """An OpenAI ``image_url`` part holding the file as a base64 data URL; ValueError / OSError saying why not
    (no such file, a directory, over 20 MB, unreadable, not a PNG, JPEG, WebP or GIF). The server checks the
    bytes again."""
    import base64
    import io
    from pathlib import Path

    file = Path(path).expanduser()
    if not file.exists():
        raise ValueError("no such file")
    if not file.is_file():
        raise ValueError("not a file" + (" (a directory)" if file.is_dir() else ""))
    too_large = f"more than {MAX_IMAGE_FILE_BYTES >> 20} MB ({MAX_IMAGE_FILE_BYTES} bytes)"
    if file.stat().st_size > MAX_IMAGE_FILE_BYTES:
        raise ValueError(too_large)
    with file.open("rb") as f:  # PermissionError (an OSError) when it cannot be read
        data = f.read(MAX_IMAGE_FILE_BYTES + 1)  # bounded: the file may have grown since stat
    if len(data) > MAX_IMAGE_FILE_BYTES:
        raise ValueError(too_large)
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            kind = _IMAGE_TYPES.get(image.format or "")
    except (UnidentifiedImageError, OSError):
        kind = None
    if kind is None:
        raise ValueError("not a PNG, JPEG, WebP or GIF image")
    return {"type": "image_url", "image_url": {"url": f"data:{kind};base64,{base64.b64encode(data).decode()}"}}


class InProcessModel:
    """An AsyncLLM in this process."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.name = str(engine.model_name)

    async def reply(self, messages: list[dict[str, Any]], sampling: dict[str, Any],
                    on_text: Callable[[str], None]) -> ReplyStats:
        from cllm.sampling.params import SamplingParams

        params = SamplingParams(**sampling)  # ValueError for a bad combination: the caller reports it
        start = time.perf_counter()
        first: float | None = None
        out = None
        async for out in self.engine.chat(messages, params):
            delta = out.outputs[0].text_delta
            if delta:
                first = first if first is not None else time.perf_counter()
                on_text(delta)
        tokens = out.usage.completion_tokens if out is not None else 0
        finish = (out.outputs[0].finish_reason if out is not None else None) or "stop"
        return ReplyStats(tokens, None if first is None else first - start, time.perf_counter() - start, finish)

    async def close(self) -> None:
        await self.engine.shutdown(0)


class RemoteModel:
    """A running OpenAI-compatible server (cllm serve, or any other)."""

    def __init__(self, url: str, api_key: str | None, model: str | None = None, timeout_s: float = 600.0) -> None:
        import httpx  # the server / bench extra

        base = url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0))
        self.name = model or ""

    async def connect(self) -> None:
        """Learn the model's name (GET /v1/models); RuntimeError that says what is wrong."""
        import httpx

        try:
            res = await self.client.get(f"{self.base}/models")
        except httpx.HTTPError as err:
            raise RuntimeError(f"cannot reach {self.base}: {err}") from None
        if res.status_code == 401:
            raise RuntimeError(f"{self.base} needs an API key: pass --api-key or set CLLM_API_KEY")
        if res.status_code != 200:
            raise RuntimeError(f"GET {self.base}/models answered {res.status_code}: {res.text[:300]}")
        data = res.json().get("data") or []
        names = [card.get("id") for card in data]
        if not self.name:
            self.name = data[0]["id"] if data else "model"
        elif names and self.name not in names:
            raise RuntimeError(f"{self.base} serves no model {self.name!r}; it serves "
                               + ", ".join(repr(n) for n in names))

    async def reply(self, messages: list[dict[str, Any]], sampling: dict[str, Any],
                    on_text: Callable[[str], None]) -> ReplyStats:
        body = {"model": self.name, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, **sampling}
        start = time.perf_counter()
        first: float | None = None
        chunks, usage, finish = 0, None, None
        async with self.client.stream("POST", f"{self.base}/chat/completions", json=body) as res:
            if res.status_code != 200:
                text = (await res.aread()).decode(errors="replace")
                hint = _IMAGE_SIZE_HINT if res.status_code == 413 and _holds_images(messages) else ""
                raise RuntimeError(f"server answered {res.status_code}: {_error_message(text)}{hint}")
            # Both generators closed explicitly: [DONE] ends the loop before the lines run out, and an
            # abandoned one is finalised at interpreter exit ("Task was destroyed but it is pending").
            async with contextlib.aclosing(res.aiter_lines()) as lines, \
                    contextlib.aclosing(_sse_events(lines)) as events:
                async for event in events:
                    if "error" in event:
                        raise RuntimeError(f"server error: {event['error'].get('message')}")
                    usage = event.get("usage") or usage
                    for choice in event.get("choices") or []:
                        delta = (choice.get("delta") or {}).get("content")
                        if delta:
                            first = first if first is not None else time.perf_counter()
                            chunks += 1
                            on_text(delta)
                        finish = choice.get("finish_reason") or finish
        tokens = usage["completion_tokens"] if usage else chunks
        return ReplyStats(tokens, None if first is None else first - start, time.perf_counter() - start, finish or "stop")

    async def close(self) -> None:
        await self.client.aclose()


async def _sse_events(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    async for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, ": keep-alive" comments
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


_IMAGE_SIZE_HINT = (" (images go inside the request, the whole conversation's included: a server started with a "
                    "larger --set max_body_bytes=N takes them)")


def _holds_images(messages: list[dict[str, Any]]) -> bool:
    return any(isinstance(m.get("content"), list) and any(p.get("type") == "image_url" for p in m["content"])
               for m in messages)


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:300]


class ChatLoop:
    """Reads lines, runs commands, streams replies; Ctrl-C cancels the reply in flight."""

    def __init__(self, model: ChatModel, conversation: Conversation, *, loop: asyncio.AbstractEventLoop,
                 stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout, stderr: TextIO = sys.stderr) -> None:
        self.model, self.conversation, self.loop = model, conversation, loop
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.interactive = stdin.isatty()
        self._reply_task: asyncio.Task[ReplyStats] | None = None

    def run(self) -> int:
        if self.interactive:
            try:
                import readline  # noqa: F401 - line editing and history for input()
            except ImportError:
                pass
            self.stderr.write(f"chatting with {self.model.name}; /help for commands, Ctrl-C stops a reply, "
                              "Ctrl-D exits\n")
        while True:
            try:
                line = self._read_line()
            except KeyboardInterrupt:
                self.stdout.write("\n(Ctrl-D or /exit leaves)\n")
                continue
            if line is None:
                if self.interactive:
                    self.stdout.write("\n")
                return 0
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                text, leave = self.conversation.command(line)
                if text:
                    self.stdout.write(text + "\n")
                    self.stdout.flush()
                if leave:
                    return 0
                continue
            self.turn(line)

    def _read_line(self) -> str | None:
        if self.interactive and self.stdin is sys.stdin:
            try:
                return input("you> ")
            except EOFError:
                return None
        line = self.stdin.readline()
        return line if line else None

    def turn(self, text: str) -> None:
        """One user message and the model's streamed reply."""
        history = self.conversation.history
        history.append(self.conversation.user_message(text))
        parts: list[str] = []

        def on_text(delta: str) -> None:
            parts.append(delta)
            self.stdout.write(delta)
            self.stdout.flush()

        if self.interactive:
            self.stdout.write(f"{self.model.name}> ")
            self.stdout.flush()
        stats, note = self._run_reply(on_text)
        self.stdout.write("\n")
        self.stdout.flush()
        reply = "".join(parts)
        if reply:
            history.append({"role": "assistant", "content": reply})
        elif stats is None and note.startswith("error"):
            n = self.conversation.take_back(history.pop())  # nothing came back: the message did not happen
            if n:
                note += (f"\n(its {n} image{'' if n == 1 else 's'} stay{'s' if n == 1 else ''} attached to your "
                         f"next message; /image none drops {'it' if n == 1 else 'them'})")
        self.stderr.write((stats.line() if stats is not None else note) + "\n")
        self.stderr.flush()

    def _run_reply(self, on_text: Callable[[str], None]) -> tuple[ReplyStats | None, str]:
        task = self.loop.create_task(self.model.reply(self.conversation.messages(), dict(self.conversation.sampling),
                                                      on_text))
        self._reply_task = task
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGINT, lambda *_: self.loop.call_soon_threadsafe(task.cancel))
        try:
            return self.loop.run_until_complete(task), ""
        except asyncio.CancelledError:
            return None, "[stopped]"
        except (RuntimeError, ValueError, TypeError, OSError) as err:
            return None, f"error: {err}"
        except Exception as err:  # httpx's transport errors and the like: the conversation goes on
            return None, f"error: {type(err).__name__}: {err}"
        finally:
            self._reply_task = None
            if previous is not None:
                signal.signal(signal.SIGINT, previous)


def open_model(loop: asyncio.AbstractEventLoop, *, url: str | None, api_key: str | None, config: Any,
               model_name: str | None = None) -> ChatModel:
    """The model to chat with: a server at ``url``, else an AsyncLLM built from ``config``."""
    if url:
        remote = RemoteModel(url, api_key, model_name)
        try:
            loop.run_until_complete(remote.connect())
        except BaseException:
            loop.run_until_complete(remote.close())
            raise
        return remote
    from cllm.engine.async_llm import AsyncLLM
    from cllm.progress import model_load_phase

    with model_load_phase(config):
        engine = AsyncLLM(config=config)
    return InProcessModel(engine)


def chat(*, url: str | None, api_key: str | None, config: Any, system: str | None = None,
         sampling: dict[str, Any] | None = None, model_name: str | None = None,
         stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout, stderr: TextIO = sys.stderr) -> int:
    """Run a terminal conversation until EOF or /exit; the exit status."""
    loop = asyncio.new_event_loop()
    try:
        try:
            model = open_model(loop, url=url, api_key=api_key, config=config, model_name=model_name)
        except (RuntimeError, ValueError, FileNotFoundError, KeyError) as err:
            stderr.write(f"error: {err}\n")
            return 2
        conversation = Conversation(system=system, sampling={**DEFAULT_SAMPLING, **(sampling or {})})
        try:
            return ChatLoop(model, conversation, loop=loop, stdin=stdin, stdout=stdout, stderr=stderr).run()
        finally:
            loop.run_until_complete(model.close())
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())  # as asyncio.run: no generator left to the GC
        loop.close()

"""Chat templates: the model's own Jinja template, rendered in a sandbox (cllm.chat_sandbox)."""
from __future__ import annotations

import re
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError

from cllm.backends.base import Tokenizer
from cllm.chat_sandbox import TemplateRaised, compile_template
from cllm.config import ImageConfig
from cllm.multimodal.content import load_messages, parse_parts

ROLES = ("system", "user", "assistant", "tool", "developer")
def normalize_messages(messages: Sequence[Any], *, images: ImageConfig | None = None) -> list[dict[str, Any]]:
    """Check OpenAI-style messages; content given as text parts is joined. ValueError names the bad item.

    Content with images (``image_url`` parts, and from Python ``{"type": "image", "image": PIL image |
    path | bytes | ImageData}``) stays a list of ``{"type": "text", "text"}`` and ``{"type": "image",
    "image": ImageData}`` parts in order, each image loaded and checked under ``images`` (the request's
    limits; None: ImageConfig()'s, without the count limit), only in user and tool messages
    (cllm.multimodal.content). Text-only content is a string, as before images.

    Besides role and content, a message keeps ``name``, ``tool_call_id`` (tool results) and
    ``tool_calls`` (an assistant's calls), which tool-aware templates render."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role={role!r}: must be one of {', '.join(ROLES)}")
        if isinstance(content, list):  # parts: their text, or (with images) text and image items
            content = parse_parts(((f"messages[{i}].content[{j}]", p) for j, p in enumerate(content)), role, local=True)
        if content is None and role == "assistant":
            content = ""
        if content is None and role == "tool":
            content = ""
        if not isinstance(content, (str, list)):
            raise ValueError(f"messages[{i}].content must be a string or a list of content parts")
        out.append({"role": role, "content": content, **_tool_fields(i, m)})
    return load_messages(out, images)


def _tool_fields(i: int, m: dict[str, Any]) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise ValueError(f"messages[{i}].{key} must be a string")
            extra[key] = m[key]
    calls = m.get("tool_calls")
    if calls:
        if m.get("role") != "assistant" or not isinstance(calls, list):
            raise ValueError(f"messages[{i}].tool_calls: only an assistant message carries a list of tool calls")
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(f"messages[{i}].tool_calls[{j}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"arguments\": ...}}}}")
        extra["tool_calls"] = calls
    return extra


Segment = tuple[str, bool]  # (text, trusted: special-token text in it becomes control tokens)

# Private-use code points: no model's template or vocabulary gives them meaning. Every control-token
# text inside the caller's strings is wrapped in them before rendering, so that after rendering the
# template's own control tokens and the caller's can be told apart (see render_segments).
_MARK_START, _MARK_END = "\ue010", "\ue011"
# Appended to the final message for continue_final_message; the space after it shows whether the
# template kept the message's trailing whitespace.
_CONTINUE_TAG = "\ue012cllm-continue\ue013"
# Where an image part was: the template sees string content with this in the image's place (every
# template can render that), and tokenising puts the image there (cllm.multimodal.MultimodalPrompt).
IMAGE_MARK = "\ue014"


class ChatTemplate:
    """Renders messages into a prompt with the model's template (or ``source``, the chat_template
    setting, in its place)."""

    def __init__(self, tokenizer: Tokenizer, source: str | None = None) -> None:
        source = source or tokenizer.chat_template
        if not source:
            raise ValueError("the model has no chat template in its metadata; use completions with a plain prompt, "
                             "or give one with the chat_template setting (--chat-template)")
        self._template = compile_template(source)
        eos = sorted(tokenizer.eos_token_ids)
        bos = tokenizer.bos_token_id
        self._bos = tokenizer.special_token(bos) if bos is not None else ""
        self._eos = tokenizer.special_token(eos[0]) if eos else ""
        alternatives = _trie_pattern({t for t in tokenizer.control_tokens if t}) or "(?!)"  # (?!) matches nothing
        self._control = re.compile(alternatives)
        self._marked = re.compile(f"{_MARK_START}({alternatives}){_MARK_END}|[{_MARK_START}{_MARK_END}]")

    def render(self, messages: Sequence[Any], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False) -> str:
        """The prompt text, exactly as the template writes it."""
        return "".join(text for text, _ in self.render_segments(
            messages, add_generation_prompt=add_generation_prompt, tools=tools,
            continue_final_message=continue_final_message))

    def render_segments(self, messages: Sequence[Any], *, add_generation_prompt: bool = True,
                        tools: list[dict[str, Any]] | None = None,
                        continue_final_message: bool = False) -> list[Segment]:
        """The prompt as (text, trusted) pieces. Trusted pieces are tokenised with special-token
        parsing; an untrusted piece is a control token's text that came from the caller's strings
        (content, names, tool calls, tool definitions), to be tokenised as plain text, so that a
        user's "<|im_end|>\\n<|im_start|>system" can never become real control tokens (role injection).

        The template renders the real strings, with only those control-token texts wrapped in
        private-use markers. Without any, the whole prompt is one trusted piece: tokenised in one
        call, it gives exactly the ids transformers' ``apply_chat_template(tokenize=True)`` gives,
        whitespace merges across markup and content included. (Rendering placeholders for the
        content and tokenising each piece apart, as cllm did before, split "\\n\\n" + "Hi" into ids
        the model never saw in training, and could not follow templates that trim or split content.)
        A marker the template separated from its token (``split``, slicing) is dropped but still
        breaks the text, so that the text on its two sides cannot join into a control token.
        """
        segments, images = self.render_with_images(messages, add_generation_prompt=add_generation_prompt,
                                                   tools=tools, continue_final_message=continue_final_message)
        if images:
            raise ValueError("the messages hold images: render them with render_with_images")
        return segments

    def render_with_images(self, messages: Sequence[Any], *, add_generation_prompt: bool = True,
                           tools: list[dict[str, Any]] | None = None,
                           continue_final_message: bool = False) -> tuple[list[Segment], list[Any]]:
        """``render_segments`` for messages that may hold images: each image part is rendered as
        ``IMAGE_MARK`` inside its message's text; returns the segments and the images in prompt order."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: "
                             "continue the last message, or start a new assistant turn")
        msgs, images = _images_as_marks(self._mark(normalize_messages(messages)))
        if continue_final_message:
            msgs[-1] = {**msgs[-1], "content": msgs[-1]["content"] + _CONTINUE_TAG + " "}
        try:
            text = self._template.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                         bos_token=self._bos, eos_token=self._eos, tools=self._mark(tools))
        except TemplateRaised:
            raise
        except (TemplateError, TypeError, LookupError, AttributeError, ArithmeticError) as err:
            raise ValueError(f"chat template failed to render: {err}") from None
        if continue_final_message:
            text = _cut_at_continue_tag(text)
        if text.count(IMAGE_MARK) != len(images):
            raise ValueError(f"the chat template rendered {text.count(IMAGE_MARK)} of the messages' {len(images)} "
                             "images (it drops or repeats message content)")
        return self._segments(text), images

    def _mark(self, value: Any) -> Any:
        """``value`` with every control-token text in its strings wrapped in markers (dict keys kept)."""
        if isinstance(value, str):
            plain = value.replace(_MARK_START, "").replace(_MARK_END, "").replace(IMAGE_MARK, "")  # no forged markers
            return self._control.sub(lambda m: _MARK_START + m.group(0) + _MARK_END, plain)
        if isinstance(value, dict):
            return {key: self._mark(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._mark(item) for item in value]
        return value

    def _segments(self, text: str) -> list[Segment]:
        parts = self._marked.split(text)  # [text, marked token or None, text, ...]
        segments: list[Segment] = []
        for i, part in enumerate(parts):
            if part:
                segments.append((part, i % 2 == 0))
        return segments


def _images_as_marks(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Messages whose content lists text and image parts (normalize_messages) as plain strings with
    IMAGE_MARK where each image was; the images, in order."""
    images: list[Any] = []
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            pieces = []
            for part in content:
                if part["type"] == "image":
                    images.append(part["image"])
                    pieces.append(IMAGE_MARK)
                else:
                    pieces.append(part["text"])
            m = {**m, "content": "".join(pieces)}
        out.append(m)
    return out, images


def _trie_pattern(words: set[str]) -> str:
    """A regex matching any of ``words``, the longest where several start at one place (as tokenizers
    match special tokens). Built as a trie: a plain alternation tries every word at every position, and
    with a vocabulary's thousands of control tokens ("<unused123>") a 1 MB message took seconds."""
    trie: dict[str, dict] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}  # a word ends here
    return _trie_node_pattern(trie)


def _trie_node_pattern(node: dict[str, dict]) -> str:
    branches = [re.escape(ch) + _trie_node_pattern(child) for ch, child in sorted(node.items()) if ch]
    if not branches:
        return ""
    body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
    return f"(?:{body})?" if "" in node else body  # greedy: the longer word first


def _cut_at_continue_tag(text: str) -> str:
    """The prompt up to where the final message's text ends, so that generation continues it."""
    at = text.rfind(_CONTINUE_TAG)
    if at < 0:
        raise ValueError("continue_final_message: this chat template does not write the final message's content "
                         "at the end of the prompt, so it cannot be continued")
    if text.startswith(" ", at + len(_CONTINUE_TAG)):
        return text[:at]
    return text[:at].rstrip()  # the template trims messages: trim the continued one too


def encode_segments(tokenizer: Tokenizer, segments: Sequence[Segment], *, add_bos: bool,
                    continued: bool = False) -> list[int]:
    """Token ids of a rendered chat: trusted pieces with special-token parsing, untrusted ones as text.

    Only the first piece is tokenised at the start of a text. The others follow a control token in
    the prompt, so each is tokenised after a newline, whose ids are then dropped: a SentencePiece
    tokenizer would otherwise add its word-start space to them (as transformers does too).
    """
    ids: list[int] = []
    newline: list[int] | None = None
    for i, (piece, trusted) in enumerate(segments):
        if i == 0 and not continued:  # (continued: the text follows an image, which ends in a control token)
            ids += tokenizer.encode(piece, add_special=add_bos, parse_special=trusted)
            continue
        if newline is None:
            newline = tokenizer.encode("\n", add_special=False, parse_special=False)
        piece_ids = tokenizer.encode("\n" + piece, add_special=False, parse_special=trusted)
        if piece_ids[:len(newline)] == newline:
            piece_ids = piece_ids[len(newline):]
        else:
            piece_ids = tokenizer.encode(piece, add_special=False, parse_special=trusted)
        ids += piece_ids
    return ids


def encode_with_images(tokenizer: Tokenizer, segments: Sequence[Segment]) -> tuple[list[int], list[int]]:
    """Token ids of a rendered chat whose text holds IMAGE_MARKs: the text's ids, and for each mark the
    index in them where its image goes. The text on the two sides of an image is tokenised apart, as
    libmtmd and transformers' processors do (an image always sits between control tokens)."""
    ids: list[int] = []
    at: list[int] = []
    group: list[Segment] = []
    for piece, trusted in segments:
        parts = piece.split(IMAGE_MARK) if trusted else [piece]
        for j, part in enumerate(parts):
            if j:
                ids += encode_segments(tokenizer, group, add_bos=False, continued=bool(at))
                at.append(len(ids))
                group = []
            if part:
                group.append((part, trusted))
    ids += encode_segments(tokenizer, group, add_bos=False, continued=bool(at))
    return ids, at


def chat_template_setting(value: str | None) -> str | None:
    """The template the chat_template setting names: a file's text, or the setting itself when it is a
    Jinja template; None when unset. ValueError for a value that is neither."""
    if not value:
        return None
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"chat_template={value!r}: no such file, and not a Jinja template either "
                         f"(give a template file's path or the template text)")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"chat_template={value!r}: cannot read the file ({err})") from None

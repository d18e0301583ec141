"""Images on the llama.cpp backend: libmtmd (llama.cpp's multimodal library, as llama-server uses it)
through llama-cpp-python's ``mtmd_cpp`` bindings.

An image becomes a span of placeholder ids in the request's prompt (``expand``); when the scheduler
reaches the span, the backend encodes the image with the projector and decodes its embeddings into
the sequence's KV at the span's positions (``decode``) — in llama_decode calls of its own, before the
step's token batch, so that other sequences' decodes run in the same step. Each slot's prefix cache
records an image's positions as keys made from its pixel hash (``cllm.multimodal.span.cache_keys``), so two prompts share
cached KV through an image only when the images are equal, whatever URL or file they came from.
"""
from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from llama_cpp import llama_cpp as C
from llama_cpp import mtmd_cpp as M

from cllm.backends.llama_cpp.native import LlamaModelHandle, _silent_log
from cllm.multimodal.image import ImageData
from cllm.multimodal.span import ImageSpan

log = logging.getLogger(__name__)

_CHUNK_TEXT, _CHUNK_IMAGE = 0, 1  # enum mtmd_input_chunk_type
_NO_CALLBACK = M.mtmd_helper_post_decode_callback()  # NULL: no post-decode hook
# Names a vocabulary gives its image placeholder; the first one present stands for an image's positions
# in prompt ids (the ids are never evaluated: the embeddings are).
_PLACEHOLDER_NAMES = ("<image>", "<|image_pad|>", "<image_soft_token>", "<|image|>", "<img>", "<fake_token_around_image>")


def find_mmproj(model_path: Path, setting: str | None) -> Path | None:
    """The projector to load: the setting's file; with none set, one beside the model (llama-server finds
    one beside a model it downloads; locally it needs --mmproj: cllm looks, so a folder holding a model
    and its projector serves images as it is); None for 'none' or when nothing is found."""
    if setting is not None:
        if setting.lower() == "none":
            return None
        path = Path(setting).expanduser()
        if not path.is_file():
            raise ValueError(f"mmproj={setting!r}: no such file (give the projector GGUF written by "
                             "convert_hf_to_gguf.py --mmproj, or 'none')")
        return path
    folder, stem = model_path.parent, model_path.stem
    for name in (f"mmproj-{stem}.gguf", f"{stem}-mmproj.gguf", f"{stem}.mmproj.gguf"):
        if (folder / name).is_file():
            return folder / name
    found = sorted(p for p in folder.glob("*.gguf") if "mmproj" in p.name.lower() and p != model_path)
    return found[0] if len(found) == 1 else None


class ImageChunk:
    """An owned mtmd_input_chunk (an image's tokens, as mtmd_tokenize made them); freed with the request."""

    def __init__(self, chunk: M.mtmd_input_chunk_p) -> None:
        self.ptr = M.mtmd_input_chunk_copy(chunk)
        self.n_tokens = int(M.mtmd_input_chunk_get_n_tokens(self.ptr))
        self.n_pos = int(M.mtmd_input_chunk_get_n_pos(self.ptr))

    def close(self) -> None:
        ptr, self.ptr = self.ptr, None
        if ptr:
            M.mtmd_input_chunk_free(ptr)

    def __del__(self) -> None:  # a span lives as long as its request: no owner closes it explicitly
        self.close()


@dataclass(slots=True)
class _Tokenized:
    before: list[int]  # text ids mtmd puts before the image (its begin-of-image markers)
    chunk: ImageChunk  # the image's tokens
    after: list[int]  # text ids after it


class MtmdContext:
    """A loaded projector (mtmd_context*), bound to the text model it feeds."""

    def __init__(self, *, path: Path, model: LlamaModelHandle, n_threads: int, use_gpu: bool) -> None:
        # libmtmd and its helpers log through their own hooks: into cllm's logger, as llama.cpp's log
        M.mtmd_log_set(_silent_log, None)
        M.mtmd_helper_log_set(_silent_log, None)
        params = M.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = n_threads
        params.print_timings = False
        # A warm-up encode allocates the encoder's compute buffers now, as llama-server does: the backend sizes
        # its KV cache after this, from the memory still available, so the encoder's memory is counted there.
        params.warmup = True
        ctx = M.mtmd_init_from_file(str(path).encode(), model.ptr, params)
        if not ctx:
            raise ValueError(f"libmtmd could not load the projector {str(path)!r} for this model "
                             "(is it the mmproj written for this model? llama.cpp's log says why)")
        self.ctx = ctx
        if not M.mtmd_support_vision(ctx):
            self.close()
            raise ValueError(f"the projector {str(path)!r} has no vision encoder (audio only)")
        self.path = path
        self.uses_mrope = bool(M.mtmd_decode_use_mrope(ctx))
        self._marker = M.mtmd_default_marker()
        self.placeholder_id = _placeholder_id(model)

    def tokenize(self, image: ImageData) -> _Tokenized:
        """The ids and chunk of one image, as libmtmd places it in a prompt (with the model's markers)."""
        data = (ctypes.c_ubyte * len(image.rgb)).from_buffer_copy(image.rgb)
        bitmap = M.mtmd_bitmap_init(image.width, image.height, data)
        if not bitmap:
            raise ValueError(f"libmtmd refused a {image.width}x{image.height} image")
        chunks = M.mtmd_input_chunks_init()
        try:
            M.mtmd_bitmap_set_id(bitmap, image.hash.encode())
            text = M.mtmd_input_text(text=self._marker, text_len=len(self._marker), add_special=False, parse_special=True)
            bitmaps = (M.mtmd_bitmap_p_ctypes * 1)(bitmap)
            rc = M.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), bitmaps, 1)
            if rc != 0:
                raise ValueError(f"libmtmd could not tokenize a {image.width}x{image.height} image (code {rc})")
            return _split_chunks(chunks)
        finally:
            M.mtmd_input_chunks_free(chunks)
            M.mtmd_bitmap_free(bitmap)

    def expand_one(self, image: ImageData, offset: int) -> tuple[list[int], ImageSpan]:
        """One image's ids (libmtmd's markers around a placeholder per embedding) and span, for splice_images."""
        tok = self.tokenize(image)
        span = ImageSpan(offset + len(tok.before), tok.chunk.n_tokens, image, tok.chunk.n_pos, payload=tok.chunk)
        return tok.before + [self.placeholder_id] * tok.chunk.n_tokens + tok.after, span

    def decode(self, lctx: ctypes.c_void_p, span: ImageSpan, *, pos: int, seq_id: int, n_batch: int) -> None:
        """Encode the span's image and decode its embeddings into ``seq_id`` from llama position ``pos``.
        RuntimeError when the encoder or llama_decode fails (the sequence fails; nothing else does)."""
        chunk: ImageChunk = span.payload
        rc = M.mtmd_encode_chunk(self.ctx, chunk.ptr)
        if rc != 0:
            raise RuntimeError(f"the image encoder failed (code {rc})")
        embd = M.mtmd_get_output_embd(self.ctx)
        new_pos = C.llama_pos(0)
        rc = M.mtmd_helper_decode_image_chunk(self.ctx, lctx, chunk.ptr, embd, pos, seq_id, n_batch,
                                              ctypes.byref(new_pos), _NO_CALLBACK, None)
        if rc != 0:
            raise RuntimeError(f"llama_decode of an image's embeddings failed (code {rc})")

    def close(self) -> None:
        ctx, self.ctx = self.ctx, None
        if ctx:
            M.mtmd_free(ctx)


def _split_chunks(chunks: M.mtmd_input_chunks_p) -> _Tokenized:
    before: list[int] = []
    after: list[int] = []
    image: ImageChunk | None = None
    for i in range(M.mtmd_input_chunks_size(chunks)):
        chunk = M.mtmd_input_chunks_get(chunks, i)
        if M.mtmd_input_chunk_get_type(chunk) == _CHUNK_IMAGE:
            image = ImageChunk(chunk)
            continue
        n = ctypes.c_size_t(0)
        tokens = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
        (after if image is not None else before).extend(int(tokens[j]) for j in range(n.value))
    if image is None:
        raise ValueError("libmtmd gave no image chunk for an image")
    return _Tokenized(before, image, after)


def _placeholder_id(model: LlamaModelHandle) -> int:
    for name in _PLACEHOLDER_NAMES:
        ids = (C.llama_token * 8)()
        n = C.llama_tokenize(model.vocab, name.encode(), len(name.encode()), ids, 8, False, True)
        if n == 1:
            return int(ids[0])
    return 0


def llama_pos(spans: Sequence[ImageSpan], index: int) -> int:
    """llama.cpp's position of the token at ``index``: an M-RoPE image advances fewer positions than it has
    tokens, so what follows it sits earlier (1-D models: the index itself)."""
    pos = index
    for span in spans:
        if span.start >= index:
            break
        pos -= span.length - span.positions if span.end <= index else 0
    return pos

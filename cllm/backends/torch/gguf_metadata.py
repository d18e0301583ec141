"""A GGUF file's header: its key/value metadata and tensor directory, read without its vocabulary.

``gguf.GGUFReader`` builds a numpy view per element of every array, so the token and merge lists of a
49k-entry vocabulary cost it ~4 s (three times that for a 150k one); the torch backend needs a few
scalars and one or two small tensors (``rope_freqs``, Phi-3's ``rope_factors_*``) beside what
transformers' GGUF reader takes. This reads the header in one pass over a memory map, stepping over
long arrays (their lengths kept, not their contents), in well under a second.

Format (GGUF v2/v3, little-endian; https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): magic,
version, tensor count, key/value count; the key/value pairs; per tensor its name, dims, ggml type and
offset; then, at the ``general.alignment`` boundary, the tensor data.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ARRAY_KEEP = 1024  # arrays up to this length are kept as lists; longer ones (vocabularies) only counted
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_GGML_F32, _GGML_F16 = 0, 1


@dataclass(slots=True, frozen=True)
class TensorInfo:
    """One entry of the tensor directory."""

    shape: tuple[int, ...]  # ggml order: the fastest-varying dimension first
    ggml_type: int  # ggml_type (0 F32, 1 F16, 8 Q8_0, ...)
    offset: int  # absolute byte offset of the data in the file


@dataclass(slots=True)
class GGUFMetadata:
    """What a GGUF header says; ``get`` looks keys up, ``tensor`` reads a small float tensor."""

    path: Path
    fields: dict[str, Any]  # key -> value (int/float/bool/str, a list for short arrays, ArrayLength for long ones)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)  # tensor name -> directory entry

    @property
    def architecture(self) -> str:
        return str(self.fields.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        """``{architecture}.{key}``'s value (the architecture prefix added), else ``default``."""
        return self.fields.get(f"{self.architecture}.{key}", default)

    def tensor(self, name: str) -> np.ndarray | None:
        """An F32 or F16 tensor as float32 (flattened), or None if the file has no tensor ``name``."""
        info = self.tensors.get(name)
        if info is None:
            return None
        dtype = {_GGML_F32: np.float32, _GGML_F16: np.float16}.get(info.ggml_type)
        if dtype is None:
            raise ValueError(f"{self.path}: tensor {name!r} has ggml type {info.ggml_type}; expected F32 or F16")
        count = int(np.prod(info.shape)) if info.shape else 1
        with open(self.path, "rb") as f:
            f.seek(info.offset)
            data = np.frombuffer(f.read(count * np.dtype(dtype).itemsize), dtype=dtype)
        return data.astype(np.float32)


@dataclass(slots=True, frozen=True)
class ArrayLength:
    """A long array's place in ``GGUFMetadata.fields``: its length, not its contents."""

    length: int


def read_gguf_metadata(path: Path) -> GGUFMetadata:
    """The header of the GGUF file at ``path``; ValueError if it is not a little-endian GGUF v2/v3 file."""
    path = Path(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return _Parser(mm, path).parse()


class _Parser:
    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path, self.pos = buf, path, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if count > ARRAY_KEEP:
                if etype == _STRING:
                    self.skip_strings(count)
                elif etype in _SCALAR:
                    self.pos += count * struct.calcsize(_SCALAR[etype])
                else:
                    raise ValueError(f"{self.path}: GGUF array of type {etype} is not supported")
                return ArrayLength(count)
            return [self.value(etype) for _ in range(count)]
        if vtype not in _SCALAR:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")
        return self.unpack(_SCALAR[vtype])

    def parse(self) -> GGUFMetadata:
        if self.buf[:4] != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic)")
        self.pos = 4
        version = self.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} (a big-endian file?) is not supported; expected 2 or 3")
        n_tensors, n_fields = self.unpack("<Q"), self.unpack("<Q")
        fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self.string()
            fields[key] = self.value(self.unpack("<I"))
        entries = []
        for _ in range(n_tensors):
            name = self.string()
            shape = tuple(self.unpack("<Q") for _ in range(self.unpack("<I")))
            entries.append((name, shape, self.unpack("<I"), self.unpack("<Q")))
        alignment = int(fields.get("general.alignment", 32))
        data_start = -(-self.pos // alignment) * alignment
        tensors = {name: TensorInfo(shape, ggml_type, data_start + offset) for name, shape, ggml_type, offset in entries}
        return GGUFMetadata(self.path, fields, tensors)


__all__ = ["ArrayLength", "GGUFMetadata", "TensorInfo", "read_gguf_metadata"]

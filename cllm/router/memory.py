"""What a loaded model takes, measured: the host memory the process (or the engine's own core process) holds
because of it, and on CUDA the device memory torch reserved for it."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_MIB = 1 << 20


def rss_bytes(pid: int | None = None) -> int | None:
    """Resident memory of a process (this one by default), None where /proc is not readable."""
    try:
        with open(f"/proc/{pid or 'self'}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def host_available_bytes() -> int | None:
    """The host's MemAvailable (what can be allocated without swapping), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cuda() -> Any | None:
    """torch's CUDA module where this process already uses CUDA (never imported or initialised here: a
    llama.cpp-only server has no torch, and a CUDA context costs device memory)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda


def cuda_reserved_bytes() -> int:
    """Device memory torch holds in this process (0 when torch or CUDA is not in use)."""
    cuda = _cuda()
    return 0 if cuda is None else sum(cuda.memory_reserved(d) for d in range(cuda.device_count()))


def cuda_total_bytes() -> int:
    """The memory of the device(s) this process uses (0 when it uses none)."""
    cuda = _cuda()
    return 0 if cuda is None else sum(cuda.mem_get_info(d)[1] for d in range(cuda.device_count()))


@dataclass(slots=True, frozen=True)
class Footprint:
    """What a loaded model holds."""

    host: int  # bytes of host memory
    device: int  # bytes of device memory (0 on a CPU)
    device_total: int  # the device's size, where it has one (0 on a CPU)


@dataclass(slots=True, frozen=True)
class MemoryMark:
    """This process's memory before a load."""

    rss: int | None
    cuda: int

    @classmethod
    def now(cls) -> MemoryMark:
        return cls(rss_bytes(), cuda_reserved_bytes())

    def taken_by(self, engine: Any) -> Footprint:
        """What ``engine``, loaded since this mark, holds: an engine core in its own process, that process's
        resident memory and the device memory it reported; else what this process gained."""
        pid = getattr(engine, "core_pid", None)
        if pid is not None:
            return Footprint(rss_bytes(pid) or 0, getattr(engine, "device_memory_bytes", 0),
                             getattr(engine, "device_total_bytes", 0))
        host = (rss_bytes() or 0) - (self.rss or 0) if self.rss is not None else 0
        return Footprint(max(0, host), max(0, cuda_reserved_bytes() - self.cuda), cuda_total_bytes())


def files_bytes(path: str | None) -> int:
    """The size of a model's files (a first guess at what it takes before it was ever loaded)."""
    if path is None:
        return 0
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    if p.is_dir():
        return sum(f.stat().st_size for f in p.iterdir() if f.is_file() and f.suffix in (".safetensors", ".bin", ".gguf"))
    return 0


def mib(n: int | None) -> float | None:
    return None if n is None else round(n / _MIB, 1)

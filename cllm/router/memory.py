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


def cuda_reserved_bytes() -> int:
    """Device memory torch holds in this process (0 when torch or CUDA is not in use)."""
    torch = sys.modules.get("torch")  # never imported here for a llama.cpp-only server
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    return sum(torch.cuda.memory_reserved(d) for d in range(torch.cuda.device_count()))


@dataclass(slots=True, frozen=True)
class MemoryMark:
    """This process's memory before a load."""

    rss: int | None
    cuda: int

    @classmethod
    def now(cls) -> MemoryMark:
        return cls(rss_bytes(), cuda_reserved_bytes())

    def taken_by(self, engine: Any) -> int:
        """The bytes ``engine`` holds, loaded since this mark: an engine core in its own process, that
        process's resident memory plus the device memory it reported; else what this process gained (host
        + device)."""
        pid = getattr(engine, "core_pid", None)
        if pid is not None:
            return (rss_bytes(pid) or 0) + getattr(engine, "device_memory_bytes", 0)
        host = (rss_bytes() or 0) - (self.rss or 0) if self.rss is not None else 0
        return max(0, host) + max(0, cuda_reserved_bytes() - self.cuda)


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

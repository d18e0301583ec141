"""Named backend registry: built-ins plus third-party entry points (group ``cllm.backends``).

A registered backend is a class (or factory) called as ``factory(config)`` with
a :class:`cllm.config.CllmConfig`, returning a :class:`cllm.backends.base.Backend`.
Built-ins are imported lazily so a llama.cpp user never imports torch.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cllm.backends.base import Backend
    from cllm.config import CllmConfig

ENTRY_POINT_GROUP = "cllm.backends"

BUILTIN_BACKENDS: dict[str, str] = {
    "llama_cpp": "cllm.backends.llama_cpp.backend:LlamaCppBackend",
    "torch": "cllm.backends.torch.backend:TorchBackend",
}


@dataclass(slots=True, frozen=True)
class BackendInfo:
    """One row of `cllm backends`."""

    name: str  # registry name
    target: str  # "module:attr" it loads from
    loadable: bool  # whether it imports here
    detail: str  # why not, or where from


def _all_targets() -> dict[str, str]:
    targets = dict(BUILTIN_BACKENDS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        targets.setdefault(ep.name, ep.value)
    return targets


def _import(target: str) -> Callable[[CllmConfig], Backend]:
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def backend_names() -> list[str]:
    return sorted(_all_targets())


def get_backend_factory(name: str) -> Callable[[CllmConfig], Backend]:
    """The factory registered under ``name``; KeyError lists the valid names."""
    targets = _all_targets()
    if name not in targets:
        raise KeyError(f"unknown backend {name!r}; registered backends: {', '.join(sorted(targets))}")
    return _import(targets[name])


def create_backend(config: CllmConfig) -> Backend:
    return get_backend_factory(config.model.backend)(config)


def describe_backends() -> list[BackendInfo]:
    rows = []
    for name, target in sorted(_all_targets().items()):
        try:
            _import(target)
            rows.append(BackendInfo(name, target, True, "ok"))
        except Exception as err:  # an uninstalled optional dependency is an answer, not a crash
            rows.append(BackendInfo(name, target, False, f"{type(err).__name__}: {err}"))
    return rows

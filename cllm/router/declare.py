"""Which models a server serves: `--model NAME=PATH[@backend]` flags, the config's `models:` list and
`--models-dir`, each turned into a ModelSpec (a name, its aliases and the model's own full config).

Nothing is loaded here; paths are checked, names made unique, settings validated, so a bad declaration is
an error at start-up naming the value, not a failure on some later request.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from cllm.config import KEEP_FOREVER, CllmConfig, ModelEntry

# A split GGUF's parts: NAME-00001-of-00003.gguf (llama.cpp loads the others from the first).
_SPLIT_PART = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})$")
_PROJECTOR = re.compile(r"(^|[-_.])mmproj([-_.]|$)", re.IGNORECASE)


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """One declared model."""

    name: str  # the name responses carry
    aliases: tuple[str, ...]  # every name requests may use, name first
    config: CllmConfig  # the model's own settings (its file, backend, context, slots, ...)
    keep_alive_s: float  # seconds it stays loaded after its last request; KEEP_FOREVER = never unloaded
    preload: bool  # loaded when the server starts

    @property
    def backend(self) -> str:
        return self.config.model.backend

    @property
    def path(self) -> str | None:
        return self.config.model.model


def parse_model_flag(value: str, backends: list[str]) -> ModelEntry:
    """``NAME=PATH`` or ``NAME=PATH@BACKEND`` (a trailing ``@name`` counts only when it is a backend name,
    so a path may hold '@'); ValueError naming the flag otherwise."""
    name, sep, rest = value.partition("=")
    if not sep or not name.strip() or not rest.strip():
        raise ValueError(f"--model {value!r}: expected NAME=PATH or NAME=PATH@BACKEND (one model: --model PATH)")
    path, at, backend = rest.rpartition("@")
    if not at or backend not in backends:
        path, backend = rest, ""
    return ModelEntry(name=name.strip(), model=path, backend=backend or None)


def scan_models_dir(folder: str | Path) -> list[ModelEntry]:
    """Every model in ``folder``: GGUF files by stem (a split GGUF once, by its first part; projector files
    skipped: they belong to the model beside them) and Hugging Face directories (holding config.json) by
    folder name, sorted by name."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ValueError(f"models_dir={str(folder)!r} is not a folder")
    entries: list[ModelEntry] = []
    for path in sorted(root.iterdir()):
        if path.name.startswith("."):
            continue
        if path.is_dir() and (path / "config.json").is_file():
            entries.append(ModelEntry(name=path.name, model=str(path), backend="torch"))
        elif path.is_file() and path.suffix == ".gguf" and not _PROJECTOR.search(path.stem):
            split = _SPLIT_PART.match(path.stem)
            if split is not None and int(split["part"]) != 1:
                continue
            name = split["stem"] if split is not None else path.stem
            entries.append(ModelEntry(name=name, model=str(path), backend="llama_cpp"))
    return entries


def _backend_of(entry: ModelEntry) -> str:
    """The entry's backend, or the one its file calls for: a GGUF on llama.cpp, a directory on torch."""
    if entry.backend:
        return entry.backend
    return "llama_cpp" if Path(entry.model).suffix == ".gguf" else "torch"


def _spec_of(entry: ModelEntry, base: CllmConfig) -> ModelSpec:
    path = Path(entry.model).expanduser()
    if not path.exists():
        raise ValueError(f"model {entry.name!r}: {str(path)!r} does not exist (give a GGUF file or a Hugging Face "
                         "model directory)")
    try:
        config = base.with_overrides(model=str(path), backend=_backend_of(entry), **entry.settings())
    except ValueError as err:
        raise ValueError(f"model {entry.name!r}: {err}") from None
    keep = entry.keep_alive if entry.keep_alive is not None else base.router.keep_alive
    names = (entry.name, *[a for a in entry.aliases if a != entry.name])
    return ModelSpec(name=entry.name, aliases=names, config=config, keep_alive_s=keep, preload=entry.preload)


def _single_spec(config: CllmConfig) -> ModelSpec:
    """The one model of a server that declares none: the model section's, loaded at start, never unloaded."""
    names = tuple(config.server.served_model_name or ()) or (default_name(config.model.model),)
    return ModelSpec(name=names[0], aliases=names, config=config, keep_alive_s=KEEP_FOREVER, preload=True)


def default_name(model: str | None) -> str:
    """A model's name when none is given: the GGUF's file stem, or the directory's name (the embedded model:
    its file's stem)."""
    if model is None:
        from cllm.model_path import DEFAULT_MODEL_FILE

        return Path(DEFAULT_MODEL_FILE).stem
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def declared_models(config: CllmConfig, flags: list[ModelEntry] | None = None) -> list[ModelSpec]:
    """The models ``config`` (its ``models:`` list and ``router.models_dir``) and ``flags`` declare, in that
    order, else the config's one model. ValueError on a missing file, a repeated name or a bad setting."""
    entries = [*config.models, *(flags or [])]
    if config.router.models_dir:
        entries += scan_models_dir(config.router.models_dir)
    if not entries:
        return [_single_spec(config)]
    if config.server.served_model_name:
        raise ValueError("served_model_name names the one model of a single-model server; with declared models "
                         "give each its name (and aliases) in its entry")
    if config.cluster.pd is not None:
        raise ValueError("several declared models with a prefill/decode split (--pd) are not supported yet; "
                         "use --replicas N (each model gets N replicas) or serve one model per application")
    specs = [_spec_of(entry, config) for entry in entries]
    seen: dict[str, str] = {}
    for spec in specs:
        for alias in spec.aliases:
            if alias in seen:
                raise ValueError(f"model name {alias!r} is declared twice (models {seen[alias]!r} and {spec.name!r})")
            seen[alias] = spec.name
    return specs

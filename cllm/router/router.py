"""Router: many models behind one API, each loaded on its first use and unloaded when idle.

Every declared model (declare.py) has a slot; a loaded one holds its own engine (scheduler, backend, KV;
with server.engine_process its own core process), so a model that fails to load or dies fails only its
own requests. A caller takes a lease (``acquire``) for as long as it uses a model — the HTTP server holds
one per request, until its response is sent — and:

- an unloaded model is loaded then (one load at a time, so what a load takes can be measured: memory.py),
  the caller waiting up to ``model_load_timeout_s``;
- a loaded model is never unloaded while leased; after its last lease ends it stays ``keep_alive``
  seconds (the last request's, else the model's: Ollama's semantics; 0 = at once, -1 = never);
- loading one more than ``max_loaded_models``, or more memory than ``memory_budget_mib`` (each model's size
  as measured at its last load, else its files' size), first unloads the least recently used models with
  no lease; when only leased ones are left, the caller gets ModelUnavailable (503, Retry-After) — never
  a load that would not fit;
- llama.cpp engines in this process that are busy at the same time divide the CPU's threads between them
  (ggml's threads spin-wait: two engines each on every core are both slow).
"""
from __future__ import annotations

import asyncio
import contextlib
import enum
import gc
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cllm.config import KEEP_FOREVER, CllmConfig, ModelEntry, load_config
from cllm.router.declare import ModelSpec, declared_models
from cllm.router.memory import MemoryMark, files_bytes, host_available_bytes, mib

log = logging.getLogger("cllm.router")

_BUDGET_SHARE = 0.85  # memory_budget_mib: null = this share of the host memory available at start
_CAPACITY_RETRY_S = 5  # Retry-After when every loaded model is busy
_LOADING_RETRY_S = 5  # Retry-After when a load outlasts model_load_timeout_s
_DEVICE_SHARE = 0.97  # the models on a device may take this share of it together (the rest: CUDA contexts)


class ModelStatus(str, enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"
    FAILED = "failed"  # the last load failed (retried after load_retry_s)


class ModelNotFound(LookupError):
    """A request named no declared model."""

    def __init__(self, requested: str, served: list[str]) -> None:
        super().__init__(f"the model {requested!r} does not exist; this server serves "
                         + ", ".join(repr(n) for n in served))
        self.requested = requested
        self.served = served


class ModelUnavailable(RuntimeError):
    """The model cannot take the request now (loading, no room, failed to load, shutting down)."""

    def __init__(self, message: str, *, code: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


@dataclass(slots=True, eq=False)
class _Slot:
    """One declared model and, while loaded, its engine."""

    spec: ModelSpec
    status: ModelStatus = ModelStatus.UNLOADED
    engine: Any = None  # the started engine while LOADED
    served: Any = None  # what ``wrap`` made of it (the server's LoadedModel; the engine itself otherwise)
    leases: int = 0  # callers using it now (it is busy while > 0)
    last_used: float = 0.0  # time.monotonic() of the latest acquire or release
    keep_alive_s: float = 0.0  # how long it stays after its last lease (the last request's choice)
    memory_bytes: int | None = None  # host memory, measured at its last load
    device_bytes: int = 0  # device memory, measured at its last load (0: none, or never loaded)
    load_seconds: float | None = None  # how long its last load took
    failure: str | None = None  # why its last load failed
    failed_at: float = 0.0
    load_task: asyncio.Task[None] | None = None
    expiry: asyncio.TimerHandle | None = None  # the keep_alive timer while idle
    thread_share: int | None = None  # the CPU threads it may use now (None: its own count)

    @property
    def busy(self) -> bool:
        return self.leases > 0


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """What /v1/models and /v1/engine say of a declared model."""

    name: str
    aliases: tuple[str, ...]
    backend: str
    path: str | None
    status: str
    busy: int  # leases in flight
    keep_alive_s: float  # -1: never unloaded
    memory_mib: float | None  # host memory, measured at its last load
    device_mib: float | None  # device memory, measured at its last load
    load_seconds: float | None
    failure: str | None
    max_model_len: int | None  # while loaded
    thread_share: int | None


class ModelLease:
    """A model in use: its engine cannot be unloaded until ``release()`` (idempotent; also a context manager)."""

    def __init__(self, router: Router, slot: _Slot, keep_alive_s: float) -> None:
        self._router = router
        self._slot = slot
        self.spec = slot.spec
        self.engine = slot.engine
        self.served = slot.served
        self.keep_alive_s = keep_alive_s
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._router._release(self._slot, self.keep_alive_s)

    def __enter__(self) -> ModelLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _start_engine(spec: ModelSpec) -> Any:
    """The default engine of a model: an AsyncLLM on a thread of this process."""
    from cllm.engine.async_llm import AsyncLLM  # imported here: it pulls in the backends

    return AsyncLLM(config=spec.config)


def _entries(models: Any) -> list[ModelEntry]:
    """``{"name": "path", ...}``, ``{"name": {settings}}`` or a list of entries / dicts."""
    if isinstance(models, dict):
        return [ModelEntry(name=name, **(v if isinstance(v, dict) else {"model": str(v)})) for name, v in models.items()]
    return [m if isinstance(m, ModelEntry) else ModelEntry(**m) for m in models]


class Router:
    """Many models behind one API (see the module docstring).

    Python: ``Router({"chat": "a.gguf", "coder": {"model": "dir", "dtype": "bfloat16"}}, keep_alive=60)``,
    then ``generate``/``chat``/``embed`` with the model's name (or ``acquire`` for the engine itself);
    ``await router.shutdown()`` at the end. Settings are the config's (``max_loaded_models=2``, ...).
    """

    def __init__(self, models: Any = (), *, config: CllmConfig | None = None,
                 specs: Sequence[ModelSpec] | None = None,
                 construct: Callable[[ModelSpec], Any] = _start_engine,
                 wrap: Callable[[ModelSpec, Any], Any] | None = None, revive_dead: bool = True,
                 **settings: Any) -> None:
        base = config if config is not None else load_config(None, **settings)
        if config is not None and settings:
            base = config.with_overrides(**settings)
        self.config = base
        self._specs = list(specs) if specs is not None else declared_models(base, _entries(models))
        self._slots = [_Slot(spec, keep_alive_s=spec.keep_alive_s) for spec in self._specs]
        self._by_name = {alias: slot for slot in self._slots for alias in slot.spec.aliases}
        self._construct = construct
        self._wrap = wrap or (lambda spec, engine: engine)
        self._revive_dead = revive_dead  # a dead engine is loaded again on the next request (else it answers 503)
        self._lock = asyncio.Lock()  # one load or unload at a time (what a load takes is measured)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        available = host_available_bytes()
        budget = base.router.memory_budget_mib
        self.memory_budget = budget << 20 if budget is not None else (
            int(available * _BUDGET_SHARE) if available is not None else None)
        self.device_total = 0  # the GPU's memory, once a loaded model reported one

    # ------------------------------------------------------------------ names
    @property
    def default(self) -> ModelSpec:
        """The model a request that names none gets: the first declared."""
        return self._specs[0]

    @property
    def specs(self) -> list[ModelSpec]:
        return list(self._specs)

    def names(self) -> list[str]:
        return list(self._by_name)

    def spec_for(self, name: str | None) -> ModelSpec:
        """The declared model called ``name`` (None: the default); ModelNotFound otherwise."""
        return self._slot_for(name).spec

    def _slot_for(self, name: str | None) -> _Slot:
        if name is None or name == "":
            return self._slots[0]
        slot = self._by_name.get(name)
        if slot is None:
            raise ModelNotFound(name, self.names())
        return slot

    def models(self) -> list[ModelInfo]:
        return [self._info(slot) for slot in self._slots]

    def _info(self, slot: _Slot) -> ModelInfo:
        return ModelInfo(
            name=slot.spec.name, aliases=slot.spec.aliases, backend=slot.spec.backend, path=slot.spec.path,
            status=slot.status.value, busy=slot.leases, keep_alive_s=slot.keep_alive_s,
            memory_mib=mib(slot.memory_bytes), device_mib=mib(slot.device_bytes), load_seconds=slot.load_seconds,
            failure=slot.failure,
            max_model_len=slot.engine.max_model_len if slot.engine is not None else None,
            thread_share=slot.thread_share,
        )

    def loaded(self) -> list[tuple[ModelSpec, Any]]:
        """(spec, engine) of every loaded model."""
        return [(s.spec, s.engine) for s in self._slots if s.status is ModelStatus.LOADED]

    def engine_of(self, name: str | None) -> Any | None:
        """The model's engine if it is loaded now (nothing is loaded by asking)."""
        slot = self._slot_for(name)
        return slot.engine if slot.status is ModelStatus.LOADED else None

    def served_of(self, name: str | None) -> Any | None:
        slot = self._slot_for(name)
        return slot.served if slot.status is ModelStatus.LOADED else None

    # ------------------------------------------------------------------ use
    async def acquire(self, name: str | None = None, *, keep_alive_s: float | None = None,
                      timeout_s: float | None = None) -> ModelLease:
        """A lease on the model called ``name`` (None: the default), loading it first if need be, waiting at
        most ``timeout_s`` (model_load_timeout_s). ModelNotFound / ModelUnavailable otherwise."""
        slot = self._slot_for(name)
        if self._closing:
            raise ModelUnavailable("the server is shutting down", code="shutting_down")
        slot.leases += 1  # pinned while it loads too: nothing evicts it under a waiting request
        self._cancel_expiry(slot)
        try:
            await self._ready(slot, timeout_s if timeout_s is not None else self.config.router.model_load_timeout_s)
        except BaseException:
            self._release(slot, slot.keep_alive_s)
            raise
        slot.last_used = time.monotonic()
        self._share_cpu()
        return ModelLease(self, slot, slot.spec.keep_alive_s if keep_alive_s is None else keep_alive_s)

    async def _ready(self, slot: _Slot, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for _ in range(3):  # a dead engine is unloaded and loaded once more; then its failure is the answer
            if slot.status is ModelStatus.LOADED:
                if self._alive(slot.engine) or not self._revive_dead:
                    return
                log.error("model %r: its engine died (%s); loading it again", slot.spec.name,
                          getattr(slot.engine, "failure", None) or "no reason given")
                async with self._lock:
                    await self._unload_now(slot, reason="its engine died")
                continue
            if slot.status is ModelStatus.FAILED:
                wait = slot.failed_at + self.config.router.load_retry_s - time.monotonic()
                if wait > 0:
                    raise self._failed(slot, wait)
            if slot.load_task is None:
                slot.status = ModelStatus.LOADING
                slot.load_task = self._spawn(self._load(slot), f"load {slot.spec.name}")
            try:
                left = None if math.isinf(timeout_s) else max(0.0, deadline - time.monotonic())
                await asyncio.wait_for(asyncio.shield(slot.load_task), left)
            except TimeoutError:
                raise ModelUnavailable(f"the model {slot.spec.name!r} is still loading; retry shortly",
                                       code="model_loading", retry_after_s=_LOADING_RETRY_S) from None
            if slot.status is ModelStatus.FAILED:
                raise self._failed(slot, self.config.router.load_retry_s)
        raise self._failed(slot, self.config.router.load_retry_s)

    @staticmethod
    def _alive(engine: Any) -> bool:
        return bool(engine.is_running or getattr(engine, "restarting", False))

    def _failed(self, slot: _Slot, retry_after_s: float) -> ModelUnavailable:
        return ModelUnavailable(f"the model {slot.spec.name!r} failed to load: {slot.failure}",
                                code="model_load_failed", retry_after_s=max(1.0, retry_after_s))

    def _release(self, slot: _Slot, keep_alive_s: float) -> None:
        slot.leases -= 1
        slot.last_used = time.monotonic()
        slot.keep_alive_s = keep_alive_s  # Ollama: the last request's keep_alive decides
        if slot.leases == 0 and slot.status is ModelStatus.LOADED:
            self._schedule_expiry(slot)
        self._share_cpu()

    # ------------------------------------------------------------------ load / unload
    async def load(self, name: str | None = None) -> ModelInfo:
        """Load a model now (POST /v1/models/{name}/load); it then idles out by its keep_alive."""
        lease = await self.acquire(name)
        lease.release()
        return self._info(self._slot_for(name))

    async def unload(self, name: str | None = None, *, force: bool = False) -> ModelInfo:
        """Unload a model now (POST /v1/models/{name}/unload). A busy model is refused (ModelUnavailable
        'model_busy') unless ``force``, which aborts its requests."""
        slot = self._slot_for(name)
        if slot.busy and not force:
            raise ModelUnavailable(f"the model {slot.spec.name!r} is serving {slot.leases} request(s); "
                                   "unload it when idle, or with force", code="model_busy", retry_after_s=1)
        if slot.load_task is not None:
            with contextlib.suppress(ModelUnavailable):
                await asyncio.shield(slot.load_task)
        async with self._lock:
            await self._unload_now(slot, reason="asked to")
        return self._info(slot)

    async def start(self) -> dict[str, ModelUnavailable]:
        """Load the models marked preload (the one model of a single-model server), one after another;
        returns the failures by model name."""
        failures: dict[str, ModelUnavailable] = {}
        for slot in self._slots:
            if slot.spec.preload:
                try:
                    lease = await self.acquire(slot.spec.name, timeout_s=float("inf"))
                except ModelUnavailable as err:
                    failures[slot.spec.name] = err
                    continue
                lease.release()
        return failures

    def failure_of(self, name: str | None) -> str | None:
        """Why the model's last load failed (None if it did not)."""
        return self._slot_for(name).failure

    async def _load(self, slot: _Slot) -> None:
        """Make room, build and start the engine, measure it (errors kept on the slot, never raised but
        ModelUnavailable for a model that does not fit now)."""
        try:
            async with self._lock:
                await self._make_room(slot)
                mark = MemoryMark.now()
                started = time.monotonic()
                engine = await asyncio.to_thread(self._construct, slot.spec)
                engine.start()
                footprint = mark.taken_by(engine)
                slot.memory_bytes, slot.device_bytes = footprint.host, footprint.device
                self.device_total = footprint.device_total or self.device_total
                slot.load_seconds = round(time.monotonic() - started, 2)
                slot.served = self._wrap(slot.spec, engine)
                slot.engine, slot.status, slot.failure = engine, ModelStatus.LOADED, None
                log.info("model %r loaded in %.1f s (%s MiB, %s MiB on the device)", slot.spec.name,
                         slot.load_seconds, mib(slot.memory_bytes), mib(slot.device_bytes))
        except ModelUnavailable:
            slot.status = ModelStatus.UNLOADED
            raise
        except Exception as exc:
            foreseen = isinstance(exc, (ValueError, FileNotFoundError, KeyError))
            log.error("model %r failed to load: %s", slot.spec.name, exc, exc_info=None if foreseen else exc)
            slot.status, slot.failure, slot.failed_at = ModelStatus.FAILED, f"{type(exc).__name__}: {exc}", time.monotonic()
        finally:
            slot.load_task = None
        if self._closing and slot.status is ModelStatus.LOADED:  # shutdown began while it loaded
            async with self._lock:
                await self._unload_now(slot, reason="shutting down")
        elif slot.status is ModelStatus.LOADED and not slot.busy:  # its requests left while it loaded
            self._schedule_expiry(slot)

    async def _make_room(self, slot: _Slot) -> None:
        """Unload idle models, least recently used first, until ``slot`` fits (count, host memory, device
        memory); with only busy ones left, ModelUnavailable."""
        limit = self.config.router.max_loaded_models
        need = slot.memory_bytes if slot.memory_bytes is not None else files_bytes(slot.spec.path)
        need_device = self._device_need(slot)
        while True:
            others = [s for s in self._slots if s.status is ModelStatus.LOADED and s is not slot]
            used = sum(s.memory_bytes or 0 for s in others)
            used_device = sum(s.device_bytes for s in others)
            too_many = len(others) >= limit
            too_big = self.memory_budget is not None and bool(others) and used + need > self.memory_budget
            too_big_device = need_device > 0 and used_device + need_device > self.device_total * _DEVICE_SHARE
            if not (too_many or too_big or too_big_device):
                return
            # a device shortage alone is helped only by unloading models on the device
            idle = [s for s in others if not s.busy and (too_many or too_big or s.device_bytes > 0)]
            if not idle:
                why = (f"{len(others)} models are loaded (max_loaded_models={limit})" if too_many else
                       f"it needs ~{mib(need)} MiB beside the {mib(used)} MiB loaded (memory budget "
                       f"{mib(self.memory_budget)} MiB)" if too_big else
                       f"it needs ~{mib(need_device)} MiB of the device beside the {mib(used_device)} MiB loaded "
                       f"there (of {mib(self.device_total)} MiB)")
                raise ModelUnavailable(f"cannot load the model {slot.spec.name!r} now: {why} and every one of them "
                                       "is serving requests; retry shortly", code="model_capacity",
                                       retry_after_s=_CAPACITY_RETRY_S)
            victim = min(idle, key=lambda s: s.last_used)
            await self._unload_now(victim, reason=f"to make room for {slot.spec.name!r}")

    def _device_need(self, slot: _Slot) -> int:
        """The device memory ``slot`` will take: measured at its last load; before that, for a torch model
        not pinned to the CPU while a device is in use, its gpu_memory_utilization share of the device (what
        its KV pool grows to); else none."""
        if slot.device_bytes:
            return slot.device_bytes
        config = slot.spec.config
        if self.device_total and config.model.backend == "torch" and config.torch.device != "cpu":
            return int(config.torch.gpu_memory_utilization * self.device_total)
        return 0

    async def _unload_now(self, slot: _Slot, *, reason: str) -> None:
        """Shut the slot's engine down (its requests, if any, aborted) and free it. Call under the lock."""
        if slot.status is not ModelStatus.LOADED:
            return
        self._cancel_expiry(slot)
        slot.status = ModelStatus.UNLOADING
        engine, slot.engine, slot.served = slot.engine, None, None
        log.info("unloading model %r (%s)", slot.spec.name, reason)
        try:
            await engine.shutdown(0)
        except Exception as exc:
            log.error("model %r: engine shutdown failed: %s", slot.spec.name, exc, exc_info=exc)
        finally:
            del engine
            gc.collect()  # the weights and KV go now, not at some later collection
            slot.status = ModelStatus.UNLOADED
            slot.thread_share = None

    # ------------------------------------------------------------------ keep_alive
    def _schedule_expiry(self, slot: _Slot) -> None:
        self._cancel_expiry(slot)
        keep = slot.keep_alive_s
        if keep == KEEP_FOREVER or self._closing:
            return
        loop = asyncio.get_running_loop()
        slot.expiry = loop.call_later(keep, self._expire, slot)

    def _cancel_expiry(self, slot: _Slot) -> None:
        if slot.expiry is not None:
            slot.expiry.cancel()
            slot.expiry = None

    def _expire(self, slot: _Slot) -> None:
        slot.expiry = None
        if not slot.busy and slot.status is ModelStatus.LOADED:
            self._spawn(self._unload_if_idle(slot), f"unload {slot.spec.name}")

    async def _unload_if_idle(self, slot: _Slot) -> None:
        async with self._lock:
            if not slot.busy and slot.expiry is None:  # no request came while the lock was waited for
                await self._unload_now(slot, reason=f"idle for keep_alive={slot.keep_alive_s:g} s")

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and not isinstance(task.exception(), ModelUnavailable):
            log.error("router task %s failed: %s", task.get_name(), task.exception(), exc_info=task.exception())

    # ------------------------------------------------------------------ CPU sharing
    def _share_cpu(self) -> None:
        """Busy in-process llama.cpp engines on the CPU divide its threads; alone (or idle) each uses its own
        count again."""
        if not self.config.router.share_cpu_threads:
            return
        shareable = [s for s in self._slots if s.status is ModelStatus.LOADED and _thread_cap_of(s.engine) is not None]
        busy = [s for s in shareable if s.busy]
        for slot in shareable:
            share = None
            if len(busy) > 1 and slot.busy:
                top = _thread_cap_of(slot.engine)
                share = max(1, top // len(busy))
            if share != slot.thread_share:
                slot.thread_share = share
                slot.engine.engine.backend.share_cpu(share)

    # ------------------------------------------------------------------ Python API
    async def generate(self, model: str | None, prompt: Any, params: Any = None, **kwargs: Any) -> AsyncIterator[Any]:
        """``AsyncLLM.generate`` on the named model (loaded on demand)."""
        with await self.acquire(model) as lease:
            async for out in lease.engine.generate(prompt, params, **kwargs):
                yield out

    async def chat(self, model: str | None, messages: Sequence[dict], params: Any = None, **kwargs: Any) -> AsyncIterator[Any]:
        """``AsyncLLM.chat`` on the named model (loaded on demand)."""
        with await self.acquire(model) as lease:
            async for out in lease.engine.chat(messages, params, **kwargs):
                yield out

    async def embed(self, model: str | None, inputs: Any) -> Any:
        with await self.acquire(model) as lease:
            return await lease.engine.embed(inputs)

    async def shutdown(self, grace_s: float = 0.0) -> None:
        """Stop taking leases; let busy models finish for up to ``grace_s``; unload everything."""
        self._closing = True
        for slot in self._slots:
            self._cancel_expiry(slot)
        loads = [s.load_task for s in self._slots if s.load_task is not None]
        if loads:
            await asyncio.gather(*loads, return_exceptions=True)
        loaded = [s for s in self._slots if s.status is ModelStatus.LOADED]

        async def drain(slot: _Slot) -> None:
            engine, slot.status = slot.engine, ModelStatus.UNLOADING
            try:
                await engine.shutdown(grace_s)
            finally:
                slot.engine, slot.served, slot.status = None, None, ModelStatus.UNLOADED

        results = await asyncio.gather(*(drain(s) for s in loaded), return_exceptions=True)
        for slot, result in zip(loaded, results):
            if isinstance(result, BaseException):
                log.error("model %r: engine shutdown failed: %s", slot.spec.name, result, exc_info=result)
        gc.collect()


def _thread_cap_of(engine: Any) -> int | None:
    """The thread count of an in-process llama.cpp engine on the CPU that can share it, else None."""
    backend = getattr(getattr(engine, "engine", None), "backend", None)
    if backend is None or not hasattr(backend, "share_cpu"):
        return None
    return backend.cpu_threads

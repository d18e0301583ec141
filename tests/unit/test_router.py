"""The multi-model router on fake backends (fast): declarations, on-demand loads, keep_alive, LRU eviction
that never takes a busy model, load failures that stay with their model, CPU sharing, and the server's
routes over it. The same behaviour on the real embedded model (llama.cpp and torch side by side) is
tests/integration/test_multi_model_server.py."""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

import cllm
from cllm.config import KEEP_FOREVER, ModelEntry, parse_keep_alive
from cllm.router import ModelNotFound, ModelUnavailable, Router, declared_models, parse_model_flag, scan_models_dir
from cllm.router.declare import ModelSpec
from cllm.sampling.params import SamplingParams
from cllm.server.app import create_app
from tests.unit.fakes import FakeBackend, fake_config

BACKENDS = ["llama_cpp", "torch"]


# ---------------------------------------------------------------- declarations
@pytest.mark.parametrize("value, expected", [
    (30, 30.0), ("30", 30.0), ("30s", 30.0), ("5m", 300.0), ("1h30m", 5400.0), ("250ms", 0.25), (0, 0.0),
    (-1, KEEP_FOREVER), ("-1", KEEP_FOREVER), ("-5m", KEEP_FOREVER),
])
def test_keep_alive_takes_ollamas_forms(value, expected):
    assert parse_keep_alive(value) == expected


@pytest.mark.parametrize("value", ["", "soon", "5 minutes", "5m3", True, None, [1], float("nan")])
def test_a_bad_keep_alive_is_a_value_error_naming_it(value):
    with pytest.raises(ValueError, match="keep_alive"):
        parse_keep_alive(value)


def test_model_flag_forms():
    assert parse_model_flag("chat=/m/a.gguf", BACKENDS) == ModelEntry(name="chat", model="/m/a.gguf")
    assert parse_model_flag("c=/m/dir@torch", BACKENDS) == ModelEntry(name="c", model="/m/dir", backend="torch")
    # an '@' that does not name a backend is part of the path
    assert parse_model_flag("c=/m/v@2/a.gguf", BACKENDS).model == "/m/v@2/a.gguf"
    for bad in ("=/m/a.gguf", "chat=", "/m/a.gguf"):
        with pytest.raises(ValueError, match="NAME=PATH"):
            parse_model_flag(bad, BACKENDS)


def test_models_dir_names_each_model_once(tmp_path: Path):
    (tmp_path / "small.gguf").write_bytes(b"x")
    (tmp_path / "big-00001-of-00002.gguf").write_bytes(b"x")
    (tmp_path / "big-00002-of-00002.gguf").write_bytes(b"x")
    (tmp_path / "mmproj-small-f16.gguf").write_bytes(b"x")  # a projector belongs to a model, it is not one
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    found = {(e.name, Path(e.model).name, e.backend) for e in scan_models_dir(tmp_path)}
    assert found == {("small", "small.gguf", "llama_cpp"), ("big", "big-00001-of-00002.gguf", "llama_cpp"),
                     ("hf", "hf", "torch")}


def test_declarations_are_checked_at_start(tmp_path: Path):
    a = tmp_path / "a.gguf"
    a.write_bytes(b"x")
    config = fake_config()
    specs = declared_models(config, [ModelEntry(name="a", model=str(a), n_ctx=1024, aliases=["first"]),
                                     ModelEntry(name="b", model=str(a), keep_alive="1m", speculative="off")])
    assert [(s.name, s.aliases, s.backend, s.keep_alive_s) for s in specs] == [
        ("a", ("a", "first"), "llama_cpp", config.router.keep_alive), ("b", ("b",), "llama_cpp", 60.0)]
    assert specs[0].config.model.n_ctx == 1024 and specs[1].config.speculative.speculative == "off"
    with pytest.raises(ValueError, match="'a' is declared twice"):
        declared_models(config, [ModelEntry(name="a", model=str(a)), ModelEntry(name="b", model=str(a), aliases=["a"])])
    with pytest.raises(ValueError, match="does not exist"):
        declared_models(config, [ModelEntry(name="a", model=str(tmp_path / "missing.gguf"))])
    with pytest.raises(ValueError, match="n_ctx"):
        declared_models(config, [ModelEntry(name="a", model=str(a), n_ctx=1)])
    with pytest.raises(ValueError, match="server setting"):
        ModelEntry(name="a", model=str(a), port=9000)
    with pytest.raises(ValueError, match="unknown setting 'n_cxt'"):
        ModelEntry(name="a", model=str(a), n_cxt=1024)
    # none declared: the config's one model, loaded at start and never unloaded
    (single,) = declared_models(config)
    assert single.name == "SmolLM2-135M-Instruct.Q4_1" and single.keep_alive_s == KEEP_FOREVER and single.preload


# ---------------------------------------------------------------- the router over fake engines
def _specs(*names: str, keep_alive_s: float = KEEP_FOREVER) -> list[ModelSpec]:
    config = fake_config()
    return [ModelSpec(name=n, aliases=(n, f"{n}-alias"), config=config, keep_alive_s=keep_alive_s, preload=False)
            for n in names]


class Loads:
    """A construct function that builds fake engines, counts loads, and can fail or stall a model's."""

    def __init__(self) -> None:
        self.built: list[str] = []
        self.fail: set[str] = set()
        self.gate: dict[str, threading.Event] = {}
        self.forward_sleep_s = 0.0  # each fake forward's time (a test that needs a stream still running)

    def __call__(self, spec: ModelSpec) -> Any:
        gate = self.gate.get(spec.name)
        if gate is not None:
            gate.wait(10)
        if spec.name in self.fail:
            raise ValueError(f"{spec.name}: not a model file")
        self.built.append(spec.name)
        return cllm.AsyncLLM(backend=FakeBackend(slots=2, forward_sleep_s=self.forward_sleep_s), config=spec.config)


def _router(loads: Loads, *names: str, keep_alive_s: float = KEEP_FOREVER, **settings: Any) -> Router:
    return Router(config=fake_config(**settings), specs=_specs(*names, keep_alive_s=keep_alive_s), construct=loads)


def _status(router: Router) -> dict[str, str]:
    return {m.name: m.status for m in router.models()}


def test_a_model_loads_on_first_use_once_and_answers():
    async def main() -> None:
        loads = Loads()
        router = _router(loads, "a", "b")
        assert _status(router) == {"a": "unloaded", "b": "unloaded"}
        # three concurrent first requests share one load
        leases = await asyncio.gather(*(router.acquire("b-alias") for _ in range(3)))
        assert loads.built == ["b"] and _status(router) == {"a": "unloaded", "b": "loaded"}
        assert {id(lease.engine) for lease in leases} == {id(router.engine_of("b"))}
        for lease in leases:
            lease.release()
        outs = [o async for o in router.generate("b", "hi", SamplingParams(max_tokens=3, temperature=0))]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
        assert router.default.name == "a"
        with pytest.raises(ModelNotFound, match="'nope' does not exist.*'a', 'a-alias', 'b'"):
            await router.acquire("nope")
        await router.shutdown()
        assert _status(router) == {"a": "unloaded", "b": "unloaded"}
    asyncio.run(main())


def test_keep_alive_unloads_an_idle_model_and_a_request_renews_it():
    async def main() -> None:
        loads = Loads()
        router = _router(loads, "a", keep_alive_s=0.3)
        lease = await router.acquire("a")
        await asyncio.sleep(0.5)
        assert _status(router)["a"] == "loaded"  # leased: never unloaded, whatever keep_alive says
        lease.release()
        await asyncio.sleep(0.15)
        (await router.acquire("a")).release()  # used again before it expired: the clock restarts
        await asyncio.sleep(0.2)
        assert _status(router)["a"] == "loaded"
        await asyncio.sleep(0.4)
        assert _status(router)["a"] == "unloaded" and loads.built == ["a"]
        # a request's keep_alive decides for it: 0 = unload as soon as it ends; -1 = never
        (await router.acquire("a", keep_alive_s=0)).release()
        await asyncio.sleep(0.1)
        assert _status(router)["a"] == "unloaded"
        (await router.acquire("a", keep_alive_s=KEEP_FOREVER)).release()
        await asyncio.sleep(0.5)
        assert _status(router)["a"] == "loaded" and loads.built == ["a", "a", "a"]
        await router.shutdown()
    asyncio.run(main())


def test_lru_eviction_never_takes_a_busy_model():
    async def main() -> None:
        loads = Loads()
        router = _router(loads, "a", "b", "c", max_loaded_models=2)
        busy = await router.acquire("a")
        (await router.acquire("b")).release()
        # c needs room: b is idle (a is busy though older), so b goes
        c = await router.acquire("c")
        assert _status(router) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        # b now: a and c are both busy -> 503-style refusal, nothing unloaded, nothing lost
        with pytest.raises(ModelUnavailable) as info:
            await router.acquire("b")
        assert info.value.code == "model_capacity" and info.value.retry_after_s
        assert _status(router) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        outs = [o async for o in busy.engine.generate("x", SamplingParams(max_tokens=2))]
        assert outs[-1].finished
        busy.release()
        lease = await router.acquire("b")  # a is idle now and least recently used
        assert _status(router) == {"a": "unloaded", "b": "loaded", "c": "loaded"}
        lease.release()
        c.release()
        await router.shutdown()
    asyncio.run(main())


def test_the_memory_budget_evicts_by_measured_size():
    async def main() -> None:
        loads = Loads()
        router = _router(loads, "a", "b", max_loaded_models=8)
        router.memory_budget = 100
        (await router.acquire("a")).release()
        router._slots[0].memory_bytes = 80  # as if measured at its load
        router._slots[1].memory_bytes = 40  # as if measured at an earlier load
        (await router.acquire("b")).release()
        assert _status(router) == {"a": "unloaded", "b": "loaded"}
        await router.shutdown()
    asyncio.run(main())


def test_device_room_is_made_from_idle_device_models_only():
    """Torch models on one GPU, each sized to its gpu_memory_utilization share of it: one more that would
    not fit is refused while the others are busy (never a load that runs the device out of memory), and
    makes room by unloading idle models on the device, not host-only ones."""
    async def main() -> None:
        loads = Loads()
        gpu = fake_config(backend="torch")
        specs = [ModelSpec(name=n, aliases=(n,), config=c, keep_alive_s=KEEP_FOREVER, preload=False)
                 for n, c in (("cpu-model", fake_config()), ("g1", gpu), ("g2", gpu.with_overrides(
                     gpu_memory_utilization=0.4)), ("g3", gpu.with_overrides(gpu_memory_utilization=0.4)))]
        router = Router(config=fake_config(max_loaded_models=8), specs=specs, construct=loads)
        slots = {s.spec.name: s for s in router._slots}
        (await router.acquire("cpu-model")).release()
        busy = await router.acquire("g1")
        slots["g1"].device_bytes, router.device_total = 90, 100  # as its load measured and reported
        with pytest.raises(ModelUnavailable, match="of the device") as info:
            await router.acquire("g2")  # 40 beside g1's 90 > 97, and g1 is busy: refused, nothing unloaded
        assert info.value.code == "model_capacity"
        assert {n: s.status.value for n, s in slots.items()} == {
            "cpu-model": "loaded", "g1": "loaded", "g2": "unloaded", "g3": "unloaded"}
        busy.release()
        (await router.acquire("g2")).release()  # g1 idle now: it goes, the host-only model stays
        slots["g2"].device_bytes = 40
        assert {n: s.status.value for n, s in slots.items()} == {
            "cpu-model": "loaded", "g1": "unloaded", "g2": "loaded", "g3": "unloaded"}
        (await router.acquire("g3")).release()  # 40 + 40 <= 97: both stay
        assert slots["g2"].status.value == slots["g3"].status.value == "loaded"
        info_of = {m.name: m for m in router.models()}
        assert info_of["g2"].device_mib is not None
        await router.shutdown()
    asyncio.run(main())


def test_a_model_that_fails_to_load_fails_alone_and_is_retried_later():
    async def main() -> None:
        loads = Loads()
        loads.fail.add("bad")
        router = _router(loads, "good", "bad", load_retry_s=0.3)
        with pytest.raises(ModelUnavailable) as info:
            await router.acquire("bad")
        assert info.value.code == "model_load_failed" and "not a model file" in str(info.value)
        with pytest.raises(ModelUnavailable, match="not a model file"):  # within load_retry_s: no new attempt
            await router.acquire("bad")
        assert loads.built == [] and _status(router)["bad"] == "failed"
        (await router.acquire("good")).release()
        loads.fail.clear()
        await asyncio.sleep(0.35)
        (await router.acquire("bad")).release()
        assert _status(router) == {"good": "loaded", "bad": "loaded"}
        await router.shutdown()
    asyncio.run(main())


def test_a_load_longer_than_the_timeout_is_a_retry_later_and_goes_on():
    async def main() -> None:
        loads = Loads()
        loads.gate["slow"] = threading.Event()
        router = _router(loads, "slow", model_load_timeout_s=0.2)
        with pytest.raises(ModelUnavailable) as info:
            await router.acquire("slow")
        assert info.value.code == "model_loading" and info.value.retry_after_s
        assert _status(router)["slow"] == "loading"
        loads.gate["slow"].set()
        lease = await router.acquire("slow", timeout_s=5)
        assert loads.built == ["slow"]
        lease.release()
        await router.shutdown()
    asyncio.run(main())


def test_a_declared_model_whose_engine_died_is_loaded_again_on_its_next_request():
    async def main() -> None:
        loads = Loads()
        router = _router(loads, "a")
        lease = await router.acquire("a")
        engine = lease.engine

        def broken_step():
            raise RuntimeError("simulated engine bug")
        engine.engine.step = broken_step
        with pytest.raises(Exception):
            async for _ in engine.generate("x", SamplingParams(max_tokens=2)):
                pass
        lease.release()
        deadline = time.monotonic() + 10
        while engine.is_running and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        again = await router.acquire("a")
        assert again.engine is not engine and loads.built == ["a", "a"]
        outs = [o async for o in again.engine.generate("x", SamplingParams(max_tokens=2))]
        assert outs[-1].finished
        again.release()
        await router.shutdown()
    asyncio.run(main())


def test_a_request_cancelled_while_its_model_loads_leaves_no_lease_and_the_load_finishes():
    """A client that leaves while its model loads: its lease ends (nothing pins the model), the load goes on
    and the model then idles out by its keep_alive."""
    async def main() -> None:
        loads = Loads()
        loads.gate["a"] = threading.Event()
        router = _router(loads, "a", keep_alive_s=0.2)
        waiting = asyncio.ensure_future(router.acquire("a"))
        await asyncio.sleep(0.1)
        assert router.models()[0].busy == 1 and _status(router)["a"] == "loading"
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert router.models()[0].busy == 0
        loads.gate["a"].set()
        deadline = time.monotonic() + 5
        while _status(router)["a"] != "loaded" and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert _status(router)["a"] == "loaded"
        await asyncio.sleep(0.4)  # nobody uses it: it idles out like any other model
        assert _status(router)["a"] == "unloaded"
        await router.shutdown()
    asyncio.run(main())


class _SharingBackend:
    """What the router sees of an in-process llama.cpp backend: its thread count and share_cpu."""

    def __init__(self, threads: int) -> None:
        self.cpu_threads = threads
        self.shares: list[int | None] = []

    def share_cpu(self, threads: int | None) -> None:
        self.shares.append(threads)


def test_busy_llama_cpp_engines_divide_the_threads():
    async def main() -> None:
        loads = Loads()
        router = _router(loads, "a", "b", "c")
        leases = [await router.acquire(n) for n in ("a", "b", "c")]
        backends = {}
        for lease in leases:
            backends[lease.spec.name] = lease.engine.engine.backend = _SharingBackend(8)
        leases[0].release()
        (a := await router.acquire("a")).release()  # a alone busy -> nothing to share; re-acquire to apply
        b, c = leases[1], leases[2]
        router._share_cpu()
        assert backends["b"].shares[-1] == 4 and backends["c"].shares[-1] == 4  # two busy: half each
        assert not backends["a"].shares or backends["a"].shares[-1] is None
        held = await router.acquire("a")
        assert [backends[n].shares[-1] for n in "abc"] == [2, 2, 2]  # three busy: a third each (rounded down)
        held.release()
        c.release()
        assert backends["b"].shares[-1] is None  # alone again: its own count
        b.release()
        del a
        await router.shutdown()
    asyncio.run(main())


# ---------------------------------------------------------------- the server over the router
def _two_model_app(tmp_path: Path, **settings: Any) -> Any:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x")
    config = fake_config(**settings).model_copy(update={"models": [
        ModelEntry(name="a", model=str(path), aliases=["alpha"]), ModelEntry(name="b", model=str(path))]})
    app = create_app(config)
    return app


@pytest.fixture()
def fake_loads(monkeypatch: pytest.MonkeyPatch) -> Loads:
    from cllm.server import lifecycle

    loads = Loads()
    monkeypatch.setattr(lifecycle, "_construct_engine", lambda config: loads(
        ModelSpec(name=Path(config.model.model).name, aliases=(), config=config, keep_alive_s=0, preload=False)))
    return loads


def test_server_routes_each_request_to_its_model(tmp_path: Path, fake_loads: Loads):
    with TestClient(_two_model_app(tmp_path), base_url="http://localhost") as client:
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["models"] == {"a": "unloaded", "b": "unloaded"}
        cards = client.get("/v1/models").json()["data"]
        assert [(c["id"], c["root"], c["status"], c["loaded"]) for c in cards] == [
            ("a", "a", "unloaded", False), ("alpha", "a", "unloaded", False), ("b", "b", "unloaded", False)]
        reply = client.post("/v1/completions", json={"model": "alpha", "prompt": "hi", "max_tokens": 2})
        assert reply.status_code == 200 and reply.json()["model"] == "a"
        state = client.app.state.cllm
        assert {m.name: (m.status, m.busy) for m in state.router.models()} == {"a": ("loaded", 0), "b": ("unloaded", 0)}
        missing = client.post("/v1/chat/completions", json={"model": "c", "messages": [{"role": "user", "content": "x"}]})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert "'a', 'alpha', 'b'" in missing.json()["error"]["message"]
        bad_keep = client.post("/v1/completions", json={"model": "b", "prompt": "hi", "keep_alive": "later"})
        assert bad_keep.status_code == 400 and bad_keep.json()["error"]["param"] == "keep_alive"
        assert client.get("/v1/models/b").json()["status"] == "unloaded"  # a bad request loads nothing
        loaded = client.post("/v1/models/b/load")
        assert loaded.status_code == 200 and loaded.json()["model"]["status"] == "loaded"
        engine = client.get("/v1/engine", params={"model": "b"}).json()
        assert engine["model"] == "b" and engine["status"] == "loaded" and "stats" in engine
        assert [m["name"] for m in engine["models"]] == ["a", "b"]
        metrics = client.get("/metrics").text
        assert 'cllm_slots_total{model="a"} 2.0' in metrics and 'cllm_slots_total{model="b"} 2.0' in metrics
        assert 'cllm_requests_total{model="a",status="length"} 1.0' in metrics
        unloaded = client.post("/v1/models/a/unload")
        assert unloaded.status_code == 200 and unloaded.json()["model"]["status"] == "unloaded"
        assert client.get("/v1/models/alpha").json()["status"] == "unloaded"
        assert fake_loads.built == ["m.gguf", "m.gguf"]


def test_server_a_model_that_fails_to_load_leaves_the_others_serving(tmp_path: Path, fake_loads: Loads,
                                                                     monkeypatch: pytest.MonkeyPatch):
    from cllm.server import lifecycle

    def construct(config: Any) -> Any:
        if config.model.n_ctx == 999:
            raise ValueError("broken model file")
        return cllm.AsyncLLM(backend=FakeBackend(slots=2), config=config)
    monkeypatch.setattr(lifecycle, "_construct_engine", construct)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x")
    config = fake_config().model_copy(update={"models": [
        ModelEntry(name="good", model=str(path)), ModelEntry(name="bad", model=str(path), n_ctx=999)]})
    with TestClient(create_app(config), base_url="http://localhost") as client:
        bad = client.post("/v1/completions", json={"model": "bad", "prompt": "hi", "max_tokens": 2})
        assert bad.status_code == 503 and bad.json()["error"]["code"] == "model_load_failed"
        assert "broken model file" in bad.json()["error"]["message"] and int(bad.headers["Retry-After"]) >= 1
        good = client.post("/v1/completions", json={"model": "good", "prompt": "hi", "max_tokens": 2})
        assert good.status_code == 200
        assert client.get("/health").json() == {"status": "ok", "models": {"good": "loaded", "bad": "failed"}}


def test_server_unload_of_a_busy_model_is_a_409_and_a_lease_lasts_the_whole_stream(tmp_path: Path,
                                                                                   fake_loads: Loads):
    # Forwards of 20 ms: the stream is still running after its first line is read. With instant ones its
    # 40 tokens merged into one last piece that the test client's buffer took at once, and the response
    # (with its lease) could end before the unload below was asked.
    fake_loads.forward_sleep_s = 0.02
    with TestClient(_two_model_app(tmp_path), base_url="http://localhost") as client:
        state = client.app.state.cllm
        seen_busy: list[int] = []
        with client.stream("POST", "/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 40,
                                                             "stream": True}) as stream:
            lines = stream.iter_lines()
            next(lines)
            seen_busy.append(next(m.busy for m in state.router.models() if m.name == "a"))
            refused = client.post("/v1/models/a/unload")
            assert refused.status_code == 409 and refused.json()["error"]["code"] == "model_busy"
            for _ in lines:
                pass
        deadline = time.monotonic() + 5
        while next(m.busy for m in state.router.models() if m.name == "a") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen_busy == [1] and next(m.busy for m in state.router.models() if m.name == "a") == 0
        assert client.post("/v1/models/a/unload").status_code == 200


def test_a_single_model_server_keeps_its_model_and_lists_it_loaded():
    config = fake_config()
    app = create_app(config, engine=cllm.AsyncLLM(backend=FakeBackend(slots=2), config=config))
    with TestClient(app, base_url="http://localhost") as client:
        (card,) = client.get("/v1/models").json()["data"]
        assert (card["status"], card["loaded"], card["root"]) == ("loaded", True, card["id"])
        refused = client.post(f"/v1/models/{card['id']}/unload")
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "model_pinned"
        assert client.get("/health").json() == {"status": "ok"}
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200

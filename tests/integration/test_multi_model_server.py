"""Several models behind one real `cllm serve` (issue 44): the embedded GGUF under two names with different
settings on llama.cpp, the same GGUF dequantised on torch, and a tiny random Qwen3 directory on torch —
each loaded on its first request, routed by the request's `model`, unloaded by keep_alive, evicted least
recently used (never while busy), a broken model failing alone, and the official `openai` client using
them all."""
from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from cllm.model_path import default_model_path
from cllm.tiny_models import build_tiny
from tests.integration.conftest_server import ServerProcess, _finish, start_server

GGUF = str(default_model_path())
HELLO = [{"role": "user", "content": "Say hello in five words."}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny("qwen3", tmp_path_factory.mktemp("tiny") / "tiny-qwen3")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[ServerProcess]:
    broken = tmp_path_factory.mktemp("broken") / "broken.gguf"
    broken.write_bytes(b"GGUF but not really a model file")
    config = {
        "router": {"max_loaded_models": 4, "keep_alive": -1},
        "models": [
            {"name": "smol", "model": GGUF, "n_seq_max": 4, "n_ctx": 4096, "aliases": ["default-chat"]},
            {"name": "smol-2", "model": GGUF, "n_seq_max": 2, "n_ctx": 2048, "speculative": "off"},
            {"name": "smol-torch", "model": GGUF, "backend": "torch", "n_seq_max": 2, "n_ctx": 2048},
            {"name": "tiny", "model": str(tiny_dir), "n_seq_max": 2, "n_ctx": 1024},
            {"name": "broken", "model": str(broken)},
        ],
    }
    path = tmp_path_factory.mktemp("cfg") / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    srv = start_server("--config", str(path), "--log-level", "info")
    yield srv
    _finish(srv)


def _models(srv: ServerProcess) -> dict[str, dict[str, Any]]:
    with srv.http() as client:
        return {c["id"]: c for c in client.get("/v1/models").json()["data"]}


def _wait_status(srv: ServerProcess, name: str, status: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _models(srv)[name]["status"] != status:
        assert time.monotonic() < deadline, f"{name} never became {status}: {_models(srv)[name]}"
        time.sleep(0.1)


def _metric(srv: ServerProcess, name: str, model: str) -> float:
    with srv.http() as client:
        text = client.get("/metrics").text
    match = re.search(rf'^{name}{{model="{re.escape(model)}"}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def test_every_declared_model_is_listed_and_none_is_loaded_before_it_is_asked_for(server: ServerProcess):
    cards = _models(server)
    assert list(cards) == ["smol", "default-chat", "smol-2", "smol-torch", "tiny", "broken"]
    assert cards["default-chat"]["root"] == "smol"
    assert {c["backend"] for n, c in cards.items() if n.startswith("smol-t")} == {"torch"}
    assert cards["tiny"]["backend"] == "torch" and cards["smol"]["backend"] == "llama_cpp"
    assert all(c["status"] == "unloaded" and c["loaded"] is False for c in cards.values())


def test_the_openai_client_lists_and_uses_every_model(server: ServerProcess):
    client = server.openai()
    ids = [m.id for m in client.models.list()]
    assert ids == ["smol", "default-chat", "smol-2", "smol-torch", "tiny", "broken"]
    texts = {}
    for name in ("smol", "smol-2", "smol-torch", "tiny", "default-chat"):
        reply = client.chat.completions.create(model=name, messages=HELLO, max_tokens=8, temperature=0)
        assert reply.model == ("smol" if name == "default-chat" else name)
        assert reply.choices[0].message.content and reply.usage.completion_tokens >= 1
        texts[name] = reply.choices[0].message.content
    # the random model writes something else than SmolLM2 does; the same SmolLM2 file under two names
    # (one with speculation off) writes the same greedy text
    assert texts["tiny"] != texts["smol"] and texts["smol"] == texts["smol-2"] == texts["default-chat"]
    cards = _models(server)
    assert all(cards[n]["status"] == "loaded" for n in ("smol", "smol-2", "smol-torch", "tiny"))
    assert cards["broken"]["status"] == "unloaded"
    # each model's own engine counted its own prompts
    assert all(_metric(server, "cllm_prompt_tokens_total", n) > 0 for n in ("smol", "smol-2", "smol-torch", "tiny"))


def test_concurrent_requests_to_four_models_each_reach_their_own(server: ServerProcess):
    names = ["smol", "smol-2", "smol-torch", "tiny"] * 2
    before = {n: _metric(server, "cllm_generation_tokens_total", n) for n in set(names)}

    async def one(client: httpx.AsyncClient, name: str, i: int) -> tuple[str, int]:
        body = {"model": name, "prompt": f"Count to ten, take {i}:", "max_tokens": 6, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        tokens, model = 0, None
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    chunk = httpx.Response(200, content=line[6:]).json()
                    model = chunk["model"]
                    tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
        return model, tokens

    async def main() -> list[tuple[str, int]]:
        async with server.async_http() as client:
            return await asyncio.gather(*(one(client, n, i) for i, n in enumerate(names)))

    results = asyncio.run(main())
    assert [m for m, _ in results] == names and all(t == 6 for _, t in results)
    for name in set(names):
        assert _metric(server, "cllm_generation_tokens_total", name) - before[name] >= 12, name


def test_a_model_that_cannot_load_fails_alone(server: ServerProcess):
    with server.http() as client:
        bad = client.post("/v1/chat/completions", json={"model": "broken", "messages": HELLO, "max_tokens": 4})
        assert bad.status_code == 503, bad.text
        error = bad.json()["error"]
        assert error["code"] == "model_load_failed" and "broken" in error["message"]
        assert int(bad.headers["Retry-After"]) >= 1
        assert _models(server)["broken"]["status"] == "failed"
        assert client.get("/health").json()["status"] == "ok"
        good = client.post("/v1/chat/completions", json={"model": "smol", "messages": HELLO, "max_tokens": 4})
        assert good.status_code == 200
        missing = client.post("/v1/chat/completions", json={"model": "gpt-4", "messages": HELLO})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert "'tiny'" in missing.json()["error"]["message"]


def test_keep_alive_zero_unloads_when_the_request_ends_and_load_unload_endpoints(server: ServerProcess):
    with server.http() as client:
        assert client.post("/v1/models/smol-2/load").json()["model"]["status"] == "loaded"
        reply = client.post("/v1/completions", json={"model": "smol-2", "prompt": "Hi", "max_tokens": 3,
                                                     "keep_alive": 0})
        assert reply.status_code == 200
        _wait_status(server, "smol-2", "unloaded", timeout_s=10)
        engine = client.get("/v1/engine", params={"model": "smol-2"}).json()
        assert engine["status"] == "unloaded" and "stats" not in engine
        assert client.post("/v1/models/smol-2/load").status_code == 200
        assert _models(server)["smol-2"]["status"] == "loaded"
        info = {m["name"]: m for m in client.get("/v1/engine").json()["models"]}
        assert info["smol-2"]["memory_mib"] is not None and info["smol-2"]["load_seconds"] > 0
        assert client.post("/v1/models/smol-2/unload").json()["model"]["status"] == "unloaded"


def test_a_model_loads_on_its_first_request_while_another_streams(tmp_path: Path):
    """A llama.cpp stream goes on while a torch model loads beside it (the load runs off the event loop and
    off the other engine's thread)."""
    srv = start_server("--model", f"a={GGUF}", "--model", f"b={GGUF}@torch", "--keep-alive", "-1",
                       "--set", "n_seq_max=2", "--set", "n_ctx=2048", "--log-level", "info")
    try:
        with srv.http() as client:
            assert client.post("/v1/models/a/load").status_code == 200
        arrivals: list[float] = []
        usage: dict[str, Any] = {}

        def stream_a() -> None:
            body = {"model": "a", "prompt": "Write a long story about a cat.", "max_tokens": 200,
                    "temperature": 0, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
            with srv.http(timeout=120) as client, client.stream("POST", "/v1/completions", json=body) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.monotonic())
                        usage.update(httpx.Response(200, content=line[6:]).json().get("usage") or {})

        streamer = threading.Thread(target=stream_a)
        streamer.start()
        while len(arrivals) < 5:
            time.sleep(0.01)
        load_start = time.monotonic()
        with srv.http(timeout=120) as client:
            reply = client.post("/v1/completions", json={"model": "b", "prompt": "Hi", "max_tokens": 3})
        load_end = time.monotonic()
        streamer.join(120)
        assert reply.status_code == 200 and reply.json()["model"] == "b"
        during = [t for t in arrivals if load_start < t < load_end]
        # b's load (seconds: a dequantised GGUF on torch) did not stop a's stream
        assert load_end - load_start > 1.0 and len(during) >= 5, (load_end - load_start, len(during))
        assert usage["completion_tokens"] == 200  # (chunks may carry several tokens when the reader lags)
    finally:
        _finish(srv)


def test_lru_eviction_with_one_model_loaded_never_evicts_a_busy_one():
    srv = start_server("--model", f"a={GGUF}", "--model", f"b={GGUF}", "--max-loaded-models", "1",
                       "--keep-alive", "-1", "--set", "n_seq_max=2", "--set", "n_ctx=2048", "--log-level", "info")
    try:
        with srv.http() as client:
            assert client.post("/v1/models/a/load").status_code == 200
        done: dict[str, Any] = {}

        def stream_a() -> None:
            body = {"model": "a", "prompt": "Tell a story.", "max_tokens": 120, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            with srv.http(timeout=120) as client, client.stream("POST", "/v1/completions", json=body) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        done.update(httpx.Response(200, content=line[6:]).json().get("usage") or {})

        streamer = threading.Thread(target=stream_a)
        streamer.start()
        deadline = time.monotonic() + 30
        with srv.http() as client:
            while not client.get("/v1/engine", params={"model": "a"}).json().get("running"):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            refused = client.post("/v1/completions", json={"model": "b", "prompt": "Hi", "max_tokens": 2})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_capacity"
            assert int(refused.headers["Retry-After"]) >= 1
            assert _models(srv)["a"]["status"] == "loaded"
            streamer.join(120)
            assert done["completion_tokens"] == 120  # the busy model's stream was never cut
            reply = client.post("/v1/completions", json={"model": "b", "prompt": "Hi", "max_tokens": 2})
            assert reply.status_code == 200
            cards = _models(srv)
            assert (cards["a"]["status"], cards["b"]["status"]) == ("unloaded", "loaded")
        assert "unloading model 'a' (to make room for 'b')" in srv.log_text()
    finally:
        _finish(srv)


def test_two_busy_llama_cpp_models_divide_the_cpu_threads():
    srv = start_server("--model", f"a={GGUF}", "--model", f"b={GGUF}", "--keep-alive", "-1",
                       "--set", "n_seq_max=2", "--set", "n_ctx=2048", "--set", "n_threads=2",
                       "--log-level", "info", threads=None)
    try:
        with srv.http() as client:
            for name in ("a", "b"):
                assert client.post(f"/v1/models/{name}/load").status_code == 200
        seen: dict[str, set[float]] = {"a": set(), "b": set()}
        stop = threading.Event()

        def stream(name: str) -> None:
            body = {"model": name, "prompt": "Tell a story.", "max_tokens": 150, "ignore_eos": True, "stream": True}
            with srv.http(timeout=120) as client, client.stream("POST", "/v1/completions", json=body) as resp:
                for _ in resp.iter_lines():
                    pass

        threads = [threading.Thread(target=stream, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()

        def watch() -> None:
            while not stop.is_set():
                with srv.http() as client:
                    for info in client.get("/v1/engine").json()["models"]:
                        if info["busy"]:
                            seen[info["name"]].add(info["thread_share"])
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        for t in threads:
            t.join(120)
        stop.set()
        watcher.join()
        # while both streamed, each had one of the two threads
        assert 1 in seen["a"] and 1 in seen["b"], seen
        assert _metric(srv, "cllm_compute_threads", "a") in (1.0, 2.0)
    finally:
        _finish(srv)


def test_python_router_serves_a_gguf_on_llama_cpp_beside_a_checkpoint_on_torch(tiny_dir: Path):
    """cllm.Router: the multi-model API in Python, on the same engines the server uses."""
    import cllm

    async def main() -> dict[str, Any]:
        router = cllm.Router({"smol": {"model": GGUF, "n_seq_max": 2, "n_ctx": 1024},
                              "tiny": {"model": str(tiny_dir), "n_seq_max": 2, "n_ctx": 1024}},
                             keep_alive=-1, n_threads=1)
        try:
            params = cllm.SamplingParams(max_tokens=6, temperature=0)
            outs = {}
            for name in ("smol", "tiny", "smol"):
                final = [o async for o in router.chat(name, HELLO, params)][-1]
                outs.setdefault(name, []).append(final.outputs[0].token_ids)
            statuses = {m.name: (m.status, m.backend) for m in router.models()}
            await router.unload("tiny")
            after = {m.name: m.status for m in router.models()}
            with pytest.raises(cllm.ModelNotFound):
                await router.acquire("nope")
            return {"outs": outs, "statuses": statuses, "after": after}
        finally:
            await router.shutdown()

    result = asyncio.run(main())
    assert result["statuses"] == {"smol": ("loaded", "llama_cpp"), "tiny": ("loaded", "torch")}
    assert result["after"] == {"smol": "loaded", "tiny": "unloaded"}
    smol, tiny = result["outs"]["smol"], result["outs"]["tiny"]
    assert smol[0] == smol[1] and len(smol[0]) == 6 and tiny[0] != smol[0]


def test_each_model_has_its_own_core_process_and_a_dead_core_fails_only_its_model():
    import os
    import signal

    srv = start_server("--model", f"a={GGUF}", "--model", f"b={GGUF}", "--keep-alive", "-1",
                       "--set", "n_seq_max=2", "--set", "n_ctx=2048", "--set", "engine_process=on",
                       "--log-level", "info")
    try:
        with srv.http(timeout=120) as client:
            for name in ("a", "b"):
                assert client.post(f"/v1/models/{name}/load").status_code == 200
            cores = {n: client.get("/v1/engine", params={"model": n}).json()["engine_core"] for n in ("a", "b")}
            pids = {n: c["pid"] for n, c in cores.items()}
            assert pids["a"] != pids["b"] and os.getpid() not in pids.values()
            memory = {m["name"]: m["memory_mib"] for m in client.get("/v1/engine").json()["models"]}
            assert all(mib > 50 for mib in memory.values()), memory  # each core's own resident memory
            os.kill(pids["a"], signal.SIGKILL)
            reply = client.post("/v1/completions", json={"model": "b", "prompt": "Hi", "max_tokens": 4})
            assert reply.status_code == 200  # b never noticed
            deadline = time.monotonic() + 60
            while True:  # a's supervisor starts a new core; until then its requests get 503, never b's
                reply = client.post("/v1/completions", json={"model": "a", "prompt": "Hi", "max_tokens": 4})
                if reply.status_code == 200:
                    break
                assert reply.status_code == 503, reply.text
                assert time.monotonic() < deadline
                time.sleep(0.5)
            core = client.get("/v1/engine", params={"model": "a"}).json()["engine_core"]
            assert core["restarts"] == 1 and core["pid"] != pids["a"]
            assert client.get("/health").json()["status"] == "ok"
    finally:
        _finish(srv)


def test_cllm_chat_talks_to_the_model_it_names(server: ServerProcess):
    import subprocess
    import sys

    def chat(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cllm", "chat", "--url", server.base_url, *args,
                               "--max-tokens", "4", "--temperature", "0"], input=b"hi\n", capture_output=True,
                              timeout=120)
    before = _metric(server, "cllm_generation_tokens_total", "tiny")
    done = chat("--model", "tiny")
    assert done.returncode == 0, done.stderr.decode()
    assert "[4 tokens" in done.stderr.decode()
    assert _metric(server, "cllm_generation_tokens_total", "tiny") == before + 4  # tiny's engine wrote them
    wrong = chat("--model", "nope")
    assert wrong.returncode != 0 and "serves no model 'nope'" in wrong.stderr.decode()

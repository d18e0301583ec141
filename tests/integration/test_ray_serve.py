"""cllm on Ray Serve: a local Ray instance (2 CPUs, 150 MB object store), 2 engine replicas x 1 thread.

Greedy references come from an in-process engine with the same settings, each on a prompt used once
(no prefix-cache hit on either side) and alone in its batch on both sides, which is where README
"Reproducibility" guarantees bit-identical tokens; a hand-off copies the KV byte for byte, so PD and
a drain keep that guarantee.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import ray
from ray import serve

import cllm
from cllm.cluster import app as cluster_app
from cllm.cluster.stats_board import ReplicaReport, stats_board
from cllm.cluster.transport import HOLDER_NAME, HolderClient, chunks_lost, publish, receive
from cllm.handoff.transfer import KVReceiver
from cllm.stress import verdicts
from cllm.stress.holder_kill import run_holder_kill
from cllm.stress.server_process import free_port

ENGINE = dict(n_threads=1, n_seq_max=2, n_ctx=2048)
SHARED_PREFIX = ("You are a meticulous assistant for a small bakery. Answer questions about opening hours, "
                 "bread, pastries, cakes, allergens and prices. Keep answers short and friendly, and never "
                 "invent products the bakery does not sell. Customer question: ")


@dataclass
class Cluster:
    """The local Ray instance and whichever cllm application runs on it now."""

    port: int
    url: str = ""
    kind: str = ""  # "colocated" or "pd"
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=120))

    def deploy(self, kind: str, config: object = None, **settings: object) -> str:
        if self.kind == kind:
            return self.url
        if self.kind:
            cluster_app.stop()
            wait_for(lambda: len(board_reports()) == 0, "old replicas to leave the stats board", 60)
        self.url = cluster_app.serve_ray(config=config, port=self.port, blocking=False, **ENGINE, **settings)
        self.kind = kind
        wait_for(lambda: self.client.get(self.url + "/health").status_code == 200, "the endpoint", 120)
        return self.url

    def complete(self, prompt: str, max_tokens: int, **extra: object) -> dict:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
        response = self.client.post(self.url + "/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()


def wait_for(condition, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except Exception:
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def board_reports() -> list[ReplicaReport]:
    return ray.get(stats_board().reports.remote())


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    ray.init(num_cpus=2, object_store_memory=150 * 1024 * 1024, namespace=cluster_app.NAMESPACE,
             include_dashboard=False, log_to_driver=False)
    c = Cluster(port=free_port())
    try:
        yield c
    finally:
        c.client.close()
        if c.kind:
            cluster_app.stop()
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def reference() -> Iterator[cllm.LLM]:
    with cllm.LLM(**ENGINE) as llm:
        yield llm


def greedy(llm: cllm.LLM, prompt: str, max_tokens: int, **extra: object) -> str:
    params = cllm.SamplingParams(max_tokens=max_tokens, temperature=0, **extra)
    return llm.generate([prompt], params)[0].outputs[0].text


def test_object_store_transfer_interrupted_resumes_and_completes(cluster, reference):
    """Chunks in the object store, owned by the holder actor; the fetch fails after 3 chunks, the
    same receiver resumes from chunk 3, and the other engine continues the request exactly."""
    prompt = "The oldest known recipe for bread"
    expected = greedy(reference, prompt, 24)
    with cllm.LLM(**ENGINE) as other:
        reference.engine.add_request(prompt, cllm.SamplingParams(max_tokens=24, temperature=0), request_id="t")
        for _ in range(6):
            reference.engine.step()
        snapshot, segments = reference.engine.export_request("t")
        holder = HolderClient()
        ticket = asyncio.run(publish(snapshot, segments, 16 * 1024, holder))
        assert ticket.header.transfer_id.startswith("t/")  # an id of its own per hand-off
        assert ticket.header.num_chunks > 3
        fetched = 0

        async def flaky_fetch(ref):
            nonlocal fetched
            if fetched == 3:
                fetched += 1
                raise ConnectionError("link dropped")
            fetched += 1
            return await ref

        receiver = KVReceiver(ticket.header)
        with pytest.raises(ConnectionError):
            asyncio.run(receive(ticket, receiver, fetch=flaky_fetch))
        assert receiver.next_index == 3 and receiver.status.name == "TRANSFERRING"
        moved = asyncio.run(receive(ticket, receiver, fetch=flaky_fetch))  # resumes from chunk 3
        assert moved == segments and receiver.status.name == "DONE"
        assert ticket.header.transfer_id in ray.get(holder.handle.held.remote())
        holder.release(ticket.header.transfer_id)
        wait_for(lambda: ticket.header.transfer_id not in ray.get(holder.handle.held.remote()), "the release", 10)
        other.engine.import_request(snapshot, moved)
        final = None
        while other.engine.has_unfinished():
            for out in other.engine.step():
                final = out
        assert final.outputs[0].text == expected


def _is_dead(actor) -> bool:
    try:
        ray.get(actor.held.remote(), timeout=5)
    except ray.exceptions.RayActorError:
        return True
    return False


def test_a_killed_holder_is_resolved_again_and_its_chunks_are_got_or_reported_lost(cluster, reference):
    """What the replicas rely on when the holder dies (issue 27 item 1): a HolderClient whose handle
    died resolves the holder again by name and publishes; fetching the dead holder's chunks either
    still works (on one node the object store keeps them) or raises a lost-object error, on which the
    receiver recomputes the KV instead of retrying forever."""
    reference.engine.add_request("A list of the planets:", cllm.SamplingParams(max_tokens=8, temperature=0),
                                 request_id="k")
    for _ in range(4):
        reference.engine.step()
    snapshot, segments = reference.engine.export_request("k")
    holder = HolderClient()
    ticket = asyncio.run(publish(snapshot, segments, 16 * 1024, holder))
    dead = holder.handle
    ray.kill(dead, no_restart=True)
    wait_for(lambda: _is_dead(dead), "the holder to die", 30)
    try:
        assert asyncio.run(asyncio.wait_for(receive(ticket, KVReceiver(ticket.header)), 60)) == segments
    except Exception as err:
        assert chunks_lost(err), repr(err)
    again = asyncio.run(publish(snapshot, segments, 16 * 1024, holder))
    assert holder.handle is not dead
    assert asyncio.run(asyncio.wait_for(receive(again, KVReceiver(again.header)), 60)) == segments
    holder.release(again.header.transfer_id)


def test_routes_streaming_errors_and_greedy_output(cluster, reference):
    url = cluster.deploy("colocated", replicas=2)
    prompt = "The three primary colors are"
    assert cluster.complete(prompt, 24)["choices"][0]["text"] == greedy(reference, prompt, 24)
    models = cluster.client.get(url + "/v1/models").json()
    assert models["data"][0]["id"] == reference.engine.backend.model_path.stem
    lines = []
    body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "stream": True}
    with cluster.client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and len(lines) > 3
    bad = cluster.client.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    too_long = cluster.client.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 5000})
    assert too_long.status_code == 400
    embedded = cluster.client.post(url + "/v1/embeddings", json={"input": ["a red apple", "a green pear"]})
    assert embedded.status_code == 200, embedded.text
    expected = reference.embed(["a red apple", "a green pear"])
    for got, want in zip(embedded.json()["data"], expected):
        assert got["embedding"] == pytest.approx(list(want.embedding), abs=1e-4)


def test_chat_page_through_the_ingress(cluster):
    url = cluster.deploy("colocated", replicas=2)
    page = cluster.client.get(url + "/")
    assert page.status_code == 200 and "static/chat.js" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert cluster.client.get(url + "/static/chat.js").status_code == 200


def test_embeddings_and_echo_logprobs_through_the_cluster(cluster, reference):
    url = cluster.deploy("colocated", replicas=2)
    texts = ["The cat sat on the mat.", "A cat was sitting on the mat."]
    response = cluster.client.post(url + "/v1/embeddings", json={"input": texts})
    assert response.status_code == 200, response.text
    got = [d["embedding"] for d in response.json()["data"]]
    expected = [o.embedding for o in reference.embed(texts)]
    assert len(got) == 2 and all(abs(a - b) < 1e-2 for g, e in zip(got, expected) for a, b in zip(g, e))
    bad = cluster.client.post(url + "/v1/embeddings", json={"input": [""]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
    prompt = "The capital of France is Paris."
    body = cluster.complete(prompt, 0, echo=True, logprobs=1)["choices"][0]
    ours = reference.generate(prompt, cllm.SamplingParams(max_tokens=0, prompt_logprobs=1))[0].prompt_logprobs
    assert body["text"] == prompt and body["logprobs"]["token_logprobs"][0] is None
    assert all(abs(a - b.logprob) < 1e-4 for a, b in zip(body["logprobs"]["token_logprobs"][1:], ours[1:]))


def test_prefix_affinity_routes_a_cached_prefix_to_its_replica(cluster):
    cluster.deploy("colocated", replicas=2)
    before = {r.replica: r.stats.prefix_cache_hit_tokens for r in board_reports()}
    cached = [cluster.complete(SHARED_PREFIX + q, 4)["usage"]["prompt_tokens_details"]["cached_tokens"]
              for q in ("Do you sell rye bread?", "When do you open on Sunday?", "Is the carrot cake nut free?",
                        "How much is a baguette?")]
    # Only the replica that served the first request holds the prefix: every later one went there.
    assert cached[0] == 0 and all(c >= 32 for c in cached[1:]), cached
    wait_for(lambda: sum(r.stats.prefix_cache_hit_tokens for r in board_reports()) - sum(before.values())
             >= sum(cached), "replica stats", 10)
    gains = [r.stats.prefix_cache_hit_tokens - before.get(r.replica, 0) for r in board_reports()]
    assert sorted(gains) == [0, sum(cached)]


def test_metrics_aggregate_the_replicas(cluster):
    url = cluster.deploy("colocated", replicas=2)
    cluster.complete("Count to five:", 8)
    seen: dict = {}

    def aggregated() -> bool:
        """Replicas post their stats every 0.5 s and the ingress reads them every 0.5 s: wait until the
        ingress's /metrics shows the tokens and agrees with the board."""
        text = cluster.client.get(url + "/metrics").text
        seen["metrics"] = {line.split("{")[0]: float(line.split(" ")[-1]) for line in text.splitlines()
                           if line.startswith("cllm_") and "{model=" in line and "," not in line}
        seen["reports"] = board_reports()
        board_total = sum(r.stats.generation_tokens_total for r in seen["reports"])
        return len(seen["reports"]) == 2 and seen["metrics"]["cllm_generation_tokens_total"] == board_total >= 8
    wait_for(aggregated, "the ingress's metrics to aggregate both replicas", 30)
    assert seen["metrics"]["cllm_slots_total"] == 2 * ENGINE["n_seq_max"]


def stream_completion(cluster: Cluster, prompt: str, max_tokens: int, sink: dict) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    sink["events"] = []
    with cluster.client.stream("POST", cluster.url + "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                sink["events"].append(json.loads(line[6:]))
                sink.setdefault("id", sink["events"][0].get("id"))  # Serve's proxy sets its own X-Request-Id


def _streamed_text(events: list[dict]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


def replica_running(request_id: str) -> ReplicaReport | None:
    for report in board_reports():
        if any(info.request_id == request_id for info in report.running):
            return report
    return None


def test_killed_replica_fails_only_its_requests(cluster):
    cluster.deploy("colocated", replicas=2)
    sinks = [{}, {}]
    threads = [threading.Thread(target=stream_completion, args=(cluster, p, 600, s))
               for p, s in zip(("Tell me about ships.", "Tell me about trains."), sinks)]
    threads[0].start()  # one after the other: requests routed at the same instant may pick the same replica
    wait_for(lambda: sinks[0].get("id"), "the first stream to start", 60)
    threads[1].start()
    # Replicas post what they run every 0.5 s: wait until the board shows both streams.
    wait_for(lambda: sinks[1].get("id") and all(replica_running(s["id"]) is not None for s in sinks),
             "both streams to start", 60)
    victim = replica_running(sinks[0]["id"])
    assert replica_running(sinks[1]["id"]).replica != victim.replica  # least-loaded: one each
    os.kill(victim.pid, signal.SIGKILL)
    for t in threads:
        t.join(120)
    killed, survivor = sinks
    assert "error" in killed["events"][-1] and "replica" in killed["events"][-1]["error"]["message"], killed["events"][-1]
    assert survivor["events"][-1]["choices"][0]["finish_reason"] == "length", survivor["events"][-1]
    assert sum(len(e["choices"][0]["text"]) > 0 for e in survivor["events"] if e.get("choices")) > 100
    assert cluster.complete("After the crash,", 4)["choices"][0]["finish_reason"] == "length"
    wait_for(lambda: len({r.pid for r in board_reports()}) == 2 and victim.pid not in {r.pid for r in board_reports()},
             "Serve to replace the killed replica", 120)


def test_sigterm_drains_running_requests_to_the_other_replica(cluster, reference):
    cluster.deploy("colocated", replicas=2)
    prompt = "Write a long poem about the sea."
    expected = greedy(reference, prompt, 400, ignore_eos=True)
    sink: dict = {}
    thread = threading.Thread(target=stream_completion, args=(cluster, prompt, 400, sink))
    thread.start()
    wait_for(lambda: len(sink.get("events", [])) > 20 and replica_running(sink["id"]) is not None,
             "the stream to start", 60)
    draining = replica_running(sink["id"])
    os.kill(draining.pid, signal.SIGTERM)
    at_signal = _streamed_text(sink["events"][:])
    thread.join(120)
    # Most of it was still to come when the replica left (counted in text: a busy event loop may carry
    # several tokens in one event, so the events need not be one per token).
    assert len(at_signal) < len(expected) // 2
    text = _streamed_text(sink["events"])
    assert sink["events"][-1]["choices"][0]["finish_reason"] == "length"
    assert text == expected  # every token once, the rest decoded on the other replica from the moved KV
    wait_for(lambda: draining.pid not in {r.pid for r in board_reports()}, "the drained replica to leave", 60)


def test_prefill_decode_disaggregation_gives_the_same_greedy_output(cluster, reference):
    cluster.deploy("pd", pd="prefill=1,decode=1")
    prompt = "A short history of the printing press:"
    assert cluster.complete(prompt, 32)["choices"][0]["text"] == greedy(reference, prompt, 32)
    by_role: dict = {}

    def both_posted() -> bool:
        """Each replica posts its stats every 0.5 s: wait for the posts that count this request."""
        by_role.update({r.role: r.stats for r in board_reports()})
        return set(by_role) == {"prefill", "decode"} and by_role["prefill"].prompt_tokens_total > 0 \
            and by_role["decode"].generation_tokens_total > by_role["prefill"].generation_tokens_total
    wait_for(both_posted, "both roles' stats on the board", 30)
    assert by_role["decode"].prompt_tokens_total == 0  # the decode replica evaluated no prompt: its KV came over


def test_killing_the_chunk_holder_mid_pd_hangs_no_request(cluster):
    """Issue 27 item 1 (stress battery, CI size): the holder actor is killed for good while PD requests
    run. Before the fix every request exported after the kill hung after its first token; now each
    ends with its tokens (the prefill replica resolves the holder again, or continues the request;
    a ticket whose chunks died with the holder is resumed by recomputing its KV) or an error event."""
    url = cluster.deploy("pd", pd="prefill=1,decode=1")

    def kill() -> None:
        ray.kill(ray.get_actor(HOLDER_NAME, namespace=cluster_app.NAMESPACE), no_restart=True)

    result = asyncio.run(run_holder_kill(url, kill, per_wave=4, max_tokens=24, kill_after_s=0.5, timeout_s=60))
    assert verdicts.holder_kill_failures(result) == [], result
    assert ray.get_actor(HOLDER_NAME, namespace=cluster_app.NAMESPACE) is not None  # resolved again by name
    assert cluster.complete("After the holder died,", 8)["choices"][0]["finish_reason"] == "length"


def test_several_declared_models_get_a_replica_set_each(cluster, reference):
    """Issue 44 item 7: `--replicas` with declared models: every model has its replicas, requests route by
    their `model` (prefix-aware routing per model: each model's deployment has its own router), /metrics
    and /v1/models say each model."""
    from cllm.config import ModelEntry, load_config
    from cllm.model_path import default_model_path

    gguf = str(default_model_path())
    config = load_config(None, environ={}).model_copy(update={"models": [
        ModelEntry(name="a", model=gguf), ModelEntry(name="b", model=gguf, aliases=["bee"])]})
    url = cluster.deploy("models", config=config)
    expected = greedy(reference, "The capital of France is", 8)
    for name, served in (("a", "a"), ("bee", "b"), ("b", "b")):
        reply = cluster.complete("The capital of France is", 8, model=name)
        assert reply["model"] == served and reply["choices"][0]["text"] == expected
    cards = {c["id"]: c for c in cluster.client.get(url + "/v1/models").json()["data"]}
    assert set(cards) == {"a", "b", "bee"} and all(c["status"] == "loaded" for c in cards.values())
    missing = cluster.client.post(url + "/v1/completions", json={"model": "c", "prompt": "x"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert {r.model for r in board_reports()} == {"a", "b"}

    def per_model_metrics() -> bool:
        text = cluster.client.get(url + "/metrics").text
        return all(f'cllm_generation_tokens_total{{model="{m}"}}' in text for m in ("a", "b"))
    wait_for(per_model_metrics, "each model's engine metrics", 30)

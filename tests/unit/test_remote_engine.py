"""The ingress side of a Ray Serve deployment (RemoteEngine) against fake deployment handles."""
from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import ray

from cllm.cluster.errors import ReplicaDiedError, ReplicaDrainingError
from cllm.cluster.remote_engine import RemoteEngine
from cllm.cluster.transport import HandoffTicket
from cllm.sampling.params import SamplingParams
from tests.unit.fakes import ByteTokenizer, fake_config


class FakeResponse:
    """A DeploymentResponseGenerator: items, or an exception to raise in their place."""

    def __init__(self, items: list) -> None:
        self.items = items
        self.cancelled = False

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        for item in self.items:
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """A DeploymentHandle whose methods answer from a script: method -> list of responses, in order."""

    def __init__(self, **script: list[list]) -> None:
        self.script = script
        self.calls: list[tuple[str, object]] = []
        self.responses: list[FakeResponse] = []

    def options(self, **_: object) -> FakeHandle:
        return self

    def __getattr__(self, method: str):
        handle = self

        class Method:
            def remote(self, arg: object) -> FakeResponse:
                handle.calls.append((method, arg))
                response = FakeResponse(handle.script[method].pop(0))
                handle.responses.append(response)
                return response
        return Method()


def engine(engines: FakeHandle, decoders: FakeHandle | None = None) -> RemoteEngine:
    info = {"max_model_len": 4096, "model_name": "fake", "vocab_size": 64}
    return RemoteEngine(fake_config(), info, engines, decoders, board=None, tokenizer=ByteTokenizer())


async def collect(remote: RemoteEngine, **kwargs) -> list:
    return [out async for out in remote.generate([1, 2, 3], SamplingParams(max_tokens=4), **kwargs)]


def new_ticket() -> HandoffTicket:
    return HandoffTicket(snapshot=None, header=None, chunk_refs=[])  # the ingress only passes it on


async def test_a_handed_off_request_continues_on_the_decode_replicas():
    ticket = new_ticket()
    prefill, decode = FakeHandle(generate=[["o1", ticket]]), FakeHandle(resume=[["o2", "o3"]])
    queued = []
    assert await collect(engine(prefill, decode), on_queued=lambda: queued.append(1)) == ["o1", "o2", "o3"]
    assert queued == [1]
    call = prefill.calls[0][1]
    assert call.prefill_only and len(call.prefix_keys) == 0  # 3 tokens: no complete 16-token block
    assert decode.calls == [("resume", ticket)]


async def test_a_draining_replica_sends_the_request_on():
    ticket = new_ticket()
    engines = FakeHandle(generate=[[ReplicaDrainingError("draining")], ["o1", ticket]],
                         resume=[[ReplicaDrainingError("draining")], ["o2"]])
    assert await collect(engine(engines)) == ["o1", "o2"]
    assert [m for m, _ in engines.calls] == ["generate", "generate", "resume", "resume"]
    assert not engines.calls[0][1].prefill_only  # colocated


async def test_draining_after_output_and_a_dead_replica_fail_the_request():
    engines = FakeHandle(generate=[["o1", ReplicaDrainingError("draining")]])
    with pytest.raises(ReplicaDrainingError):
        await collect(engine(engines))
    engines = FakeHandle(generate=[["o1", ray.exceptions.RayActorError()]])
    with pytest.raises(ReplicaDiedError, match="died"):
        await collect(engine(engines))
    assert engines.responses[0].cancelled  # the replica's stream is cancelled when ours ends early


async def test_bad_input_fails_before_anything_is_routed():
    engines = FakeHandle(generate=[])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        async for _ in engine(engines).generate([99], SamplingParams(max_tokens=4)):
            pass
    assert engines.calls == []


async def test_a_hand_off_whose_transfer_broke_off_is_resumed_on_the_same_ticket():
    ticket = new_ticket()
    broken = ray.exceptions.RayTaskError("resume", "traceback", ConnectionError("chunk fetch failed"))
    prefill, decode = FakeHandle(generate=[["o1", ticket]]), FakeHandle(resume=[[broken], ["o2"]])
    assert await collect(engine(prefill, decode)) == ["o1", "o2"]
    first, second = (arg for _, arg in decode.calls)
    assert first is second and second.prefix_keys == prefill.calls[0][1].prefix_keys  # routed like the first
    # Before any hand-off, the same error is the request's own: it is raised, not retried.
    engines = FakeHandle(generate=[[broken]])
    with pytest.raises(ray.exceptions.RayTaskError):
        await collect(engine(engines))
    assert len(engines.calls) == 1


class AwaitingHandle:
    """A DeploymentHandle whose unary method (embed) answers with ``result`` or raises it."""

    def __init__(self, result: object) -> None:
        self.result = result
        self.calls: list[object] = []

    def __getattr__(self, method: str):
        handle = self

        class Method:
            def remote(self, arg: object):
                handle.calls.append(arg)

                async def answer():
                    if isinstance(handle.result, BaseException):
                        raise handle.result
                    return handle.result
                return answer()
        return Method()


async def test_embed_maps_replica_errors_like_generate():
    """Issue 27 item 10: embed was defined twice and the one that won passed Ray's errors through
    (HTTP 500); a replica's bad-input error must be a 400 and a dead replica a 503."""
    from cllm.server.errors import engine_error

    bad = ray.exceptions.RayTaskError("embed", "traceback", ValueError("input 0: too long for the embedder"))
    with pytest.raises(ValueError, match="too long") as caught:
        await engine(AwaitingHandle(bad)).embed(["a red apple"])
    assert engine_error(caught.value).status == 400
    with pytest.raises(ReplicaDiedError) as caught:
        await engine(AwaitingHandle(ray.exceptions.RayActorError())).embed(["a red apple"])
    assert engine_error(caught.value).status == 503
    handle = AwaitingHandle(["vector"])
    remote = engine(handle)
    assert await remote.embed("ab") == ["vector"]
    assert handle.calls == [[remote.tokenize_prompt("ab")]]  # tokenised at the ingress: the replica gets token ids
    with pytest.raises(ValueError):  # bad input fails before anything is sent
        await engine(handle).embed([])
    assert len(handle.calls) == 1
    assert _methods_defined(RemoteEngine).count("embed") == 1


def _methods_defined(cls: type) -> list[str]:
    """The names of every method in the class body's source, a name defined twice counted twice (the
    class dict keeps only the last definition, so it cannot show a duplicate)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    return [node.name for node in body.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


async def test_a_refused_hand_off_is_never_routed_to_the_refusing_replica_again():
    """Issue 27 item 4: a draining replica's ticket names it (avoid_replicas), and each replica that
    refuses the resume as draining is added, so the router never picks them for it."""
    ticket = new_ticket()
    ticket.avoid_replicas = frozenset({"a"})  # the draining replica it left
    refused = ReplicaDrainingError("draining", replica="b")
    engines = FakeHandle(generate=[["o1", ticket]], resume=[[refused], ["o2"]])
    assert await collect(engine(engines)) == ["o1", "o2"]
    resumed = [arg for method, arg in engines.calls if method == "resume"]
    assert resumed[-1].avoid_replicas == {"a", "b"}


async def test_a_ticket_no_replica_took_is_released_at_the_ingress():
    """Issue 27 item 6: a hand-off whose resume failed before any replica took it (here: the
    request was sent on too often) releases its chunks instead of leaving them to the holder."""
    released = []

    class Holder:
        def release(self, transfer_id: str) -> None:
            released.append(transfer_id)

    from cllm.handoff.transfer import TransferHeader
    ticket = HandoffTicket(snapshot=None, header=TransferHeader("r/1", (4,), 4), chunk_refs=[])
    draining = [[ReplicaDrainingError("draining")] for _ in range(8)]
    engines = FakeHandle(generate=[["o1", ticket]], resume=draining)
    remote = RemoteEngine(fake_config(), {"max_model_len": 4096, "model_name": "fake", "vocab_size": 64}, engines,
                          None, board=None, tokenizer=ByteTokenizer(), holder=Holder())
    with pytest.raises(Exception, match="sent on more than"):
        await collect(remote)
    assert released == ["r/1"]

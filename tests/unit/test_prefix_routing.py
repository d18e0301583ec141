"""Prefix keys and the prefix-affinity routing decision (no Ray needed)."""
from __future__ import annotations

import asyncio

import pytest

from cllm.cluster.affinity import AffinityTable, rank
from cllm.cluster.prefix import prefix_keys


def test_keys_are_chained_per_complete_block():
    a = prefix_keys(list(range(40)), 16)
    assert len(a) == 2  # 8 trailing tokens form no complete block
    b = prefix_keys(list(range(32)) + [99] * 8, 16)
    assert b == a  # same first 32 tokens, same keys
    c = prefix_keys([1000] + list(range(1, 40)), 16)
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later key
    with pytest.raises(ValueError, match="block_tokens"):
        prefix_keys([1], 0)


def test_holder_of_the_longest_prefix_wins_unless_overloaded():
    table = AffinityTable()
    shared = list(range(64))
    table.record(prefix_keys(shared[:32], 16), "r1")
    table.record(prefix_keys(shared, 16), "r2")  # r2 got the longer prompt later
    keys = prefix_keys(shared + [7] * 16, 16)
    assert table.longest_match(keys, {"r1", "r2"}) == ("r2", 4)
    assert rank(keys, {"r1": 0, "r2": 3}, table, max_imbalance=4) == [["r2"], ["r1"]]
    assert rank(keys, {"r1": 0, "r2": 5}, table, max_imbalance=4) == [["r1", "r2"]]  # overloaded: least-loaded
    # Each key has one owner, the replica that got it last: r2 took the first blocks over from r1.
    assert table.longest_match(keys, {"r1"}) == (None, 0)
    assert rank(keys, {"r1": 2}, table, max_imbalance=4) == [["r1"]]


def test_unknown_prompt_goes_least_loaded_and_dead_replicas_are_forgotten():
    table = AffinityTable()
    keys = prefix_keys(list(range(32)), 16)
    assert rank(keys, {"a": 3, "b": 1, "c": 2}, table, max_imbalance=4) == [["b", "c", "a"]]
    table.record(keys, "a")
    table.forget("a")
    assert len(table) == 0 and table.longest_match(keys, {"a"}) == (None, 0)
    assert rank(keys, {}, table, max_imbalance=0) == []


def test_table_is_bounded():
    table = AffinityTable(max_keys=3)
    table.record(prefix_keys(list(range(80)), 16), "a")  # 5 keys
    assert len(table) == 3


def test_replica_stats_aggregate_as_one_engine():
    from cllm.cluster.stats_board import aggregate
    from cllm.engine.stats import EngineStats

    def stats(running: int, kv: float, hits: int, finished: dict[str, int]) -> EngineStats:
        return EngineStats(num_running=running, num_waiting=1, num_preempted=0, slots_in_use=running, slots_total=4,
                           kv_usage=kv, prefix_cache_queried_tokens=100, prefix_cache_hit_tokens=hits,
                           prompt_tokens_total=50, generation_tokens_total=70, num_preemptions=0, tokens_per_s=10.0,
                           requests_finished=finished)

    total = aggregate([stats(2, 0.5, 40, {"stop": 1}), stats(1, 0.25, 10, {"stop": 2, "length": 1})])
    assert (total.num_running, total.num_waiting, total.slots_total, total.generation_tokens_total) == (3, 2, 8, 140)
    assert total.kv_usage == 0.375 and total.prefix_cache_hit_rate == 0.25 and total.tokens_per_s == 20.0
    assert total.requests_finished == {"stop": 3, "length": 1}
    assert aggregate([]) is None


def test_pd_setting_is_validated_with_the_bad_value_named():
    from cllm.config import load_config, parse_pd

    assert parse_pd("prefill=2, decode=3") == (2, 3)
    assert load_config(environ={}, pd="prefill=1,decode=1").cluster.pd == "prefill=1,decode=1"
    for bad in ("prefill=1", "prefill=0,decode=1", "prefill=a,decode=1", "prefill=1,decode=1,extra=2"):
        with pytest.raises(ValueError, match="pd="):
            load_config(environ={}, pd=bad)
    with pytest.raises(ValueError, match="replicas"):
        load_config(environ={}, replicas=0)


# ------------------------------------------------- the Ray Serve router itself (issue 27 items 4, 5)
def _router(*replicas):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from cllm.cluster.router import PrefixAffinityRouter

    router = PrefixAffinityRouter(deployment_id=DeploymentID(name="cllm-engine"),
                                  handle_source=DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=False)
    router.initialize_state(max_imbalance=100)
    # Probes always answer in time, however loaded the machine: a late answer would send a request
    # down its next rank and make the routing tests depend on timing.
    router.queue_len_response_deadline_s = router.max_queue_len_response_deadline_s = 10.0
    router.update_replicas(list(replicas))
    return router


def _pending(call, n: int):
    from ray.serve._private.common import RequestMetadata
    from ray.serve._private.request_router.common import PendingRequest

    return PendingRequest(args=[call], kwargs={}, metadata=RequestMetadata(request_id=f"req-{n}",
                                                                           internal_request_id=f"internal-{n}"))


def _replica(name: str, probe_s: float = 0.0):
    from ray.serve._private.test_utils import FakeRunningReplica

    replica = FakeRunningReplica(name, sleep_time_s=probe_s)
    replica.set_queue_len_response(0)
    return replica


async def test_each_pending_request_gets_the_replica_chosen_for_it():
    """Several requests pending at once: A's prefix is on r1 (whose queue-length probe answers
    later), B's and C's on r2. With FIFOMixin the replica chosen for B went to A, the oldest pending
    request, and r1 then to B: each request landed where the other's prefix was cached."""
    from types import SimpleNamespace

    r1, r2 = _replica("r1", probe_s=0.05), _replica("r2")
    router = _router(r1, r2)
    prompts = {"a": list(range(32)), "b": list(range(100, 132)), "c": list(range(100, 148))}
    router._table.record(prefix_keys(prompts["a"], 16), r1.replica_id)
    router._table.record(prefix_keys(prompts["b"], 16), r2.replica_id)
    calls = [SimpleNamespace(prefix_keys=prefix_keys(prompts[name], 16)) for name in ("a", "b", "c", "a")]
    chosen = await asyncio.wait_for(asyncio.gather(*(router._choose_replica_for_request(_pending(call, n))
                                                      for n, call in enumerate(calls))), 10)
    assert [r.replica_id.unique_id for r in chosen] == ["r1", "r2", "r2", "r1"]


async def test_a_request_is_never_routed_to_a_replica_it_avoids():
    """A drained request's ticket keeps its prefix keys, which name the draining replica (now the
    least loaded too): it must go elsewhere, and wait rather than go back when nothing else is there."""
    from types import SimpleNamespace

    r1, r2 = _replica("r1"), _replica("r2")
    router = _router(r1, r2)
    keys = prefix_keys(list(range(48)), 16)
    router._table.record(keys, r1.replica_id)
    ticket = SimpleNamespace(prefix_keys=keys, avoid_replicas=frozenset({"r1"}))
    ranks = await router.choose_replicas([r1, r2], _pending(ticket, 0))
    assert [[r.replica_id.unique_id for r in tier] for tier in ranks] == [["r2"]]
    assert await router.choose_replicas([r1], _pending(ticket, 1)) == []


async def test_in_flight_counts_only_routed_requests_and_each_once():
    r1, r2 = _replica("r1"), _replica("r2")
    router = _router(r1, r2)
    routed = _pending(SimpleCall(), 0)
    router.on_request_routed(routed, r1.replica_id, None)
    # Serve reports completion for every request it sent, also one r1 rejected (never routed):
    router.on_request_completed(r1.replica_id, "internal-9")
    assert router._in_flight[r1.replica_id] == 1
    router.on_request_completed(r2.replica_id, "internal-0")  # not where it was routed: ignored
    assert router._in_flight[r1.replica_id] == 1
    router.on_request_completed(r1.replica_id, "internal-0")
    router.on_request_completed(r1.replica_id, "internal-0")  # reported twice: counted out once
    assert router._in_flight[r1.replica_id] == 0 and router._routed == {}


class SimpleCall:
    prefix_keys = ()

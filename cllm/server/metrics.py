"""Prometheus metrics of one app: its own CollectorRegistry, no process-global state.

Latency histograms and per-status request counts are observed by the server as
requests finish; engine state (queue depths, slots, KV, prefix cache, token
totals) is read from ``engine.stats()`` at scrape time so it is never stale.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from cllm.outputs import RequestMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class EngineStatsCollector(Collector):
    """Exports each loaded model's ``engine.stats()`` at scrape time, labelled by model; nothing for a model
    that is not loaded."""

    def __init__(self, stats: Callable[[], list[tuple[str, Any]]]) -> None:
        self._stats = stats

    def describe(self) -> Iterable[Metric]:
        # Names are fixed; an empty description keeps registration from calling collect().
        return []

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for model, stats in self._stats():
            for name, doc, kind, value in _engine_samples(stats):
                family = families.get(name)
                if family is None:
                    family = families[name] = kind(name, doc, labels=["model"])
                family.add_metric([model], float(value))
            finished = families.get("cllm_engine_requests_finished")
            if finished is None:
                finished = families["cllm_engine_requests_finished"] = CounterMetricFamily(
                    "cllm_engine_requests_finished", "Engine requests finished, by finish reason",
                    labels=["model", "finish_reason"])
            for reason, count in sorted(stats.requests_finished.items()):
                finished.add_metric([model, reason], float(count))
        yield from families.values()


def _engine_samples(s: Any) -> Iterable[tuple[str, str, type, float]]:
    """(name, help, family type, value) of one engine's stats."""
    gauges = {
        "cllm_num_requests_running": ("Requests being generated", s.num_running),
        "cllm_num_requests_waiting": ("Requests waiting for a slot", s.num_waiting),
        "cllm_num_requests_preempted": ("Requests preempted, waiting to resume", s.num_preempted),
        "cllm_slots_in_use": ("Sequence slots holding a live request", s.slots_in_use),
        "cllm_slots_total": ("Sequence slots in the backend", s.slots_total),
        "cllm_kv_cache_usage_ratio": ("Fraction of KV cache used by live sequences", s.kv_usage),
        "cllm_prefix_cache_hit_rate": ("Prompt tokens served from prefix cache / prompt tokens asked", s.prefix_cache_hit_rate),
        "cllm_generation_tokens_per_second": ("Recent generation throughput", s.tokens_per_s),
        "cllm_spec_decode_acceptance_rate": ("Speculative decoding: accepted / proposed draft tokens", s.spec_acceptance_rate),
        "cllm_spec_decode_tokens_per_verify": ("Speculative decoding: tokens per verifying sequence-step", s.spec_tokens_per_verify),
    }
    if s.compute_threads is not None:  # llama.cpp only
        gauges["cllm_compute_threads"] = ("Threads llama_decode computes with now (fewer while other processes take the CPU)", s.compute_threads)
    for name, (doc, value) in gauges.items():
        yield name, doc, GaugeMetricFamily, value
    counters = {
        "cllm_prompt_tokens": ("Prompt tokens processed", s.prompt_tokens_total),
        "cllm_generation_tokens": ("Tokens generated", s.generation_tokens_total),
        "cllm_prefix_cache_queried_tokens": ("Prompt tokens looked up in the prefix cache", s.prefix_cache_queried_tokens),
        "cllm_prefix_cache_hit_tokens": ("Prompt tokens found in the prefix cache", s.prefix_cache_hit_tokens),
        "cllm_spec_decode_num_draft_tokens": ("Speculative decoding: draft tokens verified", s.spec_proposed_tokens),
        "cllm_spec_decode_num_accepted_tokens": ("Speculative decoding: draft tokens accepted", s.spec_accepted_tokens),
        "cllm_spec_decode_num_verify_steps": ("Speculative decoding: sequence-steps that verified drafts", s.spec_verify_steps),
        "cllm_spec_decode_num_emitted_tokens": ("Speculative decoding: tokens those steps produced", s.spec_emitted_tokens),
        "cllm_compute_threads_lowered": ("Times the llama.cpp thread governor took a thread away (CPU contention)", s.compute_threads_lowered),
    }
    for name, (doc, value) in counters.items():
        yield name, doc, CounterMetricFamily, value


class TokenGapHistogram(Collector):
    """``cllm_inter_token_latency_seconds``: a histogram observed many tokens at a time.

    The gap before an output of n tokens is observed n times (that much per token). Through
    prometheus_client's Histogram that was n observes per streamed output, each taking a lock:
    2.3 % of the API process's event loop at 256 streams (py-spy, benchmarks/engine_overhead.py).
    Here it is one bisect and two additions, on the event loop's thread (a scrape from another thread
    reads counts that may lag by one output)."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self._name, self._doc = name, doc
        self._bounds = buckets
        self._children: dict[str, _Gaps] = {}

    def labels(self, model: str) -> _Gaps:
        child = self._children.get(model)
        if child is None:
            child = self._children[model] = _Gaps(self._bounds)
        return child

    def describe(self) -> Iterable[Metric]:
        return [HistogramMetricFamily(self._name, self._doc, labels=["model"])]

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(self._name, self._doc, labels=["model"])
        for model, child in list(self._children.items()):
            counts, total = list(child.counts), child.sum
            cumulative, buckets = 0, []
            for bound, count in zip((*self._bounds, math.inf), counts):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            family.add_metric([model], buckets, sum_value=total)
        yield family


class _Gaps:
    """One model's token-gap counts: per bucket (the last one +Inf), and their sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count  # le: a value on a bound counts in it
        self.sum += value * count


class ServerMetrics:
    """The metrics of one server app."""

    def __init__(self, stats: Callable[[], Any | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._by_model: dict[str, ModelMetrics] = {}  # for_model's, one per served model name
        r = self.registry
        self.requests = Counter("cllm_requests", "Generation requests by final status", ["model", "status"], registry=r)
        self.http_responses = Counter(
            "cllm_http_responses", "HTTP responses by route and status code", ["route", "code"], registry=r
        )
        self.ttft = Histogram("cllm_time_to_first_token_seconds", "Arrival to first token", ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = TokenGapHistogram("cllm_inter_token_latency_seconds", "Gap between streamed tokens", _ITL_BUCKETS)
        r.register(self.itl)
        self.e2e = Histogram("cllm_e2e_request_latency_seconds", "Arrival to finish", ["model"], buckets=_E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("cllm_request_queue_time_seconds", "Arrival to first scheduled", ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        r.register(EngineStatsCollector(stats))

    def for_model(self, model: str) -> ModelMetrics:
        """The request metrics of one served model (their ``model`` label bound), made once per model:
        every request asks, and binding the labels was four locked lookups each."""
        bound = self._by_model.get(model)
        if bound is None:
            bound = self._by_model[model] = ModelMetrics(self, model)
        return bound

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)


class ModelMetrics:
    """A server's request metrics for one model: what a generation stream observes."""

    def __init__(self, metrics: ServerMetrics, model: str) -> None:
        self._requests = metrics.requests
        self._model = model
        self._ttft = metrics.ttft.labels(model=model)
        self._itl = metrics.itl.labels(model=model)
        self._e2e = metrics.e2e.labels(model=model)
        self._queue_time = metrics.queue_time.labels(model=model)

    def count_requests(self, status: str, n: int = 1) -> None:
        self._requests.labels(model=self._model, status=status).inc(n)

    def observe_finished(self, status: str, metrics: RequestMetrics) -> None:
        """One engine request reached its final status."""
        self.count_requests(status)
        if metrics.ttft is not None:
            self._ttft.observe(metrics.ttft)
        if metrics.queue_time is not None:
            self._queue_time.observe(metrics.queue_time)
        if metrics.e2e is not None:
            self._e2e.observe(metrics.e2e)

    def observe_tokens(self, gap_s: float, num_tokens: int) -> None:
        """``num_tokens`` arrived ``gap_s`` after the previous ones: that much per token."""
        self._itl.observe(gap_s / num_tokens, num_tokens)

"""Keep the cyclic garbage collector off the objects that live as long as the process, and from running
several times an engine step or a burst of requests."""
from __future__ import annotations

import gc


def freeze_live_objects() -> None:
    """Collect once, then move every object now alive out of the collector's reach (``gc.freeze``).

    A loaded model leaves a few hundred thousand long-lived objects (modules, the tokenizer, tensors'
    wrappers) that every full collection walked again: a 60-100 ms pause of the event loop or the
    engine loop, every so often, under load. Call it after start-up and again after a swap (it first
    gives the frozen objects back, so what the swap dropped can still be collected)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


GC_GEN0_THRESHOLD = 20_000  # net allocations between young-generation collections while an engine exists


def raise_gc_threshold() -> None:
    """Raise the cyclic GC's first threshold to GC_GEN0_THRESHOLD (never lower it, never turn it on).

    A step at 256 sequences allocates a few thousand short-lived objects (outputs, sampled tokens); at
    CPython's default of 700 allocations a collection ran several times a step and promoted the step's
    live objects to the older generations, whose full collections then walked the whole heap: 22 % of
    the engine's time (benchmarks/engine_overhead.py, greedy, 256 sequences: 1.90 -> 1.46 ms a step).
    The API process of an engine core (ProcessEngine) fares the same with each request's and each
    output's objects: at 256 streams over the CPU proxy it spent ~1.07 s of 15 in collections, full
    ones of up to 53 ms that stopped every stream; 0.43 s with this threshold, loop CPU per token 16.2 ->
    14.4 µs. The objects are freed by reference counting; a collection finds few cycles whenever it runs.

    20,000 rather than 5,000 (2026-12-02): at 256 streams the API process still spent ~0.5 s of every ~10 s
    in young collections (90-100 of gen0, 1.7-4 ms each, and 7-8 of gen1, up to ~50 ms each). The objects a
    collection walks are those of the requests in flight (a request's live ~0.7 s), so collecting a quarter
    as often walks far fewer of them: 15-17 gen0 collections of up to ~50 ms, no gen1, 0.14-0.34 s; the
    longest pause stays ~50 ms. With this session's other admission changes, the trees alternating at 256
    streams: loop CPU per streamed token 16.6 -> 15.3-15.5 µs, served ratio +0.01-0.02
    (benchmarks/results/gc_threshold_2026-12-02/). The engine's own step time did not change measurably
    (a step's objects die within the step)."""
    gen0, gen1, gen2 = gc.get_threshold()
    if 0 < gen0 < GC_GEN0_THRESHOLD:
        gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)

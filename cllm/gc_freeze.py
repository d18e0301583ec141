"""Keep the cyclic garbage collector off the objects that live as long as the process."""
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

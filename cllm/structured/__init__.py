"""Constrained decoding with xgrammar: the output of a constrained request always matches its
JSON schema / grammar / regex / choice list.

``GrammarCache`` compiles a constraint once per key (LRU); ``StructuredOutputs`` holds one
matcher per constrained sequence, fills the token bitmask of all constrained rows of a step
together (in a worker thread, overlapped with the forward pass) and masks the logits before
sampling. The engine calls only ``StructuredOutputs``.
"""
from __future__ import annotations

from cllm.structured.cache import GrammarCache
from cllm.structured.manager import StructuredOutputs

__all__ = ["GrammarCache", "StructuredOutputs"]

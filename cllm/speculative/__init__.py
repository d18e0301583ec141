"""Speculative decoding: draft tokens proposed cheaply, verified in the batch's forward pass.

A sequence chosen to speculate gets its draft tokens appended to its decode chunk
(``ScheduledChunk.draft``), so the backend evaluates them like any other tokens of the batch and
returns logits at every one of them. The engine then samples position by position exactly as it
would have one step at a time, and keeps tokens while they equal the draft (``LLMEngine._verify``):
the output is the target model's own. Rejected tokens' KV is dropped (``Backend.truncate``).

- ``ngram``: proposals from the sequence's own prompt and output (prompt lookup).
- ``draft_model``: proposals from a smaller model on the same backend.
- ``step_cost`` and ``planner``: how many draft tokens each sequence gets this step, from the
  measured cost of a step by its token count and each sequence's acceptance rate (none at all when
  a bigger step would lower the batch's expected tokens per second).
"""
from cllm.speculative.speculator import Speculator

__all__ = ["Speculator"]

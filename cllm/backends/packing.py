"""Pack embedding inputs into forward passes: consecutive runs within a token and an input budget."""
from __future__ import annotations

from collections.abc import Sequence


def pack_inputs(lengths: Sequence[int], *, max_tokens: int, max_inputs: int) -> list[range]:
    """Consecutive index ranges, each holding at most ``max_inputs`` inputs and ``max_tokens`` tokens.

    Input order is kept (results are stitched back by position). Every length must be in
    1..max_tokens; the caller checks that and names the offending input.
    """
    groups: list[range] = []
    start, tokens = 0, 0
    for i, n in enumerate(lengths):
        if not 1 <= n <= max_tokens:
            raise ValueError(f"input {i} has {n} tokens; an embedding input holds 1 to {max_tokens}")
        if i > start and (tokens + n > max_tokens or i - start >= max_inputs):
            groups.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    if len(lengths) > start:
        groups.append(range(start, len(lengths)))
    return groups

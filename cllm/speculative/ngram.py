"""Prompt-lookup proposals: the tokens that followed the sequence's last n-gram where it occurred before."""
from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """Where each n-gram of one sequence last ended, for n in [n_min, n_max]; extended incrementally.

    Each lookup first indexes the n-grams ending at positions it has not seen (all but the current
    tail, which is the query), so the work per step is O(new tokens), not O(sequence length).
    """

    def __init__(self, n_min: int, n_max: int) -> None:
        self._tables: list[tuple[int, dict[tuple[int, ...], int]]] = [(n, {}) for n in range(n_max, n_min - 1, -1)]
        self._tokens: list[int] = []  # the sequence as far as seen (its prompt, then its output)
        self._next_end = 1  # n-grams ending before this position are indexed
        self.matched = 0  # n of the n-gram the last proposal followed (0: none matched)

    def propose(self, prompt: Sequence[int], k: int, output: Sequence[int] = ()) -> list[int]:
        """Up to ``k`` tokens that followed the longest n-gram equal to the sequence's last n tokens (the
        sequence: ``prompt`` then ``output``, each only ever growing), at its most recent earlier
        occurrence; [] when none matches. Only the tokens added since the last call are copied."""
        tokens = self._tokens
        if len(tokens) < len(prompt):
            tokens += prompt[len(tokens):]
        if output:
            tokens += output[len(tokens) - len(prompt):]
        length = len(tokens)
        for end in range(self._next_end, length):
            for n, table in self._tables:
                if end >= n:
                    table[tuple(tokens[end - n:end])] = end
        self._next_end = max(self._next_end, length)
        for n, table in self._tables:
            if length >= n:
                end = table.get(tuple(tokens[length - n:]))
                if end is not None:
                    self.matched = n
                    return _continuation(tokens, end, k)
        self.matched = 0
        return []


def _continuation(tokens: list[int], end: int, k: int) -> list[int]:
    """The ``k`` tokens after position ``end``, where the sequence's tail matched. A match less than
    ``k`` tokens back (a list or a pattern that repeats) runs out at the sequence's end: the draft
    then goes on repeating what followed the match, period ``len(tokens) - end``, as the sequence
    itself would if the pattern holds (a repeating list drafted only one period, 6 tokens a step,
    where 24 were accepted once it repeats)."""
    draft = tokens[end:end + k]
    period = len(draft)
    while len(draft) < k:
        draft.append(draft[len(draft) - period])
    return draft

"""How long a step takes by its token count and its context length, as measured on this machine and backend."""
from __future__ import annotations

from collections import deque
from statistics import median

# Steps remembered per bucket. A median, not a moving average: a step that includes one-off work (the
# first decode of a shape allocates llama.cpp's compute buffers; measured 2 s against 12 ms) must not
# set the cost for hundreds of steps after it.
WINDOW = 15
CONTEXT_UNIT = 128  # context classes: < 128 tokens, 128-255, 256-511, ... (see StepCost)


class _Curve:
    """Seconds per step of one context class as a function of the tokens in it: per power-of-two bucket of
    token counts, the median count and median seconds of its last WINDOW steps, interpolated linearly
    between buckets and extended with the last slope. It answers None until two buckets are measured."""

    def __init__(self) -> None:
        self._steps: dict[int, deque[tuple[int, float]]] = {}  # bucket (bit length of the count) -> (tokens, seconds)
        self._sorted: list[tuple[float, float]] | None = None  # (tokens, seconds) by tokens, made monotone

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        bucket = num_tokens.bit_length()
        steps = self._steps.get(bucket)
        if steps is None:
            steps = self._steps[bucket] = deque(maxlen=WINDOW)
        steps.append((num_tokens, seconds))
        self._sorted = None

    @property
    def known(self) -> bool:
        return len(self._steps) >= 2

    def seconds(self, num_tokens: int) -> float | None:
        """Expected seconds of a step of ``num_tokens`` tokens; None while fewer than two buckets are known."""
        if not self.known:
            return None
        points = self._sorted
        if points is None:
            points, top = [], 0.0
            for bucket in sorted(self._steps):  # a bigger step never counts as cheaper (timing noise)
                steps = self._steps[bucket]
                top = max(top, median(s for _, s in steps))
                points.append((median(n for n, _ in steps), top))
            self._sorted = points
        i = 1
        while i < len(points) - 1 and num_tokens > points[i][0]:
            i += 1
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        line = y0 + (y1 - y0) / (x1 - x0) * (num_tokens - x0)
        if num_tokens < x0:
            # Below the first measured count the first slope can run under 0 (a steep curve measured at
            # 4 and 20 tokens, a 1-token step asked for); a step costs at least its share of a measured
            # one (the cost per token falls with the count).
            return max(line, y0 * max(num_tokens, 0) / x0)
        return max(0.0, line)


class StepCost:
    """Seconds per step by its token count, one curve (``_Curve``) per context class: the longest
    context among the step's sequences, in powers of two from CONTEXT_UNIT tokens. The tokens of a
    step attend to all of their sequence's context, so a verification's cost grows with it: measured on
    the embedded model (2 threads, AVX-512 EPYC, flash attention on), an 8-token step cost 4x a
    1-token one at 1,024 tokens of context (43 vs 11 ms), where at 64 tokens a step of 13 cost ~2x.
    One curve for all contexts priced a long document's drafts by the short chats before it. A class not
    yet measured borrows the curve of the nearest measured one (the longer one on a tie: never cheaper)."""

    def __init__(self) -> None:
        self._curves: dict[int, _Curve] = {}  # context class -> its curve

    def observe(self, num_tokens: int, seconds: float, context: int = 0) -> None:
        """A step of ``num_tokens`` tokens whose longest sequence reached ``context`` tokens took ``seconds``."""
        cls = context_class(context)
        curve = self._curves.get(cls)
        if curve is None:
            curve = self._curves[cls] = _Curve()
        curve.observe(num_tokens, seconds)

    def seconds(self, num_tokens: int, context: int = 0) -> float | None:
        """Expected seconds of a step of ``num_tokens`` tokens at ``context`` tokens of context; None while no
        context class has two token buckets measured."""
        cls = context_class(context)
        curve = self._curves.get(cls)
        if curve is None or not curve.known:
            known = [c for c, k in self._curves.items() if k.known]
            if not known:
                return None
            curve = self._curves[min(known, key=lambda c: (abs(c - cls), -c))]
        return curve.seconds(num_tokens)


def context_class(context: int) -> int:
    """0 below CONTEXT_UNIT tokens, then one class per doubling."""
    return (max(context, 0) // CONTEXT_UNIT).bit_length()

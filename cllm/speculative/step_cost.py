"""How long a step takes by its token count, as measured on this machine and backend."""
from __future__ import annotations

# Weight of the newest step in a bucket's moving average.
SMOOTHING = 0.1


class StepCost:
    """Seconds per step as a function of the tokens in it: a moving average per power-of-two bucket of
    token counts (the mean count and the mean seconds of the steps that fell in it), interpolated
    linearly between buckets and extended with the last slope. It answers None until two buckets
    are measured."""

    def __init__(self) -> None:
        self._points: dict[int, list[float]] = {}  # bucket (bit length of the count) -> [mean tokens, mean seconds]
        self._sorted: list[tuple[float, float]] | None = None  # (tokens, seconds) by tokens, made monotone

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        point = self._points.get(num_tokens.bit_length())
        if point is None:
            self._points[num_tokens.bit_length()] = [float(num_tokens), seconds]
            self._sorted = None
            return
        point[0] += SMOOTHING * (num_tokens - point[0])
        point[1] += SMOOTHING * (seconds - point[1])
        self._sorted = None

    def seconds(self, num_tokens: int) -> float | None:
        """Expected seconds of a step of ``num_tokens`` tokens; None while fewer than two buckets are known."""
        if len(self._points) < 2:
            return None
        points = self._sorted
        if points is None:
            points, top = [], 0.0
            for bucket in sorted(self._points):  # a bigger step never counts as cheaper (timing noise)
                x, y = self._points[bucket]
                top = max(top, y)
                points.append((x, top))
            self._sorted = points
        i = 1
        while i < len(points) - 1 and num_tokens > points[i][0]:
            i += 1
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        return max(0.0, y0 + (y1 - y0) / (x1 - x0) * (num_tokens - x0))

"""One worker's step time as `fixed + per_sample · b`, fitted online from measured steps.

The shape (fixed to per-sample time) comes from a robust regression over the steps since
the worker's speed last changed; the level follows those steps' median. Where the speed
holds, the level is the median of up to `window` steps, so step-to-step noise moves it
little; where it changes, a change detector cuts the history there, and the level and
the shape follow the new speed alone: mixed into one regression, the two speeds give a
line that fits neither (a worker that turned 4x slower was read as 143 ms of fixed time
a pass, and its share went to zero, where a third of the batch was right).

numpy-free (plain Python floats): the balancer refits at every re-balance, inside
training, on a few dozen numbers, where numpy's per-call cost dominates.
"""
from __future__ import annotations

import math
import statistics
from collections import deque

# a level shift counts as a change of speed when the median of the last `recent` steps is
# this many standard errors of the difference from the median of the steps before them
# (since the last change): a false alarm only shortens the level's history for a while
CHANGE_Z = 3.0
MEDIAN_SE = 1.2533  # standard error of a median of n normal draws: 1.2533 · σ / √n


def theil_sen(x, y) -> tuple[float, float]:
    """Theil–Sen line (slope: median of pairwise slopes over pairs with distinct x;
    intercept: median(y) − slope·median(x)), as `scipy.stats.theilslopes` computes it.
    Written out in plain Python floats: it runs at every re-balance inside training on a
    few dozen points, where scipy's also computes confidence intervals and numpy's
    per-call cost dominates."""
    x, y = list(x), list(y)
    slopes = [(y[j] - y[i]) / (x[j] - x[i]) for i in range(len(x)) for j in range(i + 1, len(x)) if x[j] != x[i]]
    if not slopes:
        return float("nan"), float("nan")
    slope = statistics.median(slopes)
    return slope, statistics.median(y) - slope * statistics.median(x)


class StepTimeModel:
    """One worker's compute time per step as `fixed + per_sample · b`, fitted online.

    - The shape comes from a Theil–Sen regression (median of pairwise slopes; it
      tolerates ~29% outliers) over the steps since the last change of speed (at most
      `window`), refitted only when their batch sizes are spread enough to identify a
      slope (max − min ≥ max(2, 20% of the median)); otherwise the last identified line
      is held (settled shares leave one batch size). Before any, the fixed part is 0; a
      slope ≤ 0 (a GPU far from busy) reads as 90% fixed time.
    - The level scales both parts by the median of measured / predicted time over the
      steps since the last change (at least `recent`, at most `window`). So the model
      passes through the current operating point (shares that equalise predicted times
      equalise measured ones, whatever error the shape has), and one disturbed step does
      not move it.
    - A change of speed: the median of the last `recent` ratios differs from the median
      of the ratios before them by more than `CHANGE_Z` standard errors (from `noise`).
      Or every one of them lies beyond every earlier one (a change the noise estimate,
      inflated by it, would hide). The history is cut to the steps that moved that median
      (⌈recent/2⌉): the level follows within `recent`/2 + 1 steps without overshoot, and
      the shape is held until steps of the new speed identify their own (a regression
      over both speeds fits neither).
    - `noise`: the step-to-step noise of measured / fitted time, from successive
      differences (a change of speed moves one difference, not their median), and
      `level_error`, the relative standard error of the level it gives."""

    def __init__(self, window: int = 16, recent: int = 5, min_spread: float = 0.2):
        self.obs: deque[tuple[int, float]] = deque(maxlen=window)
        self.recent = recent
        self.min_spread = min_spread
        self.since = 0  # observations since the last change of speed (capped at the window)
        self.line: tuple[float, float] | None = None  # last identified (fixed s, per-sample s)
        self.how = "none"  # none | proportional | regression | held
        self.noise = 0.0  # step-to-step noise of measured / fitted time (relative; robust, see fit)
        self.span = 0  # steps the level is the median of

    def add(self, samples: int, seconds: float) -> None:
        if samples > 0 and math.isfinite(seconds) and seconds > 0:
            self.obs.append((int(samples), float(seconds)))
            self.since = min(self.since + 1, len(self.obs))

    @property
    def level_error(self) -> float:
        """Relative standard error of the level (its median over `span` steps)."""
        return MEDIAN_SE * self.noise / math.sqrt(self.span) if self.span else 0.0

    def _identifiable(self, b: list[int]) -> bool:
        return len(b) >= 3 and (max(b) - min(b)) >= max(2.0, self.min_spread * statistics.median(b))

    def _shape(self, b: list[int], t: list[float]) -> None:
        if self._identifiable(b):
            slope, intercept = theil_sen(b, t)
            if math.isfinite(slope) and slope > 0 and math.isfinite(intercept):
                self.line = (max(0.0, float(intercept)), float(slope))
            elif math.isfinite(slope):  # flat (or noise sloping down): mostly fixed time
                med_t, med_b = statistics.median(t), statistics.median(b)
                self.line = (0.9 * med_t, 0.1 * med_t / med_b)
            self.how = "regression"
        else:
            self.how = "held" if self.line is not None else "proportional"

    def _changed(self, r: list[float]) -> bool:
        """The last `recent` ratios' median left the earlier ones' (since the last change)."""
        n = min(self.since, len(r))
        if n <= self.recent:
            return False
        short, older = r[-self.recent:], r[-n:-self.recent]
        if len(older) >= self.recent and (min(short) > max(older) or max(short) < min(older)):
            return True  # every recent step beyond every earlier one, whatever the noise reads
        base = statistics.median(older)
        se = MEDIAN_SE * self.noise * base * math.sqrt(1 / len(short) + 1 / len(older))
        return abs(statistics.median(short) - base) > CHANGE_Z * se

    def _line(self, b: list[int], t: list[float]) -> tuple[float, float]:
        """The identified line, or before any, proportional: the recent median per sample."""
        if self.line is not None:
            return self.line
        return 0.0, statistics.median(y / x for x, y in zip(b[-self.recent:], t[-self.recent:]))

    def _ratios(self, b: list[int], t: list[float]) -> list[float]:
        fixed, per = self._line(b, t)
        return [y / (fixed + per * x) if fixed + per * x > 0 else 1.0 for x, y in zip(b, t)]

    def fit(self) -> tuple[float, float]:
        """(fixed seconds, seconds per sample); (nan, nan) before any observation. The
        change is looked for under the line held so far, before the regression, so steps
        of the old speed never enter the new speed's shape."""
        if not self.obs:
            self.how = "none"
            return float("nan"), float("nan")
        b, t = [o[0] for o in self.obs], [o[1] for o in self.obs]
        r = self._ratios(b, t)
        # noise: 1.4826 · median |Δr| / √2 over the window, relative to the ratios' median
        d = [abs(q - p) for p, q in zip(r, r[1:])]
        self.noise = 1.0484 * statistics.median(d) / statistics.median(r) if len(d) >= 2 else 0.0
        if self._changed(r):
            self.since = -(-self.recent // 2)
        before = self.line
        if self.since >= min(3, len(b)):  # the steps since the change identify their own shape
            self._shape(b[-self.since:], t[-self.since:])
        elif self.line is None:  # a change before any shape: the whole window's is the best guess
            self._shape(b, t)
        else:  # too few steps of a new speed: the held shape, at the new level
            self.how = "held"
        if self.line != before:
            r = self._ratios(b, t)
        fixed, per = self._line(b, t)
        self.span = min(len(r), max(self.since, self.recent))
        scale = statistics.median(r[-self.span:])
        if not (math.isfinite(scale) and scale > 0):
            scale = 1.0
        return fixed * scale, max(per * scale, 1e-12)

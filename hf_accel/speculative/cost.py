"""How long a target pass over `T` input tokens takes: a default shape refined online by measured passes.

Drafters size their proposals by expected tokens per second of target time, so they need the cost of a pass over
`batch_size * (nodes + 1)` tokens relative to a plain decoding pass. That curve depends on the hardware, the thread
count and, on shared machines, on the load (issue 6 measured, on 2 idle cores: 1.0 at one token, 1.3-1.45 for 2-16,
2.0 at 32, 4.1 at 64; on the same cores shared with other jobs, 16 tokens cost about 2x). So the engine reports the
wall time of every verification pass ([`VerifyResult.pass_seconds`]: forward, acceptance, commit and cache
rollback, so per-row work such as sampled acceptance counts too) and [`PassCostModel`] keeps the last few times of
each token count. A count's estimate is the median of its times once it has [`PassCostModel.min_samples`] of them;
before that it is interpolated between the nearest such counts on either side, or scaled from the nearest one by the
default shape. One slow pass (a page fault, another process's burst) at a count the drafter then avoids would
otherwise price that count for good: a moving average of one 241 ms pass at 5 tokens, against 31 ms at 4, kept the
default model's trees off 5 tokens for the rest of a session-28 run.
"""

import itertools
import statistics
from collections import deque


DEFAULT_VERIFY_COST = ((1, 1.0), (2, 1.3), (16, 1.45), (32, 2.0), (64, 4.1))


def interpolate_cost(num_tokens: int, points) -> float:
    """Piecewise-linear interpolation of `(tokens, cost)` points, extrapolated linearly past the last one, flat if the
    last segment falls (one point: a constant cost)."""
    points = sorted(points)
    if num_tokens <= points[0][0] or len(points) == 1:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if num_tokens <= x1:
            return y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + max(y1 - y0, 0.0) * (num_tokens - x1) / (x1 - x0)  # never falling: a noisy dip would reach 0


def check_cost_points(points) -> tuple:
    """`(tokens, cost)` points of a cost curve: at least one, distinct positive token counts, positive costs."""
    points = tuple((int(n), float(c)) for n, c in points)
    counts = [n for n, _ in points]
    if not points or len(set(counts)) != len(counts) or min(counts) < 1 or min(c for _, c in points) <= 0:
        raise ValueError(
            f"a pass cost curve needs (tokens, cost) points with distinct tokens >= 1 and costs > 0: {points}"
        )
    return points


class PassCostModel:
    """Cost of a target pass as a function of its input tokens, learned from observed pass times.

    Args:
        default_points (`tuple`, *optional*): `(tokens, relative cost)` points of the default shape.
        window (`int`, *optional*, defaults to 5): times kept per token count (the most recent ones).
        min_samples (`int`, *optional*, defaults to 3): times a count needs before its median is its estimate.
        adaptive (`bool`, *optional*, defaults to `True`): learn from observations (`False`: the default shape only).
    """

    def __init__(
        self, default_points=DEFAULT_VERIFY_COST, window: int = 5, min_samples: int = 3, adaptive: bool = True
    ):
        if not 1 <= min_samples <= window:
            raise ValueError(f"PassCostModel needs 1 <= min_samples <= window, got {min_samples} and {window}")
        self.default_points = check_cost_points(default_points)
        self.window, self.min_samples = window, min_samples
        self.adaptive = adaptive
        self.observed: dict[int, deque] = {}
        self._estimates = None  # `estimates()` until the next observation: a tree's width asks `cost` 17 times

    def observe(self, num_tokens: int, seconds: float) -> None:
        if not self.adaptive or seconds <= 0:
            return
        self.observed.setdefault(num_tokens, deque(maxlen=self.window)).append(seconds)
        self._estimates = None

    def estimates(self) -> dict[int, float]:
        """The median time of each token count with [`min_samples`] times (of every count observed, while none has)."""
        estimates = self._estimates
        if estimates is None:
            # a snapshot: a drafter serving `generate` calls in several threads observes a new pass size meanwhile,
            # and a scan failed with 'dictionary changed size during iteration'
            times = {n: list(t) for n, t in self.observed.copy().items()}
            settled = {n: t for n, t in times.items() if len(t) >= self.min_samples}
            estimates = self._estimates = {n: statistics.median(t) for n, t in (settled or times).items() if t}
        return estimates

    def cost(self, num_tokens: int) -> float:
        """Estimated cost (seconds once anything was observed, default units before)."""
        observed = self.estimates()
        if num_tokens in observed:
            return observed[num_tokens]
        default = interpolate_cost(num_tokens, self.default_points)
        if not observed:
            return default
        below = max((n for n in observed if n < num_tokens), default=None)
        above = min((n for n in observed if n > num_tokens), default=None)
        if below is not None and above is not None:  # between two measured counts: on the line joining them
            return interpolate_cost(num_tokens, [(below, observed[below]), (above, observed[above])])
        nearest = below if above is None else above
        return default / interpolate_cost(nearest, self.default_points) * observed[nearest]

    def needs_anchor(self, num_tokens: int) -> bool:
        """Whether a pass over `num_tokens` (a plain decoding pass) was never measured: worth one exploration."""
        return self.adaptive and num_tokens not in self.observed


class AcceptanceCalibrator:
    """Maps a drafter's node score and depth to the observed probability that such a node is accepted (online).

    A drafter's confidence is rarely calibrated: an n-gram path's empirical probability stays flat along a single
    matched continuation while the chance that the target still agrees decays with depth, and short matches are
    overrated in chat. Sizing a tree needs probabilities, so each (score bin, depth bucket) cell keeps decayed
    counts of drafted and accepted nodes, starting from `prior_count` pseudo-nodes accepted at the bin's centre
    score (an unseen cell trusts the score).

    Args:
        num_bins (`int`, *optional*, defaults to 10): equal-width score bins over `[0, 1]`.
        prior_count (`float`, *optional*, defaults to 4.0): pseudo-observations per cell.
        decay (`float`, *optional*, defaults to 0.995): counts are multiplied by this at every update.
    """

    DEPTH_BUCKETS = (1, 2, 4, 8)  # depth 1, 2, 3-4, 5-8, 9+

    def __init__(self, num_bins: int = 10, prior_count: float = 4.0, decay: float = 0.995):
        self.num_bins = num_bins
        self.decay = decay
        centres = [(i + 0.5) / num_bins for i in range(num_bins)]
        cells = len(self.DEPTH_BUCKETS) + 1
        self.drafted = [[prior_count] * num_bins for _ in range(cells)]
        self.accepted = [[prior_count * c for c in centres] for _ in range(cells)]

    def _cell(self, score: float, depth: int) -> tuple[int, int]:
        bucket = sum(depth > limit for limit in self.DEPTH_BUCKETS)
        return bucket, min(self.num_bins - 1, max(0, int(score * self.num_bins)))

    def probability(self, score: float, depth: int = 1) -> float:
        d, b = self._cell(score, depth)
        return self.accepted[d][b] / self.drafted[d][b]

    def observe(self, scores: list[float], accepted: list[bool], depths: list[int] | None = None) -> None:
        """Records one pass of one row: the drafted nodes' scores, depths, and whether each was accepted."""
        self.drafted = [[x * self.decay for x in row] for row in self.drafted]
        self.accepted = [[x * self.decay for x in row] for row in self.accepted]
        for i, (score, ok) in enumerate(zip(scores, accepted)):
            d, b = self._cell(score, 1 if depths is None else depths[i])
            self.drafted[d][b] += 1.0
            self.accepted[d][b] += float(ok)

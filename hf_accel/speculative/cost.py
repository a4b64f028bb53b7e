"""How long a target pass over `T` input tokens takes: a default shape refined online by measured passes.

Drafters size their proposals by expected tokens per second of target time, so they need the cost of a pass over
`batch_size * (nodes + 1)` tokens relative to a plain decoding pass. That curve depends on the hardware, the thread
count and, on shared machines, on the load (issue 6 measured, on 2 idle cores: 1.0 at one token, 1.3-1.45 for 2-16,
2.0 at 32, 4.1 at 64; on the same cores shared with other jobs, 16 tokens cost about 2x). So the engine reports the
wall time of every verification pass ([`VerifyResult.pass_seconds`]: forward, acceptance, commit and cache
rollback, so per-row work such as sampled acceptance counts too) and [`PassCostModel`] keeps an exponential moving
average per token count; a count never measured takes the default shape, scaled by the measured count nearest to it
(in log scale).
"""

import itertools
import math


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
        momentum (`float`, *optional*, defaults to 0.7): weight of the old average in each update.
        adaptive (`bool`, *optional*, defaults to `True`): learn from observations (`False`: the default shape only).
    """

    def __init__(self, default_points=DEFAULT_VERIFY_COST, momentum: float = 0.7, adaptive: bool = True):
        self.default_points = check_cost_points(default_points)
        self.momentum = momentum
        self.adaptive = adaptive
        self.observed: dict[int, float] = {}

    def observe(self, num_tokens: int, seconds: float) -> None:
        if not self.adaptive or seconds <= 0:
            return
        old = self.observed.get(num_tokens)
        self.observed[num_tokens] = seconds if old is None else self.momentum * old + (1 - self.momentum) * seconds

    def cost(self, num_tokens: int) -> float:
        """Estimated cost (seconds once anything was observed, default units before)."""
        # a snapshot: a drafter serving `generate` calls in several threads observes a new pass size meanwhile, and
        # the scan below failed with 'dictionary changed size during iteration'
        observed = self.observed.copy()
        if num_tokens in observed:
            return observed[num_tokens]
        default = interpolate_cost(num_tokens, self.default_points)
        if not observed:
            return default
        nearest = min(observed, key=lambda t: abs(math.log(t) - math.log(num_tokens)))
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

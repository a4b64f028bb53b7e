"""Rank allocation under a global KV-cache budget: water-filling (CARE-E), uniform (CARE-U), and gain functions.

A *matrix* is one K or V projection of one layer, indexed `m = 2·layer + (0 for K, 1 for V)`. Its *gains* are the
non-increasing marginal values of keeping one more latent dimension (`gains[m][i]` for going from rank `i` to
`i + 1`). Water-filling maximises `Σ_m Σ_{i<r_m} gains[m][i]` subject to `Σ_m r_m = budget` and
`floor_m ≤ r_m ≤ cap_m`. With non-increasing gains the greedy (spec Algorithm 2) is exactly optimal and equals the
sorted closed form implemented here: every matrix starts at its floor, then the `budget − Σ floor` largest remaining
gains are taken. Ties go to the lower matrix index (lower layer first, then K before V), then the lower rank.
"""

import heapq
import numbers
from collections.abc import Sequence

import torch


def budget_from_kv_keep(widths: Sequence[int], kv_keep: float) -> int:
    """Total latent width `round(kv_keep · Σ widths)`; raises `ValueError` for `kv_keep` outside (0, 1]."""
    # numpy floats too; a bool is a `numbers.Real` but never a fraction someone meant
    if isinstance(kv_keep, bool) or not (isinstance(kv_keep, numbers.Real) and 0.0 < kv_keep <= 1.0):
        raise ValueError(f"kv_keep must be in (0, 1] (the fraction of the K+V cache to keep), got {kv_keep!r}")
    return max(len(widths), round(kv_keep * sum(widths)))


def uniform_ranks(widths: Sequence[int], kv_keep: float, caps: Sequence[int] | None = None) -> list[int]:
    """CARE-U: the same fraction `kv_keep` of every matrix's (output) width, `max(1, round(kv_keep · width))`, at
    most its cap (its largest rank, which is below the width when the input is narrower; default: the width)."""
    budget_from_kv_keep(widths, kv_keep)  # validates kv_keep
    caps = widths if caps is None else caps
    return [max(1, min(cap, round(kv_keep * width))) for width, cap in zip(widths, caps, strict=True)]


def water_fill(
    gains: Sequence[torch.Tensor],
    budget: int,
    caps: Sequence[int] | None = None,
    floors: Sequence[int] | int = 1,
) -> list[int]:
    """Exact water-filling by the sorted closed form (spec Stage 4).

    Args:
        gains (sequence of `torch.Tensor` of shape `[R_m]`): marginal gains per matrix, each non-increasing.
        budget (`int`): the total rank `Σ_m r_m` to hand out.
        caps (sequence of `int`, *optional*): per-matrix maximum ranks (default: `len(gains[m])`).
        floors (`int` or sequence of `int`, *optional*, defaults to 1): per-matrix minimum ranks (the spec starts
            every matrix at 1).

    Returns:
        `list[int]`: the ranks, summing to `budget`.
    """
    caps = [len(g) for g in gains] if caps is None else [min(int(c), len(g)) for c, g in zip(caps, gains, strict=True)]
    floors = [floors] * len(gains) if isinstance(floors, int) else list(floors)
    floors = [min(f, c) for f, c in zip(floors, caps, strict=True)]
    if not sum(floors) <= budget <= sum(caps):
        raise ValueError(f"budget {budget} is outside [{sum(floors)}, {sum(caps)}] (floors and caps of the matrices)")
    # Pool every gain above the floor and below the cap, then take the largest: (-gain, matrix, rank) sorts ties.
    values, owners, positions = [], [], []
    for m, (g, lo, hi) in enumerate(zip(gains, floors, caps)):
        values.append(g[lo:hi].double().cpu())
        owners.append(torch.full((hi - lo,), m, dtype=torch.long))
        positions.append(torch.arange(lo, hi))
    values, owners, positions = torch.cat(values), torch.cat(owners), torch.cat(positions)
    # Stable lexicographic sort: by rank, then matrix, then descending gain.
    order = torch.argsort(positions, stable=True)
    order = order[torch.argsort(owners[order], stable=True)]
    order = order[torch.argsort(-values[order], stable=True)]
    taken = owners[order[: budget - sum(floors)]]
    counts = torch.bincount(taken, minlength=len(gains)).tolist()
    return [f + c for f, c in zip(floors, counts)]


def water_fill_greedy(gains, budget, caps=None, floors=1) -> list[int]:
    """The heap greedy of spec Algorithm 2 (with caps), the reference that `water_fill` is tested against."""
    caps = [len(g) for g in gains] if caps is None else [min(int(c), len(g)) for c, g in zip(caps, gains, strict=True)]
    ranks = [
        min(f, c) for f, c in zip([floors] * len(gains) if isinstance(floors, int) else floors, caps, strict=True)
    ]
    heap = [(-float(g[r]), m) for m, (g, r) in enumerate(zip(gains, ranks)) if r < caps[m]]
    heapq.heapify(heap)
    for _ in range(budget - sum(ranks)):
        _, m = heapq.heappop(heap)
        ranks[m] += 1
        if ranks[m] < caps[m]:
            heapq.heappush(heap, (-float(gains[m][ranks[m]]), m))
    return ranks


def raw_sigma_gains(sigmas: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The spec's gains: raw singular values `σ_{m,i}` (CARE-E as written; `care-e-raw`)."""
    return [s.double() for s in sigmas]


def relative_energy_gains(sigmas: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per-matrix relative energy `σ²_{m,i} / Σ_j σ²_{m,j}`: the fraction of that matrix's output energy kept."""
    return [s.double() ** 2 / (s.double() ** 2).sum().clamp_min(1e-300) for s in sigmas]

"""Fisher-information rank allocation for Palu (spec 002 §2.4, "Sec. 3.3" of the paper, and its code notes).

Two parts, kept apart so the math is tested on hand values:

- [`collect_fisher_scores`] runs the causal-LM loss over calibration sequences, one sequence per backward pass, and
  accumulates the squared gradient of every `k_proj`/`v_proj` weight. The importance of a projection is the mean
  over its elements of `sqrt(Σ_samples g² / N)` (the Palu code's estimate; the paper says "sum", which ranks
  equal-size targets alike). Labels are the standard `labels=input_ids` (spec §2.4 notes the code's double shift).
- [`allocate_fisher_ranks`] hands out a global rank budget in proportion to the scores, with per-target caps (full
  rank) and floors (one unit), redistributes what capped targets cannot take, rounds to a chosen multiple, and sums
  **exactly** to the budget (largest-remainder rounding, ties to the lower index).
"""

import math
from collections.abc import Sequence

import torch

from ..log import progress_bar


def _proportional_shares(scores: list[float], caps: list[int], floors: list[int], budget: int) -> list[float]:
    """Real-valued shares `∝ score`, clipped to `[floor, cap]`, summing to `budget` (iterative clipping)."""
    fixed: dict[int, float] = {}
    while True:
        free = [i for i in range(len(scores)) if i not in fixed]
        if not free:
            return [fixed[i] for i in range(len(scores))]
        left = budget - sum(fixed.values())
        total = sum(scores[i] for i in free)
        if total > 0:
            shares = {i: left * scores[i] / total for i in free}
        else:  # all remaining scores are zero: split evenly
            shares = {i: left / len(free) for i in free}
        over = [i for i in free if shares[i] > caps[i]]
        under = [i for i in free if shares[i] < floors[i]]
        if not over and not under:
            return [fixed[i] if i in fixed else shares[i] for i in range(len(scores))]
        # Clip the side that is violated most; the other side is re-examined after redistribution
        over_excess = sum(shares[i] - caps[i] for i in over)
        under_deficit = sum(floors[i] - shares[i] for i in under)
        if over_excess >= under_deficit:
            fixed.update({i: float(caps[i]) for i in over})
        else:
            fixed.update({i: float(floors[i]) for i in under})


def allocate_fisher_ranks(scores: Sequence[float], caps: Sequence[int], budget: int, multiple: int = 1) -> list[int]:
    """
    Ranks proportional to Fisher scores under a global budget, with caps, floors and rounding to a multiple.

    Each target `t` gets `r_t ≈ budget · score_t / Σ score`, clipped to `[multiple, cap_t]`; what a capped target
    cannot take is redistributed over the others in proportion to their scores; then every `r_t` is a multiple of
    `multiple` and `Σ r_t == budget` exactly (largest remainders first, ties to the lower index).

    Args:
        scores (sequence of `float`): non-negative importance per target (e.g. per layer K, then V).
        caps (sequence of `int`): the largest rank of each target (its full width), a multiple of `multiple`.
        budget (`int`): the total rank to hand out, a multiple of `multiple` in `[n · multiple, Σ cap_t]`.
        multiple (`int`, *optional*, defaults to 1): rank granularity of every target (for Palu: number of groups ×
            the per-group rounding).

    Returns:
        `list[int]`: ranks, each a multiple of `multiple`, within `[multiple, cap_t]`, summing to `budget`.

    Example:

    ```python
    >>> allocate_fisher_ranks([3.0, 1.0], caps=[8, 8], budget=8)
    [6, 2]
    >>> allocate_fisher_ranks([9.0, 1.0, 1.0], caps=[4, 8, 8], budget=10)  # the capped target's excess is shared
    [4, 3, 3]

    ```
    """
    n = len(scores)
    unit = int(multiple)
    if n == 0 or len(caps) != n:
        raise ValueError(f"scores and caps must have the same non-zero length, got {n} and {len(caps)}")
    if any(s < 0 or not math.isfinite(s) for s in scores):
        raise ValueError(f"Fisher scores must be finite and non-negative, got {list(scores)}")
    if unit < 1 or any(c < unit or c % unit for c in caps):
        raise ValueError(f"every cap must be a positive multiple of the rank multiple {unit}, got caps {list(caps)}")
    # Work in units of `multiple`
    if budget % unit or not n * unit <= budget <= sum(caps):
        raise ValueError(
            f"budget {budget} must be a multiple of {unit} within [{n * unit}, {sum(caps)}] (floors and caps)"
        )
    cap_units, budget_units = [c // unit for c in caps], budget // unit
    largest = max(scores)  # scaled to at most 1: the sum of scores near the float range would overflow
    shares = _proportional_shares([s / largest if largest else 0.0 for s in scores], cap_units, [1] * n, budget_units)
    ranks = [min(cap_units[i], max(1, math.floor(shares[i] + 1e-9))) for i in range(n)]
    # Largest remainder first; only targets below their cap can take one more unit
    order = sorted(range(n), key=lambda i: (-(shares[i] - ranks[i]), i))
    deficit = budget_units - sum(ranks)
    # never negative: every share is at least its floor of 1, so each rank is at most its share (+1e-9), and the
    # shares sum to the budget
    while deficit > 0:  # feasible budgets always leave room below some cap
        for i in order:
            if deficit > 0 and ranks[i] < cap_units[i]:
                ranks[i] += 1
                deficit -= 1
    return [r * unit for r in ranks]


def projection_importance(mean_squared_grad: torch.Tensor) -> float:
    """A projection's importance from its weights' mean squared gradients: the mean over elements of their square
    root (the Palu code's estimate; spec §2.4 and its gaps list, item 3)."""
    return mean_squared_grad.sqrt().mean().item()


def collect_fisher_scores(model, input_ids: torch.Tensor, progress: bool = True) -> list[tuple[float, float]]:
    """
    Per layer `(score_K, score_V)`: mean over elements of `sqrt(mean_samples g²)` of the k/v_proj weights.

    Args:
        model (`PreTrainedModel`): the original causal LM (`model.model.layers[i].self_attn.{k,v}_proj`).
        input_ids (`torch.LongTensor` of shape `[N, S]`): calibration sequences, one backward pass each.
        progress (`bool`, *optional*, defaults to `True`): show a progress bar.

    Returns:
        `list[tuple[float, float]]`, one pair per layer.
    """
    from .calibration import check_calibration_ids

    check_calibration_ids(input_ids)  # a one-token row has no loss: all-zero scores
    projections = [(layer.self_attn.k_proj, layer.self_attn.v_proj) for layer in model.model.layers]
    weights = [proj.weight for pair in projections for proj in pair]
    was_grad = [p.requires_grad for p in model.parameters()]
    squares = [torch.zeros_like(w, dtype=torch.float32) for w in weights]
    device = next(model.parameters()).device
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for w in weights:
            w.requires_grad_(True)
        for row in progress_bar(input_ids, progress, desc="fisher"):
            ids = row[None].to(device)
            with torch.enable_grad():
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                grads = torch.autograd.grad(loss, weights)
            for acc, g in zip(squares, grads):
                acc += g.float() ** 2
    finally:
        for p, flag in zip(model.parameters(), was_grad):
            p.requires_grad_(flag)
    fisher = [projection_importance(acc / len(input_ids)) for acc in squares]
    return [(fisher[2 * i], fisher[2 * i + 1]) for i in range(len(projections))]

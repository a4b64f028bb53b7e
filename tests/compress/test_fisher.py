"""Fisher-proportional rank allocation (spec 002 §2.4): hand values, exact budget, caps, floors, multiples."""

import random

import pytest
import torch

from hf_accel.compress.fisher import allocate_fisher_ranks, collect_fisher_scores
from tests.conftest import make_tiny_llama


def test_hand_values():
    assert allocate_fisher_ranks([3.0, 1.0], caps=[8, 8], budget=8) == [6, 2]
    # the capped target's excess goes to the others, in proportion to their scores
    assert allocate_fisher_ranks([9.0, 1.0, 1.0], caps=[4, 8, 8], budget=10) == [4, 3, 3]
    assert allocate_fisher_ranks([9.0, 2.0, 1.0], caps=[4, 8, 8], budget=10) == [4, 4, 2]
    # floors: a zero score still keeps one unit; ties in the remainders go to the lower index
    assert allocate_fisher_ranks([1.0, 0.0, 1.0], caps=[8, 8, 8], budget=9) == [4, 1, 4]
    # multiples: units of 8, 0.1/5/0.1/0.1 with a cap at 64
    assert allocate_fisher_ranks([0.1, 5, 0.1, 0.1], caps=[64] * 4, budget=128, multiple=8) == [24, 64, 24, 16]


def test_random_cases_sum_to_budget_and_respect_caps():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 12)
        unit = rng.choice([1, 2, 8, 32])
        caps = [unit * rng.randint(1, 10) for _ in range(n)]
        scores = [rng.choice([0.0, rng.random(), 10 * rng.random()]) for _ in range(n)]
        budget = unit * rng.randint(n, sum(caps) // unit)
        ranks = allocate_fisher_ranks(scores, caps, budget, unit)
        assert sum(ranks) == budget
        assert all(unit <= r <= c and r % unit == 0 for r, c in zip(ranks, caps))
        # without binding caps or floors, each rank is within one unit of its proportional share
        total = sum(scores)
        if total > 0 and all(
            budget * s / total <= c - unit and budget * s / total >= unit for s, c in zip(scores, caps)
        ):
            assert all(abs(r - budget * s / total) < unit + 1e-9 for r, s in zip(ranks, scores))


def test_full_budget_gives_caps_and_bad_budgets_raise():
    assert allocate_fisher_ranks([1.0, 5.0], caps=[16, 32], budget=48, multiple=8) == [16, 32]
    with pytest.raises(ValueError, match="budget"):
        allocate_fisher_ranks([1.0, 1.0], caps=[8, 8], budget=17)
    with pytest.raises(ValueError, match="multiple"):
        allocate_fisher_ranks([1.0, 1.0], caps=[8, 8], budget=12, multiple=8)
    with pytest.raises(ValueError, match="non-negative"):
        allocate_fisher_ranks([1.0, -1.0], caps=[8, 8], budget=8)


def test_collect_fisher_scores_matches_manual_gradients():
    model = make_tiny_llama()
    ids = torch.randint(3, 97, (3, 10), generator=torch.Generator().manual_seed(0))
    scores = collect_fisher_scores(model, ids, progress=False)
    assert len(scores) == model.config.num_hidden_layers
    squares = 0
    for row in ids:
        model.zero_grad()
        model(input_ids=row[None], labels=row[None]).loss.backward()
        squares = squares + model.model.layers[1].self_attn.v_proj.weight.grad ** 2
    expected = (squares / len(ids)).sqrt().mean().item()
    assert scores[1][1] == pytest.approx(expected, rel=1e-5)
    assert all(p.requires_grad for p in model.parameters())  # flags restored


def test_largest_remainders_by_hand():
    # shares 1.9 and 5.1 of 7: floors 1 and 5, the one unit left goes to the larger remainder (0.9), not the larger share
    assert allocate_fisher_ranks([1.9, 5.1], caps=[8, 8], budget=7) == [2, 5]
    # shares 2.5 and 3.5: equal remainders, the unit goes to the lower index (no round-half-to-even)
    assert allocate_fisher_ranks([2.5, 3.5], caps=[8, 8], budget=6) == [3, 3]


def test_floor_is_fixed_before_the_others_share_the_rest():
    # shares 18.0, 1.8, 0.18 of 20: the last target is raised to its floor of 1, the other two split the 19 left
    # 100:10 (17.27, 1.73), and the leftover unit goes to the larger remainder
    assert allocate_fisher_ranks([100.0, 10.0, 1.0], caps=[32] * 3, budget=20) == [17, 2, 1]


def test_a_share_over_its_cap_by_rounding_alone_is_fixed_at_the_cap():
    # 5 · 0.49 / 0.49 rounds to 5.000000000000001: the only target is capped, leaving none to share the rest
    assert allocate_fisher_ranks([0.49], caps=[5], budget=5) == [5]
    # every target clipped, one to its floor and two to their caps, a share of 6 rounding over its cap of 6
    assert allocate_fisher_ranks([0.0, 0.1, 0.2], caps=[2, 2, 6], budget=9) == [1, 2, 6]


@pytest.mark.parametrize(
    "scores, caps, multiple, message",
    [
        ([], [], 1, "same non-zero length, got 0 and 0"),
        ([1.0, 1.0], [8], 1, "same non-zero length, got 2 and 1"),
        ([1.0, 1.0], [8, 12], 8, r"positive multiple of the rank multiple 8, got caps \[8, 12\]$"),
        ([1.0, 1.0], [8, 8], 0, r"positive multiple of the rank multiple 0, got caps \[8, 8\]$"),
    ],
)
def test_mismatched_lengths_and_caps_are_refused_in_one_line(scores, caps, multiple, message):
    with pytest.raises(ValueError, match=message):
        allocate_fisher_ranks(scores, caps, budget=8, multiple=multiple)


def test_scores_near_the_float_range_are_shared_as_their_ratios():
    # their sum overflows to infinity: the shares are taken on the scores scaled to at most 1
    assert allocate_fisher_ranks([1e308, 1e308], caps=[4, 4], budget=4) == [2, 2]
    assert allocate_fisher_ranks([1.5e308, 0.5e308], caps=[8, 8], budget=8) == [6, 2]
